"""A complete synthetic checkpoint directory: config, random weights, tokenizer and chat template."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from checkpoints.tokenizer import write_tokenizer_files
from checkpoints.writer import write_checkpoint
from m3jax.config import M3Config, preset
from m3jax.params import random_params


def make_tiny_checkpoint(out_dir: str | os.PathLike[str], cfg: M3Config | None = None, seed: int = 0, *,
                         layout: str = "released", dtype: str = "float32", max_shard_bytes: int | None = None,
                         mxfp8: bool = False, scale: float = 1.0) -> tuple[M3Config, dict[str, Any]]:
    """Write a loadable, tokenizable checkpoint of `cfg` (default the m3-tiny preset) with random weights.

    The config written carries the tiny tokenizer's `]~!b[` / `[e~[` ids as bos / eos. Returns that config and
    the float32 params before any storage rounding (bf16 / MXFP8 copies on disk are rounded from them).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = cfg if cfg is not None else preset("m3-tiny")
    ids = write_tokenizer_files(out, cfg.vocab_size, cfg.max_position_embeddings)
    cfg = cfg.replace(bos_token_id=ids.bos, eos_token_ids=(ids.eos,))
    params = random_params(cfg, seed=seed, dtype="float32", scale=scale)
    write_checkpoint(out, cfg, params, layout=layout, dtype=dtype, max_shard_bytes=max_shard_bytes,
                     mxfp8=mxfp8)
    generation = {"bos_token_id": ids.bos, "eos_token_id": ids.eos, "do_sample": True, "temperature": 1.0,
                  "top_p": 0.95, "top_k": 40}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return cfg, params
