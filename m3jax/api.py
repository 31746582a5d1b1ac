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
from m3jax.sharding import ShardingRules, make_abstract_rules, make_rules, shard_params
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
        # The ops are sharded by the same rules as the params (pallas_kernels/sharded.py).
        self.kernels = (kernels or KernelChoice("auto", "auto")).resolve(rules.mesh.size).on(rules.topology)
        # cfg and the kernel choice are frozen dataclasses, so they can be static arguments; the pool is donated.
        self._forward: Callable[..., ForwardOutput] = jax.jit(forward, static_argnums=(1, 4), donate_argnums=(2,),
                                                              compiler_options=self.kernels.compiler_options)

    @classmethod
    def create(cls, cfg: M3Config, host_params: Any, dtype: str = "float32", tensor_parallel_size: int = 1,
               expert_parallel: bool = False, path: Path | None = None, moe_weight_format: str = "bf16",
               kernels: KernelChoice | None = None) -> M3Model:
        """Place host params (numpy pytree matching `param_specs(cfg)`) on a mesh of `tensor_parallel_size`.

        When the MoE layers run the Pallas kernels (compiled or interpreted), their weights are also laid out
        once for them (`checkpoints.prepare`, each device its own shard), in `moe_weight_format` ("bf16", or
        "mxfp8" / "mxfp4" to keep them 8- / 4-bit on the device). `kernels`: what each op family runs (default:
        "auto", resolved for this backend).
        """
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        rules = make_rules(tensor_parallel_size, expert_parallel)
        params = shard_params(host_params, cfg, rules)
        kernels = (kernels or KernelChoice("auto", "auto")).resolve(rules.mesh.size).on(rules.topology)
        if kernels.moe != "reference" and "moe" in cfg.mlp_types:
            from checkpoints.prepare import prepare_params

            params = prepare_params(params, moe_weight_format, keep_reference=False, topology=rules.topology)
        return cls(cfg, params, rules, _DTYPES[dtype], path, kernels)

    @classmethod
    def abstract(cls, cfg: M3Config, dtype: str = "bfloat16", moe_weight_format: str = "bf16",
                 kernels: KernelChoice | None = None, tensor_parallel_size: int = 1,
                 expert_parallel: bool = False) -> M3Model:
        """A model whose params are shapes only (`jax.ShapeDtypeStruct`), laid out as `create` would lay them
        out: enough to trace, lower and compile its steps ahead of time, for any size, on any machine. On
        several devices the mesh is abstract (no devices needed) and every param carries its placement, so the
        sharded step lowers for N devices anywhere (`pallas_kernels.gpu_lowering.lower_for_gpu`)."""
        from m3jax.params import init_params

        rules = make_rules(1) if tensor_parallel_size == 1 else make_abstract_rules(tensor_parallel_size,
                                                                                     expert_parallel)
        kernels = (kernels or KernelChoice("auto", "auto")).resolve(tensor_parallel_size).on(rules.topology)
        params = jax.eval_shape(lambda: init_params(cfg, dtype=_DTYPES[dtype]))
        if rules.topology.sharded:
            params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
                                  rules.param_shardings(cfg))
        if kernels.moe != "reference" and "moe" in cfg.mlp_types:
            from checkpoints.prepare import prepare_params

            prepared = jax.eval_shape(lambda p: prepare_params(p, moe_weight_format, keep_reference=False,
                                                               topology=rules.topology), params)
            if rules.topology.sharded:
                prepared = _place_prepared(prepared, params, rules)
            params = prepared
        return cls(cfg, params, rules, _DTYPES[dtype], kernels=kernels)

    def page_shapes(self, num_pages: int) -> KVPages:
        """The page pool's shapes, dtypes and placements (`jax.ShapeDtypeStruct`s): per layer run K and V
        `[layers, pages, page_size, K', hd]`, K' = the KV heads the mesh holds (`Topology.kv_heads`: the model's,
        or one per device when TP exceeds them and they are replicated); index-K `[layers, pages, page_size,
        hdi]`, replicated."""
        cfg = self.cfg
        width = self.kernels.topology.kv_heads(cfg.num_heads, cfg.num_kv_heads)
        axes = ("layers", "pages", "page_slots", "kv_heads", "head_dim")

        def kv(layers: int) -> jax.ShapeDtypeStruct:
            shape = (layers, num_pages, self.page_size, width, cfg.head_dim)
            return jax.ShapeDtypeStruct(shape, self.dtype, sharding=self.rules.sharding(shape, axes, "kv pages"))

        def index(layers: int) -> jax.ShapeDtypeStruct:
            shape = (layers, num_pages, self.page_size, cfg.index_head_dim)
            return jax.ShapeDtypeStruct(shape, self.dtype, sharding=self.rules.replicated())

        runs = cfg.layer_runs
        return KVPages([kv(r.count) for r in runs], [kv(r.count) for r in runs],
                       [index(r.count) if r.attn == "sparse" else None for r in runs])

    def new_pages(self, num_pages: int) -> KVPages:
        """A page pool (page 0 is the padding sink, never handed out)."""
        # Every array committed to the mesh up front, made in place there (a KV pool can be most of a device's
        # memory): a step's outputs then have the inputs' placement, so the next step hits the same executable.
        return jax.tree.map(lambda s: jax.jit(lambda: jnp.zeros(s.shape, s.dtype), out_shardings=s.sharding)(),
                            self.page_shapes(num_pages))

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


def _place_prepared(prepared: Any, params: Any, rules: ShardingRules) -> Any:
    """Shapes-only prepared params with the placements `checkpoints.prepare` gives the real ones."""
    from jax.sharding import NamedSharding

    from pallas_kernels.sharded import expert_spec

    topo = rules.topology
    runs = []
    for run, orig in zip(prepared["runs"], params["runs"], strict=True):
        if "moe" in run:
            mode = topo.moe_mode(orig["moe"]["router"].shape[-1], orig["moe"]["w_gate"].shape[-1])
            experts = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
                rules.mesh, expert_spec(k, v.ndim, topo, mode))) for k, v in run["moe"]["experts"].items()}
            moe = {k: orig["moe"][k] if k != "experts" else experts for k in run["moe"]}
            run = dict(run, moe=moe)
        runs.append({k: run[k] if k == "moe" else orig[k] for k in run})
    return dict(params, runs=runs)


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
