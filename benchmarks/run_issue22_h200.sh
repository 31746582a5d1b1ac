#!/usr/bin/env bash
# The H200 runs behind issue 22's figures, in one device call each (see docs/benchmarks.md, "Engine start-up").
#   bash benchmarks/run_issue22_h200.sh startup   # serve cold/warm, the engine's decode step, per-shape compile
#   bash benchmarks/run_issue22_h200.sh smoke     # engine sizes that are not powers of two
#   bash benchmarks/run_issue22_h200.sh all       # both, in one device call
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 M3JAX_NO_PROGRESS=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
case "$1" in
  startup|all)
    timeout 300 python3 benchmarks/bench_startup.py serve --model m3-slice --max-num-seqs 128 \
      --max-num-batched-tokens 8192 --cache-dir /tmp/m3c --out "$OUT/startup-h200.json"
    M3JAX_COMPILATION_CACHE=/tmp/m3c timeout 150 python3 benchmarks/bench_engine_step.py --model m3-slice \
      --batches 32 128 --context 1024 --out "$OUT/engine-step-h200.json"
    timeout 150 python3 benchmarks/bench_startup.py shapes --buckets 256 8192 --out "$OUT/startup-shapes-h200.json"
    ;;&
  smoke|all)
    timeout "${SMOKE_TIMEOUT:-560}" python3 benchmarks/smoke_sizes.py --model m3-slice \
      --out "$OUT/smoke-sizes-h200.json"
    ;;
esac
