"""`m3jax` command line.

    m3jax generate --prompt "..." [--model DIR]      greedy decoding of one prompt
    m3jax serve [--model DIR|preset] [--grpc-port N] [--http-port N] ...   gRPC + OpenAI-compatible HTTP server
    m3jax bench serve --base-url URL [--concurrency 1,4,8] ...            serving benchmark (InferenceX contract)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _generate(args: argparse.Namespace) -> int:
    from tokenizers import Tokenizer

    from m3jax.api import load_model

    t0 = time.perf_counter()
    model = load_model(args.model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size)
    tok_path = model.path / "tokenizer.json" if model.path else None
    tokenizer = Tokenizer.from_file(str(tok_path)) if tok_path and tok_path.exists() else None
    if args.prompt_ids is not None:
        ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    elif tokenizer is None:
        print(f"error: {model.path} has no tokenizer.json; pass --prompt-ids 1,2,3", file=sys.stderr)
        return 2
    else:
        ids = tokenizer.encode(args.prompt, add_special_tokens=False).ids
    if not ids:
        print("error: the prompt is empty", file=sys.stderr)
        return 2
    print(f"[m3jax] loaded {model.path} in {time.perf_counter() - t0:.1f}s; prompt {len(ids)} tokens",
          file=sys.stderr)
    out: list[int] = []
    printed = ""
    t1 = time.perf_counter()
    sys.stdout.write(args.prompt if tokenizer is not None and args.prompt_ids is None else "")
    for tok in model.generate_greedy(ids, args.max_tokens, stop_ids=model.cfg.eos_token_ids):
        out.append(tok)
        if tokenizer is None:
            sys.stdout.write(f"{tok} ")
        else:
            # Decode the whole continuation and print the new suffix: never splits a multi-byte character.
            text = tokenizer.decode(out, skip_special_tokens=True)
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[len(printed):])
                printed = text
        sys.stdout.flush()
    sys.stdout.write("\n")
    dt = time.perf_counter() - t1
    print(f"[m3jax] {len(out)} tokens in {dt:.2f}s ({len(out) / max(dt, 1e-9):.1f} tok/s, first includes "
          f"compilation)", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="m3jax", description="MiniMax M3 in JAX")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="greedy decoding of one prompt")
    g.add_argument("--model", type=Path, default=None,
                   help="checkpoint directory (Hugging Face layout); default: the embedded tiny model")
    g.add_argument("--prompt", default="def fibonacci(n):")
    g.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead of --prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    g.add_argument("--tensor-parallel-size", type=int, default=1)
    g.set_defaults(func=_generate)

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
