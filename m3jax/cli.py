"""`m3jax` command line.

    m3jax generate --prompt "..." [--model DIR] [--temperature T --top-p P ...]   one prompt, streamed
    m3jax serve [--model DIR|preset] [--grpc-port N] [--http-port N] ...   gRPC + OpenAI-compatible HTTP server
    m3jax bench serve --base-url URL [--concurrency 1,4,8] ...            serving benchmark (InferenceX contract)
    m3jax --version

Every flag's help shows its default. Errors are one line on stderr, `error: ...`, naming the flag at fault.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

_ENGINE_GROUPS = ("model", "engine", "kernels")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Wider help columns; defaults are written into each flag's help text."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32, width=min(120, _terminal_width()))


def _terminal_width() -> int:
    import shutil

    return shutil.get_terminal_size((100, 24)).columns


def _token_ids(text: str) -> list[int]:
    """--prompt-ids / --stop-token-ids: comma-separated non-negative integers."""
    ids = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit():
            raise argparse.ArgumentTypeError(f"{part!r} is not a token id (comma-separated integers, e.g. 1,2,3)")
        ids.append(int(part))
    if not ids:
        raise argparse.ArgumentTypeError("no token ids (comma-separated integers, e.g. 1,2,3)")
    return ids


# `m3jax generate`'s sampling flags: SamplingParams fields, with generate's own defaults (greedy, 64 tokens).
_SAMPLING_FLAGS: list[tuple[str, type | None, object, str]] = [
    ("max_tokens", int, 64, "tokens to generate at most"),
    ("temperature", float, 0.0, "sampling temperature (0: greedy)"),
    ("top_p", float, 1.0, "nucleus sampling: keep the smallest set of tokens whose probability reaches this (1: off)"),
    ("top_k", int, 0, "keep only the k most likely tokens (0: off)"),
    ("min_p", float, 0.0, "drop tokens less likely than this times the most likely one (0: off)"),
    ("repetition_penalty", float, 1.0, "divide the logits of tokens already seen by this (1: off)"),
    ("presence_penalty", float, 0.0, "subtract this from the logits of tokens already generated (0: off)"),
    ("frequency_penalty", float, 0.0, "subtract this times the count of each generated token (0: off)"),
]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _user_flags(message: str) -> str:
    """An engine or SamplingParams message says `max_tokens`; the user typed `--max-tokens`."""
    names = [n for n, *_ in _SAMPLING_FLAGS] + ["stop_token_ids", "stop", "ignore_eos", "seed"]
    return re.sub(r"\b(" + "|".join(names) + r")\b", lambda m: _flag(m.group(1)), message, count=1)


def _sampling_params(args: argparse.Namespace) -> object:
    from serving import SamplingParams

    kwargs = {name: getattr(args, name) for name, *_ in _SAMPLING_FLAGS}
    try:
        return SamplingParams(**kwargs, stop=args.stop or None, stop_token_ids=args.stop_token_ids,
                              ignore_eos=args.ignore_eos)
    except ValueError as e:
        raise ValueError(_user_flags(str(e))) from None


def _generate(args: argparse.Namespace) -> int:
    from m3jax.settings import Settings
    from serving import LLM

    settings = Settings.from_args(args)  # every flag checked before anything loads
    params = _sampling_params(args)
    t0 = time.perf_counter()
    llm = LLM(**{f: getattr(settings, f) for f in Settings.field_names(_ENGINE_GROUPS)})
    try:
        if args.prompt_ids is not None:
            prompt: str | list[int] = args.prompt_ids
        elif llm.tokenizer is None:
            raise ValueError(f"{settings.model} has no tokenizer.json: pass --prompt-ids 1,2,3")
        else:
            prompt = args.prompt
        print(f"[m3jax] loaded {settings.model or 'the embedded model'} in {time.perf_counter() - t0:.1f}s",
              file=sys.stderr)
        # The engine's own checks (prompt and --max-tokens within the model length, ids in the vocabulary) before
        # the prompt is echoed, so that an error is a line of its own.
        try:
            llm.core.prepare(prompt, params)
        except ValueError as e:
            hint = " (see --max-model-len)" if "model length" in str(e) else ""
            raise ValueError(_user_flags(str(e)) + hint) from None
        t1 = time.perf_counter()
        n = 0
        sys.stdout.write(prompt if isinstance(prompt, str) else "")
        for out in llm.stream(prompt, params):
            n += len(out.delta_token_ids)
            sys.stdout.write(out.delta_text if llm.tokenizer is not None else "".join(f"{t} " for t in
                                                                                       out.delta_token_ids))
            sys.stdout.flush()
        sys.stdout.write("\n")
        dt = time.perf_counter() - t1
        print(f"[m3jax] {n} tokens in {dt:.2f}s ({n / max(dt, 1e-9):.1f} tok/s, first includes compilation), "
              f"finish reason: {out.outputs[0].finish_reason}", file=sys.stderr)
    finally:
        llm.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from m3jax.config import PRESETS
    from m3jax.settings import add_arguments

    p = argparse.ArgumentParser(prog="m3jax", description="MiniMax M3 in JAX: generate, serve, benchmark.\n"
                                "Models (--model): a checkpoint directory, a preset with random weights "
                                f"({', '.join(PRESETS)}),\nor none: the embedded tiny model.",
                                formatter_class=_Formatter)
    p.add_argument("--version", action="version", version=f"m3jax {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{generate,serve,bench}")
    g = sub.add_parser("generate", help="stream one prompt's continuation (greedy unless sampling flags say "
                       "otherwise)", formatter_class=_Formatter,
                       description="Stream the continuation of one prompt. Sampling is seeded by --seed.")
    g.add_argument("--prompt", default="def fibonacci(n):", help="text to continue (default: 'def fibonacci(n):')")
    g.add_argument("--prompt-ids", type=_token_ids, default=None, metavar="IDS",
                   help="comma-separated token ids instead of --prompt (default: unset)")
    sampling = g.add_argument_group("sampling")
    for name, kind, default, text in _SAMPLING_FLAGS:
        sampling.add_argument(_flag(name), type=kind, default=default, help=f"{text} (default: {default})")
    sampling.add_argument("--stop", action="append", default=None, metavar="TEXT",
                          help="stop when the output contains TEXT (repeat the flag for several; default: none)")
    sampling.add_argument("--stop-token-ids", type=_token_ids, default=None, metavar="IDS",
                          help="comma-separated token ids that stop the output (default: none)")
    sampling.add_argument("--ignore-eos", action="store_true",
                          help="go on past the end-of-sequence token (default: off)")
    add_arguments(g, _ENGINE_GROUPS)
    # One prompt: compile only the step shapes it uses rather than every shape up front.
    g.set_defaults(func=_generate, warmup=False)

    from serving import bench, server

    s = sub.add_parser("serve", help="serve a model over gRPC and an OpenAI-compatible HTTP API",
                       formatter_class=_Formatter,
                       description="Serve a model over gRPC and an OpenAI-compatible HTTP API.\nFlags are checked "
                       "and both ports bound before the model loads; SIGINT / SIGTERM stop it with exit 0\nat any "
                       "moment (draining in-flight requests once it serves).")
    server.add_arguments(s)
    s.set_defaults(func=_serve)

    b = sub.add_parser("bench", help="benchmarks", formatter_class=_Formatter)
    bsub = b.add_subparsers(dest="bench_command", required=True)
    bs = bsub.add_parser("serve", help="serving benchmark against an OpenAI-compatible server")
    bench.add_arguments(bs)
    bs.set_defaults(func=_bench_serve)
    return p


def version() -> str:
    """The installed m3jax distribution's version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("m3jax")
    except PackageNotFoundError:
        return "0+unknown"


def _serve(args: argparse.Namespace) -> int:
    from serving.server import serve

    return serve(args)


def _bench_serve(args: argparse.Namespace) -> int:
    from serving.bench import run

    return run(args)


def _exit_on_signals() -> None:
    """`serve`: from the first moment, SIGINT / SIGTERM exit 0 (nothing has started yet). The server replaces
    these handlers with its own once its modules are imported (jax among them: seconds)."""
    import os
    import signal

    def bye(signum: int, _frame: object) -> None:
        print(f"{signal.Signals(signum).name} during start-up (importing): exiting", file=sys.stderr, flush=True)
        os._exit(0)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, bye)


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["serve"]:
        _exit_on_signals()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        sys.stdout.flush()
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
