"""The public loading API: `load_model(path)` -> `M3Model` with `.logits(token_ids)` and greedy generation."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.batch import Batch, KVPages, RowPlan, build_batch, page_size
from m3jax.config import M3Config
from m3jax.model import ForwardOutput, forward
from m3jax.sharding import ShardingRules, make_rules, shard_params
from pallas_kernels.choice import KernelChoice

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Prompts are padded to a multiple of this, so a new prompt length rarely means a new compile.
_TOKEN_BUCKET = 64


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class M3Model:
    """A loaded M3 text backbone on one device or a TP mesh."""

    def __init__(self, cfg: M3Config, params: Any, rules: ShardingRules, dtype: Any, path: Path | None = None,
                 kernels: KernelChoice | None = None):
        self.cfg = cfg
        self.params = params
        self.rules = rules
        self.dtype = dtype
        self.path = path
        self.page_size = page_size(cfg)
        self.kernels = (kernels or KernelChoice("auto", "auto")).resolve(rules.mesh.size)
        # cfg and the kernel choice are frozen dataclasses, so they can be static arguments; the pool is donated.
        self._forward: Callable[..., ForwardOutput] = jax.jit(forward, static_argnums=(1, 4), donate_argnums=(2,))

    @classmethod
    def create(cls, cfg: M3Config, host_params: Any, dtype: str = "float32", tensor_parallel_size: int = 1,
               expert_parallel: bool = False, path: Path | None = None, moe_weight_format: str = "bf16",
               kernels: KernelChoice | None = None) -> M3Model:
        """Place host params (numpy pytree matching `param_specs(cfg)`) on a mesh of `tensor_parallel_size`.

        When the MoE layers run the Pallas kernels, their weights are also laid out once for them
        (`checkpoints.prepare`), in `moe_weight_format` ("bf16", or "mxfp8" / "mxfp4" to keep them 8- / 4-bit on
        the device). `kernels`: what each op family runs (default: "auto", resolved for this backend).
        """
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        rules = make_rules(tensor_parallel_size, expert_parallel)
        params = shard_params(host_params, cfg, rules)
        kernels = (kernels or KernelChoice("auto", "auto")).resolve(rules.mesh.size)
        if kernels.moe == "pallas" and "moe" in cfg.mlp_types:
            from checkpoints.prepare import prepare_params

            params = prepare_params(params, moe_weight_format, keep_reference=False)
        return cls(cfg, params, rules, _DTYPES[dtype], path, kernels)

    @classmethod
    def abstract(cls, cfg: M3Config, dtype: str = "bfloat16", moe_weight_format: str = "bf16",
                 kernels: KernelChoice | None = None) -> M3Model:
        """A model whose params are shapes only (`jax.ShapeDtypeStruct`), laid out as `create` would lay them
        out: enough to trace, lower and compile its steps ahead of time, for any size, on any machine."""
        from m3jax.params import init_params

        kernels = (kernels or KernelChoice("auto", "auto")).resolve(1)
        params = jax.eval_shape(lambda: init_params(cfg, dtype=_DTYPES[dtype]))
        if kernels.moe == "pallas" and "moe" in cfg.mlp_types:
            from checkpoints.prepare import prepare_params

            params = jax.eval_shape(lambda p: prepare_params(p, moe_weight_format, keep_reference=False), params)
        return cls(cfg, params, make_rules(1), _DTYPES[dtype], kernels=kernels)

    def new_pages(self, num_pages: int) -> KVPages:
        """A page pool (page 0 is the padding sink, never handed out)."""
        axes = ("layers", "pages", "page_slots", "kv_heads", "head_dim")
        sharding = self.rules.sharding((1, num_pages, self.page_size, self.cfg.num_kv_heads, self.cfg.head_dim),
                                       axes, "kv pages")
        # Every array committed to the mesh up front: a step's outputs then have the inputs' placement, so the
        # next step hits the same compiled executable.
        return KVPages.empty(self.cfg, num_pages, self.dtype, sharding, self.rules.replicated())

    def step(self, kv: KVPages, batch: Batch) -> ForwardOutput:
        """One jitted forward over a flat ragged batch; `kv` is donated (use the returned one)."""
        return self._forward(self.params, self.cfg, kv, batch, self.kernels)

    # ---- public ------------------------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
        """Full causal forward of each row of `token_ids [B, S]` (no padding): fp32 logits `[B, S, vocab]`."""
        ids = self._check_ids(np.asarray(token_ids))
        out = self._full_forward(ids)
        return np.asarray(out.logits, dtype=np.float32).reshape(*ids.shape, -1)

    def block_selections(self, token_ids: Sequence[Sequence[int]] | np.ndarray) -> dict[int, np.ndarray]:
        """Per sparse layer, the MSA blocks each query row selected: `[B, kv_heads, S, topk]`, -1 padded."""
        ids = self._check_ids(np.asarray(token_ids))
        B, S = ids.shape
        out = self._full_forward(ids)
        return {layer: np.asarray(b[: B * S]).reshape(B, S, *b.shape[1:]).transpose(0, 2, 1, 3)
                for layer, b in out.selections.items()}

    def generate_greedy(self, prompt_ids: Sequence[int], max_new_tokens: int,
                        stop_ids: Sequence[int] = ()) -> Iterator[int]:
        """Greedy decoding of one prompt, yielding token ids as they come (stops at a stop id, included)."""
        prompt = self._check_ids(np.asarray([list(prompt_ids)]))[0].tolist()
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        n = len(prompt)
        if n + max_new_tokens > self.cfg.max_position_embeddings:
            raise ValueError(f"prompt ({n}) + max_new_tokens ({max_new_tokens}) exceeds the model length "
                             f"{self.cfg.max_position_embeddings}")
        width = -(-(n + max_new_tokens) // self.page_size)
        pages = list(range(1, width + 1))
        kv = self.new_pages(width + 1)
        # Prefill padded to a token bucket (padding writes to the sink page), then one token per step.
        batch, _ = build_batch([RowPlan(prompt, 0, pages)], self.page_size, _round_up(n, _TOKEN_BUCKET), 1, width)
        out = self.step(kv, batch)
        stop = {int(s) for s in stop_ids}
        pos = n
        for _ in range(max_new_tokens):
            tok = int(jnp.argmax(out.logits[0]))
            yield tok
            if tok in stop:
                return
            batch, _ = build_batch([RowPlan([tok], pos, pages)], self.page_size, 1, 1, width)
            out = self.step(out.kv, batch)
            pos += 1

    def _full_forward(self, ids: np.ndarray) -> ForwardOutput:
        B, S = ids.shape
        per_row = -(-S // self.page_size)
        rows = [RowPlan(ids[b].tolist(), 0, range(1 + b * per_row, 1 + (b + 1) * per_row), sample=False)
                for b in range(B)]
        batch, _ = build_batch(rows, self.page_size, B * S, B, per_row, num_logit_rows=0)
        batch.logit_rows = jnp.arange(B * S, dtype=jnp.int32)
        return self.step(self.new_pages(1 + B * per_row), batch)

    def _check_ids(self, ids: np.ndarray) -> np.ndarray:
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"token_ids must be a non-empty [batch, seq] array, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token_ids must be integers, got {ids.dtype}")
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size}); got range [{ids.min()}, {ids.max()}]")
        if ids.shape[1] > self.cfg.max_position_embeddings:
            raise ValueError(f"sequence length {ids.shape[1]} exceeds max_position_embeddings="
                             f"{self.cfg.max_position_embeddings}")
        return ids.astype(np.int32)


def embedded_model_path() -> Path:
    """The tiny M3-architecture checkpoint shipped inside the package (the default when no model is given)."""
    import checkpoints

    return Path(checkpoints.__file__).parent / "tiny"


def load_model(path: str | Path | None = None, dtype: str = "float32", tensor_parallel_size: int = 1,
               expert_parallel: bool = False, moe_weight_format: str = "bf16",
               kernels: KernelChoice | None = None) -> M3Model:
    """Load an M3 checkpoint directory (VL wrapper or text-only; bf16 or MXFP8) onto 1 or `tensor_parallel_size`
    devices. `path=None` loads the embedded tiny model."""
    from checkpoints import load_params

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    path = Path(path) if path is not None else embedded_model_path()
    cfg, host_params = load_params(path, dtype=dtype)
    return M3Model.create(cfg, host_params, dtype, tensor_parallel_size, expert_parallel, path, moe_weight_format,
                          kernels)
