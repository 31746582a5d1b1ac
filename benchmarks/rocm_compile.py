"""Offline AMD (ROCm) build of every Pallas Triton kernel: does it compile for gfx942 / gfx950, registers, LDS.

No GPU needed. Each op is traced and lowered on the CPU for an abstract NVIDIA H200 (jax's Pallas Triton lowering
only lowers for CUDA; `pallas_kernels.gpu_lowering.abstract_gpu`), its Triton modules are taken out of the
pallas_call custom calls (`kernel_sass.triton_calls`: the TTIR XLA would receive, with num_warps / num_stages),
and each is compiled by the `triton` pip wheel's AMD (HIP) backend in a subprocess: `make_ttir` passes, then
TTIR -> TTGIR -> LLVM IR -> AMDGCN -> hsaco (the wheel bundles the ROCm device libraries and links with its
built-in lld, so nothing else is needed). Targets: gfx942 (MI300X, 64 KiB LDS) and gfx950 (MI355X, 160 KiB LDS),
wave64. Reported per (kernel, target): compiled or the error, arch VGPRs / AGPRs / SGPRs, spills, scratch and
LDS bytes (Triton's metadata: its AMD kernels take LDS dynamically), waves per SIMD the registers allow (the AMDGPU
backend's "Occupancy", which does not see dynamic LDS) and workgroups per CU the LDS allows.

Kernels: MoE gate_up / down (bf16 and MXFP8 experts, decode T = 8 and prefill T = 8192 tiles of moe/tiles.py; MXFP8
in the table's mx_mode, "expand_asm" (inline PTX: NVIDIA only), and in the portable "expand"), ragged paged dense
attention (decode / prefill tiles), MSA block scores (fused top-k and not), MSA top-k, block-sparse attention
(per-token and block-major), the KV row store, and the small-M linear kernel.

    python -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install triton==3.6.0
    PYTHONPATH=. python benchmarks/rocm_compile.py --triton-python /tmp/tvenv/bin/python \
        [--targets gfx942,gfx950] [--only moe] [--dump /tmp/rocm] [--out benchmarks/results/rocm-compile.json]

Limits: the TTIR is what jax lowers for NVIDIA (num_warps / num_stages chosen for an H200, so on AMD a "warp" is a
64-lane wavefront and a program runs twice the threads); nothing is run, so compiling says nothing about
correctness or speed, and jax itself has no ROCm Pallas Triton path to launch these modules.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks import kernel_sass
from benchmarks.timing import git_rev
from pallas_kernels.gpu_lowering import abstract_gpu

TARGETS = ("gfx942", "gfx950")
LDS_LIMIT = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}

# jax's Pallas Triton lowering calls CUDA libdevice for some f32 math (exp -> __nv_expf, exp2 -> __nv_exp2f), which
# Triton's AMD backend rejects ("Implicit conversion of CUDA ... has been dropped"). The "ocml" variant renames
# them to what triton.language.extra.hip.libdevice emits for the same function (ROCm's OCML, bundled in the wheel):
# what the lowering would have to emit for ROCm. Symbols not in this table are left as they are.
LIBDEVICE_TO_OCML = {f"__nv_{f}f": f"__ocml_{f}_f32" for f in (
    "exp", "exp2", "log", "log2", "log1p", "expm1", "tanh", "erf", "pow", "rsqrt", "sqrt", "sin", "cos")}
_NV_SYMBOL = re.compile(r'symbol = "(__nv_\w+)"')


def to_ocml(ttir: str) -> str:
    return _NV_SYMBOL.sub(lambda m: f'symbol = "{LIBDEVICE_TO_OCML.get(m.group(1), m.group(1))}"', ttir)

# Runs under the triton interpreter: TTIR file -> make_ttir -> ttgir / llir / amdgcn / hsaco in an output folder.
_COMPILE = r"""
import json, sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.amd.compiler import HIPBackend
    from triton._C.libtriton import ir
except ImportError as e:
    sys.exit(f"rocm_compile: no usable triton in {sys.executable} ({e}); "
             "pip install triton==3.6.0 into a separate venv and pass --triton-python")
src, out, warps, stages, arch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
target, options = GPUTarget("hip", arch, 64), {"num_warps": warps, "num_stages": stages}
backend = HIPBackend(target)
ctx = ir.context()
ir.load_dialects(ctx)
backend.load_dialects(ctx)
mod = ir.parse_mlir_module(src, ctx)
mod.context = ctx
backend.make_ttir(mod, {}, backend.parse_options(options))  # as XLA does before make_ttgir (see kernel_sass.py)
open(f"{out}/kernel.make_ttir.ttir", "w").write(str(mod))
k = triton.compile(f"{out}/kernel.make_ttir.ttir", target=target, options=options)
for ext in ("ttgir", "llir", "amdgcn"):
    open(f"{out}/kernel.{ext}", "w").write(k.asm[ext])
open(f"{out}/kernel.hsaco", "wb").write(k.asm["hsaco"])
json.dump({"shared": k.metadata.shared, "triton": triton.__version__}, open(f"{out}/meta.json", "w"))
"""

_TRITON_VERSION = "import triton; print(triton.__version__)"


def lower_op(fn: Callable, *args: jax.ShapeDtypeStruct) -> list[tuple[str, dict]]:
    """The Triton kernels (TTIR, settings) of `fn(*args)` lowered for an abstract H200."""
    with abstract_gpu():
        return kernel_sass.triton_calls(jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)))


def moe_cases() -> Iterator[tuple[str, str, dict, list[tuple[str, dict]]]]:
    """(family, case, notes, kernels): bf16 and MXFP8 gate_up / down at decode and prefill tiles; MXFP8 in the
    table's mx_mode and in "expand" (the mode without inline PTX)."""
    from pallas_kernels.moe.tiles import pick_tiles

    for tokens in (8, 8192):
        for fmt in ("dense", "mxfp8"):
            table = pick_tiles(tokens, fmt)
            modes = [None] if fmt == "dense" else list(dict.fromkeys([table.mx_mode, "expand"]))
            for mode in modes:
                tiles = table if mode is None else table.replace(mx_mode=mode)
                for which in ("gate_up", "down"):
                    kt = tiles.gu if which == "gate_up" else tiles.dn
                    case = (f"moe_{which}/{'bf16' if fmt == 'dense' else fmt}/{tiles.regime}"
                            + (f"/{mode}" if mode else ""))
                    notes = {"tokens": tokens, "bm": tiles.bm, "bn": kt.bn, "bk": kt.bk, "split": kt.split,
                             "mx_mode": mode, "mx_rows": tiles.mx_rows if mode else None}
                    yield "moe", case, notes, [kernel_sass.lower_ttir(which, fmt, tiles, tokens)]


def attention_cases() -> Iterator[tuple[str, str, dict, list[tuple[str, dict]]]]:
    """Ragged paged dense attention, MSA block scores + top-k, block-sparse attention, KV write, at decode and
    prefill shapes of M3 (tests/test_triton_lowering.py's ops and sizes)."""
    from m3jax.config import preset
    from pallas_kernels.attention import dispatch as attn
    from pallas_kernels.attention.kv_write import write_pages_pallas

    cfg = preset("m3-full")
    ps, hd, kh, h, di = cfg.index_block_size, cfg.head_dim, cfg.num_kv_heads, cfg.num_heads, cfg.index_head_dim
    sds, pages = jax.ShapeDtypeStruct, 4099
    kv = sds((pages, ps, kh, hd), jnp.bfloat16), sds((pages, ps, kh, hd), jnp.bfloat16)

    def batch(t: int, r: int, p: int) -> tuple:
        return sds((r, p), jnp.int32), sds((t,), jnp.int32), sds((t,), jnp.int32)

    # (T tokens, R rows, P page-table width): decode with a short context (fused top-k), decode past the fused
    # top-k's 64 pages, prefill chunks.
    shapes = {"decode": (64, 64, 130), "decode_short": (64, 64, 8), "prefill": (2048, 1, 64),
              "prefill_long": (2048, 1, 1000)}
    dense = functools.partial(attn.paged_dense_attention, scale=hd ** -0.5, impl="pallas")
    select = functools.partial(attn.paged_select_blocks, topk=cfg.index_topk_blocks,
                               local_blocks=cfg.index_local_blocks, init_blocks=1, impl="pallas")
    sparse = functools.partial(attn.paged_block_sparse_attention, scale=hd ** -0.5, impl="pallas")
    for regime in ("decode", "prefill"):
        t, r, p = shapes[regime]
        yield ("attention", f"dense_attention/{regime}", {"T": t, "R": r, "P": p},
               lower_op(dense, sds((t, h, hd), jnp.bfloat16), *kv, *batch(t, r, p)))
    for regime in ("decode_short", "decode", "prefill_long"):
        t, r, p = shapes[regime]
        yield ("msa", f"msa_select/{regime}", {"T": t, "R": r, "P": p},
               lower_op(select, sds((t, kh, di), jnp.bfloat16), sds((pages, ps, di), jnp.bfloat16), *batch(t, r, p)))
    for regime in ("decode", "prefill"):
        t, r, p = shapes[regime]
        yield ("msa", f"msa_sparse_attention/{regime}", {"T": t, "R": r, "P": p},
               lower_op(sparse, sds((t, h, hd), jnp.bfloat16), *kv, *batch(t, r, p),
                        sds((t, kh, cfg.index_topk_blocks), jnp.int32)))
    for name, row in (("kv", (kh, hd)), ("index", (di,))):
        t = 1024
        yield ("kv_write", f"kv_write/{name}_pages", {"T": t},
               lower_op(write_pages_pallas, sds((pages, ps, *row), jnp.bfloat16), sds((t, *row), jnp.bfloat16),
                        sds((t,), jnp.int32)))


def linear_cases() -> Iterator[tuple[str, str, dict, list[tuple[str, dict]]]]:
    """The small-M linear kernel at M3 decode shards: q projection at TP8 (M = 1) and o projection (M = 64)."""
    from m3jax.config import preset
    from pallas_kernels.linear import kernel
    from pallas_kernels.linear.tiles import pick_tiles

    cfg = preset("m3-full")
    d, qdim = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    for label, m, k, n in (("q_tp8/m1", 1, d, qdim // 8), ("o_tp1/m64", 64, qdim, d)):
        t = pick_tiles(m, k, n)
        assert t is not None, (m, k, n)
        sds = jax.ShapeDtypeStruct
        yield ("linear", f"linear/{label}", {"M": m, "K": k, "N": n, "bm": t.bm, "bn": t.bn, "bk": t.bk,
                                             "split": t.split},
               lower_op(lambda x, w, t=t: kernel.linear(x, w, tiles=t), sds((m, k), jnp.bfloat16),
                        sds((k, n), jnp.bfloat16)))


FAMILIES = {"moe": moe_cases, "attention": attention_cases, "linear": linear_cases}


def _amdgcn_stats(asm: str) -> dict:
    """Register / memory counts from the AMDGCN text: the kernel descriptor's metadata (.vgpr_count ...) and the
    backend's "; Kernel info" comments."""
    def meta(key: str) -> int | None:
        m = re.search(rf"\.{key}:\s+(\d+)", asm)
        return int(m.group(1)) if m else None

    def comment(key: str) -> int | None:
        m = re.search(rf"^; {key}:\s*(\d+)", asm, re.M)
        return int(m.group(1)) if m else None

    vs, ss = meta("vgpr_spill_count"), meta("sgpr_spill_count")
    return {"vgpr": comment("NumVgprs"), "agpr": comment("NumAgprs"), "total_vgpr": comment("TotalNumVgprs"),
            "sgpr": comment("TotalNumSgprs"), "spills": None if vs is None else vs + (ss or 0),
            "vgpr_spills": vs, "sgpr_spills": ss, "scratch_bytes": meta("private_segment_fixed_size"),
            "lds_bytes": meta("group_segment_fixed_size"), "waves_per_simd_regs": comment("Occupancy")}


def _error_summary(stderr: str) -> str:
    """The first error line and the final exception line, without temporary paths."""
    lines = [re.sub(r"/tmp/\S+", "<tmp>", re.sub(r"/tmp/\S+?:\d+:\d+:\s*", "", ln)).strip()
             for ln in stderr.splitlines()]
    lines = [ln for ln in lines if ln]
    first = next((ln for ln in lines if re.search(r"error", ln, re.I)), lines[-1] if lines else "no output")
    last = lines[-1] if lines else ""
    if "error: invalid instruction" in lines:  # inline asm text the AMDGPU assembler cannot read (PTX)
        first = f"AMDGPU assembler: invalid instruction `{lines[lines.index('error: invalid instruction') + 1]}`"
    return (first if first == last else f"{first} ... {last}")[:400]


def compile_one(text: str, settings: dict, arch: str, python: str, workdir: Path, timeout: float) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "kernel.ttir").write_text(text)
    cmd = [python, "-c", _COMPILE, str(workdir / "kernel.ttir"), str(workdir), str(settings["num_warps"]),
           str(settings["num_stages"]), arch]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"compiled": False, "error": f"timed out after {timeout:.0f} s"}
    (workdir / "stderr.txt").write_text(r.stderr)
    if r.returncode:
        return {"compiled": False, "error": _error_summary(r.stderr),
                "failed_in_make_ttgir": "make_ttgir" in r.stderr}
    meta = json.loads((workdir / "meta.json").read_text())
    stats = _amdgcn_stats((workdir / "kernel.amdgcn").read_text())
    # Triton's AMD kernels take their LDS dynamically (group_segment_fixed_size stays 0): the size is its metadata.
    stats["lds_bytes"] = max(meta["shared"], stats["lds_bytes"] or 0)
    return {"compiled": True, "error": None, **stats}


def fewer_stages(text: str, settings: dict, arch: str, python: str, workdir: Path, timeout: float) -> int | None:
    """After a make_ttgir failure at num_stages > 1: the most stages (below the lowered count) that compile."""
    for stages in range(settings["num_stages"] - 1, 0, -1):
        res = compile_one(text, {**settings, "num_stages": stages}, arch, python, workdir / f"stages{stages}", timeout)
        if res["compiled"]:
            return stages
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--triton-python", default=os.environ.get("KERNEL_SASS_PYTHON", sys.executable),
                    help="a python with triton 3.6.0 (env KERNEL_SASS_PYTHON; default: this one)")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--only", help="comma-separated families: " + ",".join(FAMILIES))
    ap.add_argument("--dump", help="keep ttir / ttgir / llir / amdgcn / hsaco / stderr per kernel here")
    ap.add_argument("--out", help="write the JSON records here")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per compile")
    a = ap.parse_args()
    targets = a.targets.split(",")
    version = subprocess.run([a.triton_python, "-c", _TRITON_VERSION], capture_output=True, text=True)
    if version.returncode:
        sys.exit(f"rocm_compile: no usable triton in {a.triton_python}:\n{version.stderr[-2000:]}")
    triton_version, rev = version.stdout.strip(), git_rev()

    jobs = []  # (record base, ttir, settings)
    for fam in (a.only.split(",") if a.only else FAMILIES):
        for family, case, notes, kernels in FAMILIES[fam]():
            seen = set()
            for text, settings in kernels:
                digest = hashlib.sha1(text.encode()).hexdigest()[:12]
                if digest in seen:  # the same module launched twice (e.g. a split call)
                    continue
                seen.add(digest)
                variants = {"as_lowered": text}
                nv = sorted(set(_NV_SYMBOL.findall(text)))
                if nv:
                    variants["ocml"] = to_ocml(text)
                for variant, ttir in variants.items():
                    for arch in targets:
                        base = {"kernel": f"{case}/{settings['name']}", "target": arch, "variant": variant,
                                "family": family, "num_warps": settings["num_warps"],
                                "num_stages": settings["num_stages"], "grid_x": settings["grid_x"],
                                "inline_ptx": "tt.elementwise_inline_asm" in ttir, "libdevice_calls": nv,
                                "ttir_sha1": digest, **notes}
                        jobs.append((base, ttir, settings))

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.dump or tmp)

        def run(job: tuple[dict, str, dict]) -> dict:
            base, text, settings = job
            work = root / base["kernel"].replace("/", "__") / base["variant"] / base["target"]
            res = compile_one(text, settings, base["target"], a.triton_python, work, a.timeout)
            if res.pop("failed_in_make_ttgir", False) and settings["num_stages"] > 1:
                res["compiles_at_stages"] = fewer_stages(text, settings, base["target"], a.triton_python, work,
                                                         a.timeout)
            rec = {"kernel": base["kernel"], "target": base["target"], "compiled": res.pop("compiled"),
                   "error": res.pop("error"), "vgpr": res.pop("vgpr", None), "sgpr": res.pop("sgpr", None),
                   "spills": res.pop("spills", None), "lds_bytes": res.pop("lds_bytes", None),
                   "triton_version": triton_version, "git_rev": rev, **res, **base}
            if rec["compiled"]:
                limit = LDS_LIMIT.get(rec["target"], 64 * 1024)
                rec["lds_fits"] = rec["lds_bytes"] <= limit
                rec["workgroups_per_cu_lds"] = limit // rec["lds_bytes"] if rec["lds_bytes"] else None
            rec["launchable"] = bool(rec["compiled"] and rec["lds_fits"])  # compiled and its LDS fits the CU
            return rec

        with ThreadPoolExecutor(max(1, a.jobs)) as pool:
            records = list(pool.map(run, jobs))

    print(f"triton {triton_version}, git {rev}; warps are 64-lane wavefronts on these targets")
    print(f"{'kernel':66s} {'variant':10s} {'target':7s} {'ok':3s} {'vgpr':>5s} {'agpr':>5s} {'sgpr':>5s} "
          f"{'spill':>5s} {'lds':>7s} {'waves':>5s}")
    for r in records:
        head = f"{r['kernel']:66s} {r['variant']:10s} {r['target']:7s}"
        if r["compiled"]:
            print(f"{head} yes {r['vgpr']:5d} {r['agpr']:5d} {r['sgpr']:5d} {r['spills']:5d} {r['lds_bytes']:7d} "
                  f"{r['waves_per_simd_regs']:5d}" + ("" if r["lds_fits"] else "  LDS over the target's limit"))
        else:
            more = f" [compiles at num_stages={r['compiles_at_stages']}]" if r.get("compiles_at_stages") else ""
            print(f"{head} NO  {r['error'][:160]}{more}")
    ok = sum(r["compiled"] for r in records)
    print(f"{ok} / {len(records)} (kernel, target) builds compiled")
    if a.out:
        Path(a.out).write_text(json.dumps(records, indent=1) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
