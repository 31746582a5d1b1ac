"""The host's cost of structured output per engine step: grammar masks for a batch of requests at M3's
vocabulary size, against the device step they must hide under.

No M3 tokenizer ships with the project (the real one is part of the weights), so a byte-level BPE tokenizer of
M3's size (200,061 tokens + padding to the model's 200,064 rows) is trained on this machine's Python sources
(~160 MB: the standard library and site-packages), about 40 s on 2 cores, kept in `--tokenizer-cache`. Its
tokens are code-heavy; what matters for llguidance's mask cost is the vocabulary's size and the trie of its
byte strings, which this has at M3's scale.

Each of `--batch` requests holds a JSON-schema grammar (a tool call's arguments: strings, numbers, an enum, an
array of objects) part-way through a valid document, each at a different point; every step builds the masks of
all rows (`TokenConstraints.build` + `Grammars.fill_rows`, what the engine core runs while the device runs the
forward), then each request consumes its next token. Reported per step: median and p99 ms.

    PYTHONPATH=. python benchmarks/bench_structured.py [--batch 64] [--steps 60]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import time
from pathlib import Path

from benchmarks.timing import git_rev

VOCAB_ROWS = 200064  # M3's embedding rows
SCHEMA = {
    "type": "object",
    "properties": {
        "location": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "stations": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["name", "lat", "lon"]}},
    },
    "required": ["location", "unit", "days", "stations"],
}


def m3_sized_tokenizer(cache: Path) -> str:
    """The JSON of a byte-level BPE tokenizer with 200,061 tokens (the module docstring)."""
    if cache.is_file():
        return cache.read_text()
    import sys

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    roots = [os.path.dirname(os.__file__), *sorted(p for p in sys.path if p.endswith("site-packages"))]
    files = sorted({f for r in roots for f in glob.glob(r + "/**/*.py", recursive=True)})

    def texts():
        for f in files:
            try:
                yield Path(f).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue

    print(f"training a 200,061-token BPE tokenizer on {len(files)} files ...", flush=True)
    t0 = time.perf_counter()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=200061, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer)
    print(f"  {tok.get_vocab_size()} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
    cache.parent.mkdir(parents=True, exist_ok=True)
    text = tok.to_str()
    cache.write_text(text)
    return text


def _document(i: int) -> str:
    stations = [{"name": f"station {i}-{j}", "lat": 47.5 + j / 7, "lon": -122.25 - j / 3} for j in range(1 + i % 4)]
    return json.dumps({"location": f"Seattle, district {i}", "unit": "celsius", "days": 1 + i % 14,
                       "stations": stations})  # the separators serving.structured.JSON_OPTIONS fixes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--tokenizer-cache", default=str(Path.home() / ".cache" / "m3jax" / "bpe-200k.json"))
    ap.add_argument("--device-step-from", default="benchmarks/results/spec-h200.json",
                    help="the H200 plain decode step at this batch, for the comparison")
    ap.add_argument("--out", default="benchmarks/results/structured-mask.json")
    args = ap.parse_args()

    from tokenizers import Tokenizer

    from serving.sampling import TokenConstraints
    from serving.structured import Grammars, StructuredOutputsParams

    text = m3_sized_tokenizer(Path(args.tokenizer_cache))
    tok = Tokenizer.from_str(text)
    eos = tok.token_to_id("<eos>")
    t0 = time.perf_counter()
    grammars = Grammars(text, VOCAB_ROWS, [eos])
    setup_s = time.perf_counter() - t0
    params = StructuredOutputsParams(json=SCHEMA)
    t0 = time.perf_counter()
    states = [grammars.compile(params) for _ in range(args.batch)]
    compile_s = time.perf_counter() - t0
    docs = [tok.encode(_document(i)).ids for i in range(args.batch)]
    # Each request part-way through its document, at a different point.
    cursor = [i % max(1, len(d) - args.steps - 1) for i, d in enumerate(docs)]
    for s, d, c in zip(states, docs, cursor, strict=True):
        for t in d[:c]:
            s.accept(t)

    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        c = TokenConstraints.build([None] * args.batch, args.batch, VOCAB_ROWS)
        grammars.fill_rows([(s, i) for i, s in enumerate(states)], c.allowed)
        times.append(time.perf_counter() - t0)
        for i, (s, d) in enumerate(zip(states, docs, strict=True)):
            tok_id = d[cursor[i]] if cursor[i] < len(d) else eos
            word, bit = tok_id // 32, tok_id % 32
            assert (int(c.allowed[i, word]) >> bit) & 1, ("the document's next token must be allowed", i, cursor[i],
                                                          tok.decode(d[:cursor[i]]), tok.id_to_token(tok_id))
            s.accept(tok_id)
            cursor[i] += 1
    assert all(not s.matcher.is_error() for s in states), "a grammar refused a valid document"

    device_step = None
    ref = Path(args.device_step_from)
    if ref.is_file():
        for rec in json.loads(ref.read_text()):
            if rec.get("batch") == args.batch:
                device_step = {"plain_step_ms": rec["plain_step_s"] * 1e3, "model": rec["model"],
                               "context": rec["context"], "device": rec["device"], "git_rev": rec["git_rev"],
                               "source": str(ref)}
    ms = sorted(t * 1e3 for t in times[5:])
    rec = {"op": "grammar_masks", "batch": args.batch, "vocab_rows": VOCAB_ROWS,
           "tokenizer_tokens": tok.get_vocab_size(),
           "grammar": "json_schema (tool arguments)", "steps": len(ms), "median_ms": statistics.median(ms),
           "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))], "mean_ms": statistics.fmean(ms),
           "tokenizer_setup_s": setup_s, "grammar_compile_s_total": compile_s, "host_cpus": os.cpu_count(),
           "host": platform.processor() or platform.machine(), "device_step": device_step, "git_rev": git_rev()}
    if device_step:
        rec["mask_over_device_step"] = rec["median_ms"] / device_step["plain_step_ms"]
    print(json.dumps(rec), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([rec], indent=2) + "\n")


if __name__ == "__main__":
    main()
