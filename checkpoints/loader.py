"""Load a Hugging Face M3 checkpoint directory into the m3jax numpy params tree.

Everything is validated from the headers first (names, shapes, dtypes, MXFP8 scales), so a bad checkpoint
fails in milliseconds with a message naming the tensor and its file. Then tensors stream shard by shard, in
file order, from the memory map straight into their slot of preallocated param arrays (stacked experts are
filled one expert at a time), so the checkpoint is never held twice in host memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from checkpoints.errors import CheckpointError
from checkpoints.mxfp8 import dequantize_mxfp8, scale_shape
from checkpoints.names import Layout, TensorRule, detect_layout, hf_view, is_skipped, param_slot, tensor_rules
from checkpoints.safetensors_io import SafetensorsFile, TensorInfo
from checkpoints.shards import CheckpointFiles, open_checkpoint_files
from m3jax.config import M3Config
from m3jax.params import map_specs, param_specs, spec_dtype

_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_SCALE_DTYPES = ("U8", "F8_E8M0")
_LOAD_DTYPES = ("float32", "bfloat16", "float16")
_MAX_THREADS = 16


def _config_path(directory: Path) -> Path:
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    config = directory / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{directory}: no config.json (not a checkpoint directory?)")
    return config


def read_config(path: str | os.PathLike[str]) -> M3Config:
    """The M3Config of a checkpoint directory (its config.json, either spelling)."""
    return M3Config.from_json_file(_config_path(Path(path)))


def _check_quantization(config: Path) -> None:
    """Only MXFP8 is understood; anything else would load as garbage, so refuse it by name."""
    try:
        raw = json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config}: not valid JSON ({e})") from e
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    q = raw.get("quantization_config") or text.get("quantization_config")
    if not q:
        return
    if not isinstance(q, dict):
        raise CheckpointError(f"{config}: quantization_config must be an object")
    method = q.get("quant_method")
    if method != "mxfp8":
        raise CheckpointError(f"{config}: quantization_config.quant_method {method!r} is not "
                              "supported (only 'mxfp8')")
    block = q.get("weight_block_size", [1, 32])
    if list(block) != [1, 32]:
        raise CheckpointError(f"{config}: MXFP8 weight_block_size {block} is not supported "
                              "(only [1, 32])")


@dataclasses.dataclass(frozen=True)
class _Entry:
    """A checkpoint tensor matched to its rule (and its MXFP8 scale, when quantised)."""

    rule: TensorRule
    info: TensorInfo
    scale: TensorInfo | None


def _match(files: CheckpointFiles, cfg: M3Config, layout: Layout) -> list[_Entry]:
    """Pair every checkpoint tensor with a rule; raise on anything missing, unexpected or malformed."""
    present = files.tensors
    rules = tensor_rules(cfg, layout, present)
    # Any Linear may carry an MXFP8 scale; which ones do is the checkpoint's business.
    scales = {r.scale_name: r for r in rules.values() if any(p.linear for p in r.pieces)}

    for name, info in present.items():
        if name not in rules and name not in scales and not is_skipped(name):
            raise CheckpointError(f"unexpected tensor {name!r} in {info.file.name} (not a tensor of this "
                                  f"config in the {layout.name} layout)")
    tied = cfg.tie_word_embeddings
    missing = [n for n in rules if n not in present and not (tied and n == layout.lm_head)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]!r}{more} in {files.directory} "
                              f"({layout.name} layout)")

    entries = []
    for name, rule in rules.items():
        if name not in present:
            continue
        info = present[name]
        where = f"tensor {name!r} in {info.file.name}"
        if info.shape != rule.shape:
            raise CheckpointError(f"{where}: expected shape {list(rule.shape)}, found {list(info.shape)}")
        scale = present.get(rule.scale_name)
        if scale is None:
            if info.dtype not in _FLOAT_DTYPES:
                hint = f" without its scale {rule.scale_name!r}" if info.dtype == "F8_E4M3" else ""
                raise CheckpointError(f"{where}: unsupported dtype {info.dtype}{hint}")
        else:
            swhere = f"tensor {scale.name!r} in {scale.file.name}"
            if info.dtype != "F8_E4M3":
                raise CheckpointError(f"{where}: has an MXFP8 scale but dtype {info.dtype} "
                                      "(expected F8_E4M3)")
            if scale.dtype not in _SCALE_DTYPES:
                raise CheckpointError(f"{swhere}: unsupported scale dtype {scale.dtype} "
                                      "(expected U8 / F8_E8M0)")
            if scale.shape != scale_shape(rule.shape):
                raise CheckpointError(f"{swhere}: expected shape {list(scale_shape(rule.shape))}, "
                                      f"found {list(scale.shape)}")
        entries.append(_Entry(rule, info, scale))
    return entries


class _OpenFiles:
    """Memory maps opened on first use; an MXFP8 scale may sit in a different shard than its weight."""

    def __init__(self) -> None:
        self._files: dict[Path, SafetensorsFile] = {}

    def get(self, info: TensorInfo) -> np.ndarray:
        if info.file not in self._files:
            self._files[info.file] = SafetensorsFile(info.file)
        return self._files[info.file].get(info.name)

    def close(self, path: Path | None = None) -> None:
        for p in [path] if path is not None else list(self._files):
            f = self._files.pop(p, None)
            if f is not None:
                f.close()


class _Pool:
    """Copy threads for big Linears (none on a single core)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.executor = ThreadPoolExecutor(workers) if workers > 1 else None

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()


# HF rows (the out axis) per copy step of a Linear. HF rows are contiguous on disk, so copying the transposed
# matrix in short row blocks reads sequentially and keeps the strided writes in cache: about twice as fast as
# one np.copyto of the whole transposed view.
_ROW_BLOCK = 32
# Linears at least this big are split over threads (numpy releases the GIL while copying and dequantising).
_PARALLEL_BYTES = 8 << 20


def _copy_linear(dst: np.ndarray, block: np.ndarray, scale: np.ndarray | None, rows: tuple[int, int],
                 pool: _Pool) -> None:
    """dst[in, r] = block[rows[0] + r, in], dequantised if `scale` is given: a Linear's `hf_view`, blocked."""
    r0, r1 = rows

    def copy(a: int, b: int) -> None:
        for j in range(a, b, _ROW_BLOCK):
            k = min(j + _ROW_BLOCK, b)
            src = block[j:k] if scale is None else dequantize_mxfp8(block[j:k], scale[j:k])
            np.copyto(dst[:, j - r0:k - r0], src.T, casting="unsafe")

    if pool.executor is None or dst.nbytes < _PARALLEL_BYTES:
        copy(r0, r1)
        return
    # One contiguous run of row blocks per thread.
    step = -(-(r1 - r0) // (pool.workers * _ROW_BLOCK)) * _ROW_BLOCK
    list(pool.executor.map(lambda a: copy(a, min(a + step, r1)), range(r0, r1, step)))


def _fill(entry: _Entry, files: _OpenFiles, params: dict[str, Any], pool: _Pool) -> None:
    """Copy one checkpoint tensor into its param slots, converting dtype on the way."""
    rule = entry.rule
    data = files.get(entry.info)
    scale = files.get(entry.scale) if entry.scale is not None else None
    for e in range(rule.shape[0]) if rule.stacked else [None]:
        block = data if e is None else data[e]
        block_scale = None if scale is None else scale if e is None else scale[e]
        for piece in rule.pieces:
            slot = param_slot(params, piece, e)
            if piece.linear:
                rows = piece.rows or (0, block.shape[0])
                # copy=False: the slot must be filled in place, never through a silently reshaped copy.
                dst = np.reshape(slot, (block.shape[1], rows[1] - rows[0]), copy=False)
                _copy_linear(dst, block, block_scale, rows, pool)
            else:
                assert block_scale is None, rule.name  # scales are only accepted for Linears
                src = hf_view(block, piece)
                np.copyto(np.reshape(slot, src.shape, copy=False), src, casting="unsafe")


def _progress(total: int, desc: str) -> tqdm:
    quiet = os.environ.get("M3JAX_NO_PROGRESS") == "1" or not sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit="tensor", disable=quiet, dynamic_ncols=True)


def load_params(path: str | os.PathLike[str], dtype: str = "float32",
                cfg: M3Config | None = None) -> tuple[M3Config, dict[str, Any]]:
    """Load a checkpoint directory. Returns (cfg, params) with params matching `param_specs(cfg)` exactly.

    `dtype` is the compute dtype of the returned arrays; router weight and bias stay float32. MXFP8 weights
    are dequantised. `cfg` overrides the directory's config.json (e.g. to set runtime-only knobs); shapes must
    match.
    """
    directory = Path(path)
    if dtype not in _LOAD_DTYPES:
        raise ValueError(f"dtype must be one of {_LOAD_DTYPES}, got {dtype!r}")
    _check_quantization(_config_path(directory))
    cfg = cfg if cfg is not None else read_config(directory)
    files = open_checkpoint_files(directory)
    layout = detect_layout(files.tensors)
    entries = _match(files, cfg, layout)

    params = map_specs(lambda s: np.empty(s.shape, spec_dtype(s, dtype)), param_specs(cfg))
    # File order, then offset order: each shard is read front to back once.
    order = {f: i for i, f in enumerate(files.files)}
    entries.sort(key=lambda en: (order[en.info.file], en.info.start))
    opened = _OpenFiles()
    pool = _Pool(min(_MAX_THREADS, os.cpu_count() or 1))
    try:
        with _progress(len(entries), f"loading {directory.name}") as bar:
            for i, entry in enumerate(entries):
                _fill(entry, opened, params, pool)
                bar.update()
                if i + 1 == len(entries) or entries[i + 1].info.file != entry.info.file:
                    opened.close(entry.info.file)
    finally:
        opened.close()
        pool.close()
    if cfg.tie_word_embeddings and layout.lm_head not in files.tensors:
        params["lm_head"][...] = params["embed"].T
    return cfg, params
