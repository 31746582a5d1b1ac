"""Offline sm_90 build of the MoE Pallas kernels: registers, spills, shared memory and the hot loop's instructions.

No GPU needed. The kernel is traced and lowered on the CPU for an abstract "NVIDIA H200" CUDA device (jax's
`AbstractDevice` + `lowering_platforms=("cuda",)`), the Triton module is taken from the lowered pallas_call's
custom call (exactly the TTIR XLA would receive, with its num_warps / num_stages), and then compiled by a `triton`
pip package (TTIR -> TTGIR -> PTX -> cubin, its bundled ptxas) in a subprocess. The TTIR first goes through
Triton's `make_ttir` passes (inliner, canonicalize, combine, CSE, ...), as it does in XLA's pipeline: `triton.compile`
skips that stage for a `.ttir` file, and without the combine pass `acc + dot(a, b)` stays a dot plus a separate add
(more registers, FADDs and loop instructions than XLA's build). Reported per kernel:
  - registers / spill bytes (ptxas -v on the PTX), stack / local memory (cuobjdump -res-usage on the cubin),
    shared memory (Triton's metadata: the pipeline buffers), the resident CTAs per SM these allow, and the MMA
    Triton chose (TTGIR `nvidia_mma` version);
  - the TTGIR ops inside the K loop (local_load / local_alloc / local_store / convert_layout / dot ...): whether
    the widened weight goes back through shared memory before the MMA;
  - the SASS opcode mix of the hot loop (the backward branch enclosing the most MMA instructions): counts per
    thread (= per warp instruction) per K iteration, grouped, and in warp-issue slots per weight element
    (count * warps / (bk * bn * matrices)), with the issue-bound ceiling in fp8 bytes/s this implies.

Needs triton (3.6.0 is what jax 0.11.2's CUDA plugin uses) in a separate venv, not in the project's deps:

    python -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install triton==3.6.0
    PYTHONPATH=. python benchmarks/kernel_sass.py --triton-python /tmp/tvenv/bin/python \
        --format mxfp8 --kernel gate_up --mx-mode expand [--gu 64,128,8,4] [--tokens 8] [--dump /tmp/sass] [--ops]

Limits: the pip triton's pass pipeline is not byte-for-byte the one inside XLA (same Triton release, but XLA
drives its own pipeline and ptxas), so register counts and instruction mixes are close, not identical; nothing is
timed, and the issue ceiling assumes every issue slot busy (no latency stalls), so it is an upper bound only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels.moe import kernel, layout
from pallas_kernels.moe.tiles import KernelTiles, pick_tiles

S, D, F, SLOTS_PER_TOKEN = 129, 6144, 3072, 5  # M3: 128 experts + shared slot, top-4 (+ shared)
FORMATS = {"bf16": "dense", "mxfp8": "mxfp8", "mxfp4": "mxfp4"}

# Runs under the triton interpreter: TTIR file -> ttgir / ptx / cubin / sass / ptxas log in an output folder.
_COMPILE = r"""
import json, subprocess, sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import sm_arch_from_capability
except ImportError as e:
    sys.exit(f"kernel_sass: no usable triton in {sys.executable} ({e}); "
             "pip install triton==3.6.0 into a separate venv and pass --triton-python")
from triton._C.libtriton import ir
from triton.backends.nvidia.compiler import CUDABackend
src, out, warps, stages, cap = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
target, options = GPUTarget("cuda", cap, 32), {"num_warps": warps, "num_stages": stages}
# triton.compile starts a .ttir file at make_ttgir; XLA runs make_ttir (canonicalize, combine: acc + dot -> one
# accumulating dot, ...) on the pallas TTIR first, so run it here and compile its output.
backend = CUDABackend(target)
ctx = ir.context()
ir.load_dialects(ctx)
backend.load_dialects(ctx)
mod = ir.parse_mlir_module(src, ctx)
mod.context = ctx  # as triton.compiler.IRSource.make_ir does
backend.make_ttir(mod, {}, backend.parse_options(options), cap)
open(f"{out}/kernel.make_ttir.ttir", "w").write(str(mod))
k = triton.compile(f"{out}/kernel.make_ttir.ttir", target=target, options=options)
for ext in ("ttgir", "ptx"):
    open(f"{out}/kernel.{ext}", "w").write(k.asm[ext])
open(f"{out}/kernel.cubin", "wb").write(k.asm["cubin"])
nv = triton.knobs.nvidia
run = lambda *a: subprocess.run(a, capture_output=True, text=True, check=True)
open(f"{out}/kernel.sass", "w").write(run(nv.cuobjdump.path, "-sass", f"{out}/kernel.cubin").stdout)
res = run(nv.cuobjdump.path, "-res-usage", f"{out}/kernel.cubin").stdout
ptxas = run(nv.ptxas.path, "-v", f"--gpu-name={sm_arch_from_capability(cap)}", f"{out}/kernel.ptx",
            "-o", f"{out}/ptxas.cubin").stderr
json.dump({"shared": k.metadata.shared, "triton": triton.__version__, "res": res, "ptxas": ptxas},
          open(f"{out}/meta.json", "w"))
"""


def parse_tiles(s: str | None, default: KernelTiles) -> KernelTiles:
    if not s:
        return default
    bn, bk, warps, stages, *split = (int(v) for v in s.split(","))
    return KernelTiles(bn=bn, bk=bk, warps=warps, stages=stages, split=split[0] if split else 1)


def expert_structs(fmt: str) -> dict:
    sds = jax.ShapeDtypeStruct
    shapes = {"gate": (D, F), "up": (D, F), "down": (F, D)}
    if fmt == "dense":
        return {m: sds((S, k, n), jnp.bfloat16) for m, (k, n) in shapes.items()}
    key = "q8" if fmt == "mxfp8" else "q4"
    out = {}
    for m, (k, n) in shapes.items():  # moe/layout.py: 16-bit words, four scale bytes a uint32
        out[f"{m}_{key}"] = sds((S, k // layout.PER_WORD[fmt], n), jnp.uint16)
        out[f"{m}_s"] = sds((S, k // layout.MX_GROUP, n), jnp.uint32)
    return out


def lower_ttir(which: str, fmt: str, tiles, tokens: int) -> tuple[str, dict]:
    """TTIR text and the custom call's settings (name, num_warps, num_stages, grid_x) of one kernel."""
    sds = jax.ShapeDtypeStruct
    rows, bm = tokens * SLOTS_PER_TOKEN, tiles.bm  # row blocks of the regime's own height
    nb = SLOTS_PER_TOKEN if tokens == 1 else kernel.max_row_blocks(rows, S, bm)
    slot = sds((nb,), jnp.int32)
    experts = expert_structs(fmt)
    if which == "gate_up":
        def fn(h, row_token, slot, rows, experts):
            return kernel.gate_up(h, row_token, slot, rows, experts, tiles, alpha=1.702, limit=7.0)
        args = (sds((tokens, D), jnp.bfloat16), sds((nb * bm,), jnp.int32), slot, slot, experts)
    else:
        def fn(a, slot, rows, experts):
            return kernel.down(a, slot, rows, experts, tiles)
        args = (sds((nb * bm, F), jnp.bfloat16), slot, slot, experts)
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    [(text, settings)] = triton_calls(lowered)
    return text, settings


def triton_calls(lowered) -> list[tuple[str, dict]]:
    """(TTIR text, settings) of every Pallas Triton custom call in a `jax.jit(...).trace(...).lower(...)` result, in
    program order; settings: the custom call's name, num_warps, num_stages and grid_x (its backend config)."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering as triton_lowering

    calls = []

    def walk(op) -> None:
        for region in op.regions:
            for block in region.blocks:
                for o in block.operations:
                    if o.operation.name == "stablehlo.custom_call":
                        calls.append(o.operation)
                    walk(o.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    out = []
    for call in calls:
        if "xla.gpu.triton" not in str(call.attributes["call_target_name"]):
            continue
        cfg = ir.DictAttr(call.attributes["mhlo.backend_config"])
        settings = {k: (ir.StringAttr(cfg[k]).value if k == "name" else ir.IntegerAttr(cfg[k]).value)
                    for k in ("name", "num_warps", "num_stages", "grid_x")}
        with triton_lowering._new_ir_context():
            text = ir.Module.parse(ir.StringAttr(cfg["ir"]).value_bytes).operation.get_asm()
        out.append((text, settings))
    return out


_SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_MMA = ("HMMA", "HGMMA", "QGMMA", "IMMA", "WGMMA")
GROUPS = [  # (name, opcode prefixes); first match wins, so the specific ones come first
    ("mma (HMMA / HGMMA)", _MMA),
    ("convert (F2FP, F2F, I2F, HADD2.F32)", ("F2FP", "F2F", "I2F", "F2I", "I2FP", "HADD2.F32")),
    ("fp32 (FMUL / FFMA / FADD / FMNMX)", ("FMUL", "FFMA", "FADD", "FMNMX", "FSEL", "FSETP")),
    ("fp16x2 (HFMA2 / HMUL2 / HADD2)", ("HFMA2", "HMUL2", "HADD2", "HMNMX2")),
    ("bit ops (LOP3 / SHF / PRMT / BFE)", ("LOP3", "SHF", "PRMT", "BFE", "BFI", "BMSK")),
    ("integer / address (IMAD / IADD3 / LEA / MOV ...)", ("IMAD", "IADD", "VIADD", "LEA", "MOV", "SEL", "ISETP",
                                                          "IABS", "UIADD", "ULEA", "USEL", "UISETP", "UMOV", "S2R",
                                                          "S2UR", "R2UR", "ULDC", "LDC", "SHL", "USHF", "ULOP")),
    ("shared loads (LDS / LDSM)", ("LDS", "LDSM")),
    ("shared stores (STS / STSM)", ("STS", "STSM")),
    ("global (LDG / LDGSTS / TMA)", ("LDG", "LDGSTS", "UTMALDG", "STG")),
    ("local memory (LDL / STL = spills)", ("LDL", "STL")),
    ("sync (BAR / DEPBAR / SYNCS / WARPSYNC)", ("BAR", "DEPBAR", "LDGDEPBAR", "SYNCS", "WARPSYNC", "ARRIVES")),
]


def hot_loop(sass: str) -> list[str]:
    """Opcodes of the loop (backward branch) that encloses the most MMA instructions."""
    ins = [(int(a, 16), op, rest) for a, op, rest in _SASS.findall(sass)]
    best: list[str] = []
    for addr, op, rest in ins:
        m = re.search(r"0x([0-9a-f]+)", rest)
        if op.startswith("BRA") and m and int(m.group(1), 16) < addr:
            body = [o for a, o, _ in ins if int(m.group(1), 16) <= a <= addr]
            key = (sum(o.startswith(_MMA) for o in body), len(body))
            if key > (sum(o.startswith(_MMA) for o in best), len(best)):
                best = body
    return best


def ttgir_loop(ttgir: str) -> tuple[str, collections.Counter, list[str]]:
    """(MMA encoding, op counts inside the outermost scf.for, shared-memory traffic lines in it)."""
    mma = re.search(r"#ttg\.nvidia_mma<\{versionMajor = (\d+), versionMinor = (\d+)[^>]*instrShape = \[([\d, ]+)\]",
                    ttgir)
    enc = f"MMAv{mma.group(1)} (instrShape [{mma.group(3)}])" if mma else "none found"
    lines, depth, body = ttgir.splitlines(), 0, []
    for line in lines:
        if not depth and "scf.for" in line:
            depth = 1
            continue
        if depth:
            depth += line.count("{") - line.count("}")
            if depth <= 0:
                break
            body.append(line)
    ops = collections.Counter(m for line in body for m in re.findall(r"= ((?:ttg|ttng|tt)\.\w+)", line))
    ops.update(m for line in body for m in re.findall(r"^\s*((?:ttg|ttng|tt)\.\w+)", line))
    smem = [re.sub(r"\s+loc\(.*", "", line.strip())[:160] for line in body
            if re.search(r"ttg\.(local_alloc|local_store|local_load|convert_layout)\b", line)]
    return enc, ops, smem


def compile_ttir(text: str, settings: dict, python: str, cap: int, workdir: Path) -> dict:
    (workdir / "kernel.ttir").write_text(text)
    r = subprocess.run([python, "-c", _COMPILE, str(workdir / "kernel.ttir"), str(workdir), str(settings["num_warps"]),
                        str(settings["num_stages"]), str(cap)], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"kernel_sass: the triton compile failed ({python}):\n{r.stderr[-3000:]}")
    meta = json.loads((workdir / "meta.json").read_text())
    meta.update({ext: (workdir / f"kernel.{ext}").read_text() for ext in ("ttgir", "ptx", "sass")})
    return meta


def report(which: str, fmt: str, bm: int, kt: KernelTiles, mode: str, settings: dict, meta: dict, *, clock_ghz: float,
           sms: int, show_ops: bool) -> None:
    regs = re.search(r"Used (\d+) registers", meta["ptxas"])
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", meta["ptxas"])
    res = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", meta["res"])
    mats = 2 if which == "gate_up" else 1
    elems = mats * kt.bk * kt.bn
    print(f"== {settings['name']} ({which}, {fmt}{'' if fmt == 'dense' else ', mx_mode=' + mode}) "
          f"bm={bm} bn={kt.bn} bk={kt.bk} warps={settings['num_warps']} stages={settings['num_stages']} "
          f"grid={settings['grid_x']}  [triton {meta['triton']}, sm_90a]")
    print(f"registers/thread {regs.group(1) if regs else '?'}, spill stores/loads {spill.group(1)}/{spill.group(2)} B, "
          f"stack {res.group(2)} B, local {res.group(3)} B, shared {meta['shared']} B" if spill and res
          else meta["ptxas"] + meta["res"])
    if regs:  # sm_90: 64K registers (allocated per warp in units of 256), 228 KB shared (1 KB reserved per CTA)
        w, r = settings["num_warps"], -(-int(regs.group(1)) * 32 // 256) * 256
        limits = {"registers": 65536 // (r * w), "shared": 233472 // (meta["shared"] + 1024), "warps": 64 // w}
        ctas = min(*limits.values(), 32)
        print(f"occupancy: {ctas} CTAs = {ctas * w} warps per SM (limits: "
              + ", ".join(f"{k} {v}" for k, v in limits.items()) + ")")
    enc, ops, smem = ttgir_loop(meta["ttgir"])
    print(f"MMA: {enc}; TTGIR K loop: " + ", ".join(f"{k} x{v}" for k, v in sorted(ops.items())
                                                     if re.search(r"dot|local_|convert_layout|async_copy|fp_to_fp",
                                                                  k)))
    for line in smem:
        print("   ", line)
    loop = hot_loop(meta["sass"])
    warps = settings["num_warps"]
    hist = collections.Counter(loop)
    print(f"SASS hot loop: {len(loop)} instructions per thread per K step; {elems} weight elements per step "
          f"({elems // (warps * 32)} per thread); warp-issue slots per weight element = count * {warps} / {elems}")
    grouped: collections.Counter = collections.Counter()
    for op, n in hist.items():
        grouped[next((g for g, pre in GROUPS if op.startswith(pre)), "other")] += n
    for g, n in sorted(grouped.items(), key=lambda kv: -kv[1]):
        print(f"  {g:52s} {n:5d}  {n * warps / elems:6.3f}/elem")
    per_elem = len(loop) * warps / elems
    # 4 warp schedulers per SM, one issue each per clock; every slot busy. fp8 and MXFP4 bytes per element differ.
    bpe = {"dense": 2, "mxfp8": 1, "mxfp4": 0.5}[fmt]
    ceiling = sms * 4 * clock_ghz * 1e9 / per_elem * bpe / 1e12
    print(f"  {'total':52s} {len(loop):5d}  {per_elem:6.3f}/elem -> issue ceiling {ceiling:.2f} TB/s of weight "
          f"bytes ({sms} SMs x 4 issue/clk x {clock_ghz} GHz, no stalls)")
    if show_ops:
        for op, n in hist.most_common():
            print(f"    {op:36s} {n:5d}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=["gate_up", "down", "both"], default="both")
    ap.add_argument("--format", choices=list(FORMATS), default="mxfp8")
    ap.add_argument("--mx-mode", default=None, help="the tiles' mx_mode (default: the table's)")
    ap.add_argument("--mx-rows", type=int, default=None, choices=(32, 64), help="the tiles' mx_rows")
    ap.add_argument("--tokens", type=int, default=8, help="T (picks the regime's tiles and the row-block count)")
    ap.add_argument("--gu", help="gate_up tiles bn,bk,warps,stages[,split] (default: the table's)")
    ap.add_argument("--dn", help="down tiles bn,bk,warps,stages[,split] (default: the table's)")
    ap.add_argument("--triton-python", default=os.environ.get("KERNEL_SASS_PYTHON", sys.executable),
                    help="a python with triton (env KERNEL_SASS_PYTHON; default: this one)")
    ap.add_argument("--capability", type=int, default=90)
    ap.add_argument("--clock-ghz", type=float, default=1.98, help="SM clock for the issue ceiling (H200 boost)")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--bm", type=int, help="row-block height (default: the table's)")
    ap.add_argument("--tail-heights", default="table",
                    help="MoeTiles.tail_heights: 'table', 'none' or rows like '32,64' (short tail blocks)")
    ap.add_argument("--dump", help="keep ttir / ttgir / ptx / sass here")
    ap.add_argument("--ops", action="store_true", help="also print the full opcode histogram of the loop")
    a = ap.parse_args()
    fmt = FORMATS[a.format]
    tiles = pick_tiles(a.tokens, fmt)
    tiles = tiles.replace(gu=parse_tiles(a.gu, tiles.gu), dn=parse_tiles(a.dn, tiles.dn),
                          mx_mode=a.mx_mode or tiles.mx_mode, mx_rows=a.mx_rows or tiles.mx_rows)
    if a.bm:
        tiles = tiles.replace(bm=a.bm)
    if a.tail_heights != "table":
        tiles = tiles.replace(tail_heights=() if a.tail_heights == "none"
                              else tuple(int(h) for h in a.tail_heights.split(",")))
    for which in (["gate_up", "down"] if a.kernel == "both" else [a.kernel]):
        text, settings = lower_ttir(which, fmt, tiles, a.tokens)
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(a.dump) / f"{settings['name']}_{tiles.mx_mode}" if a.dump else Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            meta = compile_ttir(text, settings, a.triton_python, a.capability, work)
        report(which, fmt, tiles.bm, tiles.gu if which == "gate_up" else tiles.dn, tiles.mx_mode, settings, meta,
               clock_ghz=a.clock_ghz, sms=a.sms, show_ops=a.ops)
        print()


if __name__ == "__main__":
    main()
