#!/usr/bin/env bash
# The H200 runs behind docs/benchmarks.md's GPU figures, each case fitting one device call; cases combine in one
# call: `bash benchmarks/run_h200.sh spec step` runs both. GPU_NAME (default h200) names the serve and invariance
# results when another card runs them; MODEL (default m3-slice) picks the preset of the serve and invariance cases
# (m3-slice-1moe fits an 80 GB H100).
#   startup   serve cold/warm start-up, the engine's decode step, per-shape compile (issue 22)
#   step      the engine's decode step alone (engine / bare), and its time to first token on a 1k prompt
#   cond      whether a lax.cond makes dispatch wait for the device, under XLA flag variants (command buffers)
#   attninv   the attention kernels with the batch-invariant tiles (mask_every_page index scoring, per-token
#             sparse prefill, dense single-tile) against their jnp references, 8k decode and prefill
#   lincheck  the linear kernel's batch-invariant rows bitwise across M, split spread vs in-program, other tiles
#   moeinv    the MoE kernels' rows bitwise across tile sets and token counts (what the invariant tiles rely on)
#   mosaiccheck  the Mosaic GPU kernels (dense attention, index scoring with and without its fused top-k, MoE
#             bf16 and MXFP8 each / split / swap) against the Triton kernels and the references, each case in a
#             process of its own under CHECK_TIMEOUT seconds (a hang loses one case): check_mosaic.py
#   attnpre   the 8k prefill chunk's attention ops with their prefill variants, the Mosaic GPU dense attention
#             and index scoring first (checked against the Triton kernels' outputs; issue 28)
#   closing   issue 28's closing run: the 8k prefill attention ops (random and 256-token-drift selections; the
#             in-graph copies share token_row / pos, so the query-block metadata is computed once, as a model step
#             computes it since ragged.step_query_blocks) and
#             the MoE at T = 8192 (bf16, MXFP8; main table, reference-checked), all timed in graph, composed by
#             prefill_closing.py into prefill-<gpu>-closing.json (the MoE's 8192-token check needs an H200), then
#             an 8k prompt's bare prefill on m3-slice (the model's part of its time to first token)
#   moemx     MXFP8 prefill MoE: the Triton table and the Mosaic GPU candidates ("swap": weights widened in
#             registers as wgmma's A operand; "split" / "each": each K group widened once into shared memory;
#             MOEMX_FIRST=5 takes the three "swap" and two "split" ones) at T = 2048 / 8192, checked against the reference at 2048, and bf16 at 8192 beside it
#             (issue 28's "MXFP8 MoE at T = 8192 within 1.2x of the bf16 kernel"); the table's tiles are timed as
#             sweep rows (--sweep-table), so it fits an 80 GB H100, where the main table's 8192-token reference
#             check (48 GB beside the weights) does not
#   prefill8k  issue 28's 8k prompt before and after: m3-slice's bare 8k prefill with the Triton kernels
#             (bench_slice_decode.py --no-mosaic) and with the table's (the Mosaic GPU ones), bf16 then MXFP8
#   ttftc1    issue 27's TTFT at concurrency 1, four 1k requests per format (SERVE_PROMPTS=4), bf16 then MXFP8
#   hoist     whether the GPU's XLA moves the query-block metadata out of a layer scan (check_hoisting.py; on the
#             H100 it does not, which is why a forward computes it once per step: ragged.step_query_blocks)
#   moemid    MXFP8 experts at mid sizes (T = 512 / 1024 / 2048, the 1k prefill's and mixed steps' MoE): the
#             Triton table's tiles against the Mosaic GPU "swap" kernels, checked against the reference (where
#             MOSAIC_TABLE's smallest token count for MXFP8 belongs: 1024 on the H100 at rev 47a239b)
#   invnext   moeinv, then the engine's invariance under --batch-invariant against the default-mode record of
#             BASELINE (default: rev 30e16d2's), in one call (~7 min)
#   invcost   the bare decode step and a 1k prefill with and without --batch-invariant, kernel by kernel (issue 27)
#   smoke     engine sizes that are not powers of two
#   spec      a speculative step's cost against a plain decode step, and the projected speed-up (issue 24);
#             the greedy executable and the general one on the same rows, then rows sampled at temperature 1;
#             SPEC_MODELS="m3-slice-1moe m3-slice" (two depths) adds the projection to m3-full's depth
#             ("m3-slice-1moe m3-slice-2moe" on an H100, with XLA_PYTHON_CLIENT_MEM_FRACTION=0.95: the 2moe
#             slice's experts and their prepared copy are 65 GB at load),
#             SPEC_FORMAT=mxfp8 the experts' format
#   dispatch  the host's time dispatching the engine's prefill and decode executables, with a py-spy native
#             profile of it (what the dispatch waits for)
#   dispatchflags  the engine's prefill / decode dispatch and call times (profile_dispatch.py, no profiler) with the
#             table's kernels under XLA's default command buffers, with command buffers off, with custom calls
#             kept out of them, and with the Triton kernels instead of the Mosaic GPU ones (one process per
#             variant); then the bare step (bench_slice_decode.py) with command buffers on and off
#   slice     the m3-slice decode step at batch 1 / 32 / 128 against its HBM floor (issue 23)
#   projection  one GPU of a TP8 / EP8 deployment with MXFP8 experts, the small-M linears, the projection (issue 23)
#   serve     the benchmark contract through `m3jax serve` + `m3jax bench serve`, with the bare step beside it
#             (issue 27; SERVE_FORMAT=bf16|mxfp8, prompt counts reduced to fit one call; SERVE_SWEEPS and
#             SERVE_PROMPTS trim it further; BARE_FROM reuses an earlier run's bare step records; SERVER_ARGS: more
#             `m3jax serve` flags, e.g. --no-async-scheduling)
#   next      the H200 reruns after the engine moved to a process of its own, in one call (~8 min): the served
#             1k/1k at concurrency 1 to 128 with the bare step, then the engine's step at batch 32 / 128 and its
#             time to first token with the served settings
#   invariance  greedy batch invariance of the engine with and without --batch-invariant, and which XLA ops
#             change a row's result with the row count (issue 27; each mode in its own process)
#   structured  grammar masks at batch 64 on this host's CPUs (issue 25; llguidance has no wheel for the GPU
#             machine in the registry here: copy the dev venv's `llguidance` package folder into an ignored
#             `.pylib/` and carry it)
# Wheels the GPU machine lacks (grpcio >= 1.85, protobuf 7, aiohttp and its dependencies, prometheus_client) go
# in an ignored `.whl/` carried with the call (`pip download --no-deps --only-binary=:all: ...`, ../shared/gpu.md).
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.:.pylib PYTHONUNBUFFERED=1 M3JAX_NO_PROGRESS=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
closing_attention() {  # issue 28's 8k prefill attention rows in graph: results file, then extra flags
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 timeout 240 python3 benchmarks/bench_attention.py --contexts "" \
    --variants none --in-graph-prefill --prefill-locality 0 256 --warm-up-s 2 "${@:2}" --out "$1"
}
for what in "$@"; do
  case "$what" in
    startup)
      timeout 300 python3 benchmarks/bench_startup.py serve --model m3-slice --max-num-seqs 128 \
        --max-num-batched-tokens 8192 --cache-dir /tmp/m3c --out "$OUT/startup-h200.json"
      M3JAX_COMPILATION_CACHE=/tmp/m3c timeout 150 python3 benchmarks/bench_engine_step.py --model m3-slice \
        --batches ${STEP_BATCHES:-32 128} --context 1024 --out "$OUT/engine-step-h200.json"
      timeout 150 python3 benchmarks/bench_startup.py shapes --buckets 256 8192 --out "$OUT/startup-shapes-h200.json"
      ;;
    step)
      # The served settings (8k budget, 1k/1k's model length): after `serve`, the executables load from its cache.
      timeout "${STEP_TIMEOUT:-150}" python3 benchmarks/bench_engine_step.py --model "${MODEL:-m3-slice}" \
        --batches ${STEP_BATCHES:-32 128} --context 1024 --max-num-batched-tokens 8192 --max-model-len 2176 \
        --prefill --out "$OUT/engine-step-${GPU_NAME:-h200}.json"
      ;;
    cond)
      timeout "${COND_TIMEOUT:-240}" python3 benchmarks/probe_cond_dispatch.py --out "$OUT/cond-dispatch-${GPU_NAME:-h200}.json"
      ;;
    attninv)
      timeout 240 python3 benchmarks/bench_attention.py --batch-invariant --contexts 8192 --variants none \
        --warm-up-s 2 --out "$OUT/attention-invariant-${GPU_NAME:-h200}.json"
      ;;
    lincheck)  # the linear kernel's invariant rows on the device, and larger tiles over the same K order
      timeout 330 python3 benchmarks/check_linear_invariance.py --model "${MODEL:-m3-slice}" --m 1 32 300 2048 \
        --alt-tiles 128,128,64,8,3 128,256,64,8,3 --out "$OUT/linear-invariance-${GPU_NAME:-h200}.json"
      ;;
    moeinv)
      timeout "${MOEINV_TIMEOUT:-150}" python3 benchmarks/check_moe_invariance.py \
        --out "$OUT/moe-invariance-${GPU_NAME:-h200}.json"
      ;;
    mosaiccheck)
      python3 benchmarks/check_mosaic.py --timeout-s "${CHECK_TIMEOUT:-120}" \
        --out "$OUT/mosaic-check-${GPU_NAME:-h200}.json"
      ;;
    attnpre)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 timeout "${ATTNPRE_TIMEOUT:-300}" python3 benchmarks/bench_attention.py \
        --contexts "" --variants prefill --prefill-locality 0 --out "$OUT/attention-prefill-${GPU_NAME:-h200}.json"
      ;;
    closing)
      gpu="${GPU_NAME:-h200}"
      closing_attention "$OUT/attention-closing-$gpu.json" --shared-step-inputs
      timeout 300 python3 benchmarks/bench_moe.py --formats bf16 mxfp8 --tokens 8192 --sweep 0 \
        --in-graph-max-tokens 8192 --ref-time-max-tokens 0 --kernels-only-tokens 0 --out "$OUT/moe-closing-$gpu.json"
      python3 benchmarks/prefill_closing.py --attention "$OUT/attention-closing-$gpu.json" \
        --moe "$OUT/moe-closing-$gpu.json" --out "$OUT/prefill-$gpu-closing.json"
      # An 8k prompt's bare prefill on m3-slice: the model's part of its time to first token.
      timeout 150 python3 benchmarks/bench_slice_decode.py --preset "${MODEL:-m3-slice}" --batches 1 \
        --context 8192 --prefill-lens 8192 --out "$OUT/slice-prefill-8k-$gpu.json"
      ;;
    prefill8k)
      for fmt in bf16 mxfp8; do
        for kernels in --no-mosaic ""; do
          timeout 150 python3 benchmarks/bench_slice_decode.py --preset "${MODEL:-m3-slice}" --moe-format "$fmt" \
            --batches 1 --context 8192 --prefill-lens 8192 $kernels \
            --out "$OUT/slice-prefill-8k-${GPU_NAME:-h200}-$fmt${kernels:+-triton}.json" | tail -1 | cut -c1-300
        done
      done
      ;;
    ttftc1)
      for fmt in bf16 mxfp8; do
        SERVE_FORMAT=$fmt SERVE_SWEEPS="--sweep 1024x1024:1" SERVE_PROMPTS=4 SERVE_TIMEOUT=240 bash "$0" serve
      done
      ;;
    hoist)
      gpu="${GPU_NAME:-h200}"
      python3 benchmarks/check_hoisting.py --out "$OUT/hoisting-$gpu.json"
      ;;
    moemid)
      timeout "${MOEMID_TIMEOUT:-330}" python3 benchmarks/bench_moe.py --formats mxfp8 --tokens 512 1024 2048 \
        --main-max-tokens 0 --ref-time-max-tokens 0 --kernels-only-tokens 0 --in-graph-max-tokens 0 --sweep 1 \
        --sweep-table --sweep-cases 512:mxfp8 1024:mxfp8 2048:mxfp8 --sweep-first 3 \
        --out "$OUT/moe-mid-mx-${GPU_NAME:-h200}.json"
      ;;
    moemx)
      timeout "${MOEMX_TIMEOUT:-330}" python3 benchmarks/bench_moe.py --formats mxfp8 bf16 --tokens 2048 8192 \
        --main-max-tokens 0 --ref-time-max-tokens 0 --kernels-only-tokens 0 --in-graph-max-tokens 0 --sweep 1 \
        --sweep-table --sweep-cases 2048:mxfp8 8192:mxfp8 8192:bf16 --sweep-first "${MOEMX_FIRST:-4}" \
        --out "$OUT/moe-mosaic-mx-${GPU_NAME:-h200}.json"
      ;;
    invnext)
      OPS=0 BISECT=0 BASELINE="${BASELINE:-benchmarks/results/invariance-default-h200-30e16d2.json}" \
        bash "$0" moeinv invariance
      ;;
    invcost)
      for flag in "" --batch-invariant; do
        timeout 150 python3 benchmarks/bench_slice_decode.py --preset "${MODEL:-m3-slice}" --batches 1 32 128 \
          --context 1024 --prefill-lens 1024 $flag --out "$OUT/slice-decode-${GPU_NAME:-h200}$flag.json"
      done
      ;;
    smoke)
      timeout "${SMOKE_TIMEOUT:-560}" python3 benchmarks/smoke_sizes.py --model m3-slice \
        --out "$OUT/smoke-sizes-h200.json"
      ;;
    spec)
      timeout "${SPEC_TIMEOUT:-240}" python3 benchmarks/bench_spec.py --models ${SPEC_MODELS:-${MODEL:-m3-slice}} --moe-format "${SPEC_FORMAT:-bf16}" \
        --batches ${SPEC_BATCHES:-1 8 32 64} --ks 1 3 --context 2048 --also-general \
        --out "$OUT/spec-${GPU_NAME:-h200}.json"
      # Sampled rows at temperature 1.0 (InferenceX's acceptance lengths): "spec_draw" against forward + "sample_draw".
      timeout "${SPEC_TIMEOUT:-240}" python3 benchmarks/bench_spec.py --models ${SPEC_MODELS:-${MODEL:-m3-slice}} --moe-format "${SPEC_FORMAT:-bf16}" \
        --batches ${SPEC_BATCHES:-1 8 32 64} --ks 3 --context 2048 --also-general --temperature 1.0 \
        --out "$OUT/spec-${GPU_NAME:-h200}-sampled.json"
      ;;
    dispatchflags)
      gpu="${GPU_NAME:-h200}"
      run() {  # name, then profile_dispatch.py's extra arguments; XLA_FLAGS from the caller
        timeout "${DISPATCH_TIMEOUT:-150}" python3 benchmarks/profile_dispatch.py --model "${MODEL:-m3-slice}" \
          --seconds 6 "${@:2}" --out "$OUT/dispatch-$1-$gpu.json" | grep -v READY
      }
      run table
      XLA_FLAGS=--xla_gpu_enable_command_buffer= run table-nocmdbuf
      XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN run table-nocustomcmdbuf
      run triton --no-mosaic
      # The bare step's wall and kernel-busy time (GPU trace) at batch 1 / 32 and a 1k prefill, command buffers
      # on and off.
      for flags in "" --xla_gpu_enable_command_buffer=; do
        XLA_FLAGS=$flags timeout "${SLICE_TIMEOUT:-150}" python3 benchmarks/bench_slice_decode.py \
          --preset "${MODEL:-m3-slice}" --batches 1 32 --prefill-lens 1024 \
          --out "$OUT/slice-decode-$gpu${flags:+-nocmdbuf}.json" | tail -4
      done
      ;;
    dispatch)
      # The host's dispatch of the engine's prefill and decode executables, under py-spy's native sampler.
      gpu="${GPU_NAME:-h200}"
      timeout 200 python3 benchmarks/profile_dispatch.py --model "${MODEL:-m3-slice}" --seconds 20 \
        --out "$OUT/dispatch-$gpu.json" > "$OUT/dispatch-$gpu.log" 2>&1 &
      for _ in $(seq 150); do grep -q READY "$OUT/dispatch-$gpu.log" && break; sleep 1; done
      pid=$(grep -o "pid=[0-9]*" "$OUT/dispatch-$gpu.log" | cut -d= -f2)
      /tmp/site/bin/py-spy record --pid "$pid" --native --rate 200 --duration 8 --format raw \
        -o "$OUT/dispatch-native-$gpu.txt" > /dev/null 2>&1
      wait
      python3 benchmarks/profile_dispatch.py --summarise "$OUT/dispatch-native-$gpu.txt" \
        --out "$OUT/dispatch-native-$gpu.json" | head -20
      ;;
    slice)
      timeout "${SLICE_TIMEOUT:-150}" python3 benchmarks/bench_slice_decode.py --batches 1 32 128 \
        --out "$OUT/slice-decode-h200.json"
      ;;
    projection)
      timeout "${PROJECTION_TIMEOUT:-400}" python3 benchmarks/bench_projection.py --deployments tp8 ep8 \
        --formats mxfp8 --linear-tp 1 8 --out "$OUT/projection-h200.json"
      ;;
    serve)
      # A call returns at most 8 files: the per-level JSON, the server log and the bare step travel as one tarball.
      fmt="${SERVE_FORMAT:-bf16}" gpu="${GPU_NAME:-h200}"
      timeout "${SERVE_TIMEOUT:-560}" python3 benchmarks/bench_serve_gpu.py --model "${MODEL:-m3-slice}" \
        --moe-format "$fmt" --gpu-name "$gpu" \
        ${SERVE_SWEEPS:---sweep 1024x1024:1,8,32,64,128 --sweep 8192x1024:8,32} \
        --prompts-per-concurrency "${SERVE_PROMPTS:-2}" --warmups-per-concurrency 0.25 --result-dir "/tmp/serve-$gpu-$fmt" \
        ${SERVER_ARGS:+--server-args "$SERVER_ARGS"} ${BARE_FROM:+--bare-from "$BARE_FROM"} ${PROFILE_C:+--profile-concurrency "$PROFILE_C" --profile-mode "${PROFILE_MODE:-gil}"} \
        --out "$OUT/serve-$gpu-$fmt.json"
      tar czf "$OUT/serve-$gpu-$fmt.tgz" -C /tmp "serve-$gpu-$fmt"
      ;;
    next)
      SERVE_SWEEPS="--sweep 1024x1024:1,8,32,64,128" SERVE_PROMPTS=1 SERVE_TIMEOUT=360 bash "$0" serve
      STEP_TIMEOUT=130 bash "$0" step
      ;;
    invariance)
      gpu="${GPU_NAME:-h200}"
      model="${MODEL:-m3-slice}"
      if [ "${OPS:-1}" = 1 ]; then
        timeout 100 python3 benchmarks/bench_invariance.py --model "$model" --ops --ops-m 1 3 64 1024 --modes \
          --out "$OUT/invariance-ops-$gpu.json"
      fi
      if [ "${BISECT:-1}" = 1 ]; then  # which layer / op family still varies with the batch, under the flag
        timeout 400 python3 benchmarks/bisect_invariance.py --model "$model" --batch-invariant \
          --out "$OUT/bisect-invariance-$gpu.json"
      fi
      baseline="${BASELINE:-$OUT/invariance-default-$gpu.json}"  # BASELINE: an earlier default-mode record
      if [ -z "${BASELINE:-}" ]; then
        timeout 200 python3 benchmarks/bench_invariance.py --model "$model" --modes default --out "$baseline"
      fi
      timeout 280 python3 benchmarks/bench_invariance.py --model "$model" --modes invariant --chunked \
        --baseline "$baseline" --out "$OUT/invariance-$gpu.json"
      ;;
    structured)
      timeout "${STRUCTURED_TIMEOUT:-150}" python3 benchmarks/bench_structured.py --batch 64 \
        --out "$OUT/structured-mask-h200.json"
      ;;
    *) echo "unknown case $what"; exit 2 ;;
  esac
done
