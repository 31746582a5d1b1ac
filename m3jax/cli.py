"""`m3jax` command line.

    m3jax generate --prompt "..." [--model DIR]      greedy decoding of one prompt
    m3jax serve [--model DIR|preset] [--grpc-port N] [--http-port N] ...   gRPC + OpenAI-compatible HTTP server
    m3jax bench serve --base-url URL [--concurrency 1,4,8] ...            serving benchmark (InferenceX contract)
"""

from __future__ import annotations

import argparse
import sys
import time

_ENGINE_GROUPS = ("model", "engine", "kernels")


def _generate(args: argparse.Namespace) -> int:
    from m3jax.settings import Settings
    from serving import LLM, SamplingParams

    t0 = time.perf_counter()
    settings = Settings.from_args(args)
    llm = LLM(**{f: getattr(settings, f) for f in Settings.field_names(_ENGINE_GROUPS)})
    if args.prompt_ids is not None:
        prompt: str | list[int] = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    elif llm.tokenizer is None:
        print(f"error: {settings.model} has no tokenizer.json; pass --prompt-ids 1,2,3", file=sys.stderr)
        return 2
    else:
        prompt = args.prompt
    print(f"[m3jax] loaded {settings.model or 'the embedded model'} in {time.perf_counter() - t0:.1f}s",
          file=sys.stderr)
    t1 = time.perf_counter()
    n = 0
    sys.stdout.write(args.prompt if isinstance(prompt, str) else "")
    for out in llm.stream(prompt, SamplingParams(temperature=0.0, max_tokens=args.max_tokens)):
        n += len(out.delta_token_ids)
        sys.stdout.write(out.delta_text if llm.tokenizer is not None else "".join(f"{t} " for t in
                                                                                   out.delta_token_ids))
        sys.stdout.flush()
    sys.stdout.write("\n")
    dt = time.perf_counter() - t1
    print(f"[m3jax] {n} tokens in {dt:.2f}s ({n / max(dt, 1e-9):.1f} tok/s, first includes compilation)",
          file=sys.stderr)
    llm.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from m3jax.settings import add_arguments

    p = argparse.ArgumentParser(prog="m3jax", description="MiniMax M3 in JAX")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="greedy decoding of one prompt",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("--prompt", default="def fibonacci(n):", help="text to continue")
    g.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead of --prompt")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    add_arguments(g, _ENGINE_GROUPS)
    # One prompt: compile only the step shapes it uses rather than every shape up front.
    g.set_defaults(func=_generate, warmup=False)

    from serving import bench, server

    s = sub.add_parser("serve", help="serve a model over gRPC and an OpenAI-compatible HTTP API")
    server.add_arguments(s)
    s.set_defaults(func=_serve)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    bs = bsub.add_parser("serve", help="serving benchmark against an OpenAI-compatible server")
    bench.add_arguments(bs)
    bs.set_defaults(func=_bench_serve)
    return p


def _serve(args: argparse.Namespace) -> int:
    from serving.server import serve

    return serve(args)


def _bench_serve(args: argparse.Namespace) -> int:
    from serving.bench import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
