"""The public loading API: `load_model(path)` -> `M3Model` with `.logits(token_ids)` and greedy generation."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.config import M3Config
from m3jax.model import ForwardOutput, KVState, forward
from m3jax.sharding import ShardingRules, make_rules, shard_params

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Contiguous caches are sized in multiples of this, so a new prompt length rarely means a new compile.
_LEN_BUCKET = 128


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class M3Model:
    """A loaded M3 text backbone on one device or a TP mesh."""

    def __init__(self, cfg: M3Config, params: Any, rules: ShardingRules, dtype: Any, path: Path | None = None):
        self.cfg = cfg
        self.params = params
        self.rules = rules
        self.dtype = dtype
        self.path = path
        # cfg is a frozen dataclass, so it can be a static argument; the KV state is donated.
        self._forward: Callable[..., ForwardOutput] = jax.jit(forward, static_argnums=(1,), donate_argnums=(3,))

    # ---- state ---------------------------------------------------------------------------------------
    def new_state(self, batch: int, max_len: int) -> KVState:
        if max_len > self.cfg.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds max_position_embeddings={self.cfg.max_position_embeddings}")
        sharding = self.rules.kv_sharding(self.cfg, batch, max_len)
        kv = KVState.empty(self.cfg, batch, max_len, self.dtype)
        kv.k = [jax.device_put(a, sharding) for a in kv.k]
        kv.v = [jax.device_put(a, sharding) for a in kv.v]
        return kv

    def step(self, tokens_BT: np.ndarray | jax.Array, kv: KVState,
             logit_index_B: np.ndarray | jax.Array | None = None) -> ForwardOutput:
        """Append tokens to `kv` (donated: do not reuse the old state) and return logits and the new state."""
        tokens = jnp.asarray(tokens_BT, jnp.int32)
        if int(jnp.max(kv.lengths)) + tokens.shape[1] > kv.max_len:
            raise ValueError(f"state holds {kv.max_len} tokens per row; cannot append {tokens.shape[1]} more")
        idx = None if logit_index_B is None else jnp.asarray(logit_index_B, jnp.int32)
        return self._forward(self.params, self.cfg, tokens, kv, idx)

    # ---- public ------------------------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
        """Full causal forward of each row of `token_ids [B, S]` (no padding): fp32 logits `[B, S, vocab]`."""
        ids = self._check_ids(np.asarray(token_ids))
        B, S = ids.shape
        out = self.step(ids, self.new_state(B, _round_up(S, _LEN_BUCKET)))
        return np.asarray(out.logits, dtype=np.float32)

    def block_selections(self, token_ids: Sequence[Sequence[int]] | np.ndarray) -> dict[int, np.ndarray]:
        """Per sparse layer, the MSA blocks each query row selected: `[B, kv_heads, S, topk]`, -1 padded."""
        ids = self._check_ids(np.asarray(token_ids))
        B, S = ids.shape
        out = self.step(ids, self.new_state(B, _round_up(S, _LEN_BUCKET)))
        return {layer: np.asarray(b) for layer, b in out.selections.items()}

    def generate_greedy(self, prompt_ids: Sequence[int], max_new_tokens: int,
                        stop_ids: Sequence[int] = ()) -> Iterator[int]:
        """Greedy decoding of one prompt, yielding token ids as they come (stops at a stop id, included)."""
        prompt = self._check_ids(np.asarray([list(prompt_ids)]))
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        n = prompt.shape[1]
        total = n + max_new_tokens
        if total > self.cfg.max_position_embeddings:
            raise ValueError(f"prompt ({n}) + max_new_tokens ({max_new_tokens}) exceeds the model length "
                             f"{self.cfg.max_position_embeddings}")
        max_len = min(_round_up(total, _LEN_BUCKET), self.cfg.max_position_embeddings)
        # Right-pad the prompt to a bucket: padding slots lie beyond every real query's causal cutoff and are
        # overwritten by the decoded tokens before anything reads them.
        padded_len = min(_round_up(n, _LEN_BUCKET), max_len)
        padded = np.zeros((1, padded_len), np.int32)
        padded[0, :n] = prompt[0]
        out = self.step(padded, self.new_state(1, max_len), np.array([n - 1]))
        kv = out.kv
        kv.lengths = jnp.full_like(kv.lengths, n)
        stop = set(int(s) for s in stop_ids)
        for _ in range(max_new_tokens):
            tok = int(jnp.argmax(out.logits[0, -1]))
            yield tok
            if tok in stop:
                return
            out = self.step(np.array([[tok]]), kv)
            kv = out.kv

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
               expert_parallel: bool = False) -> M3Model:
    """Load an M3 checkpoint directory (VL wrapper or text-only; bf16 or MXFP8) onto 1 or `tensor_parallel_size`
    devices. `path=None` loads the embedded tiny model."""
    from checkpoints import load_params

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    path = Path(path) if path is not None else embedded_model_path()
    cfg, host_params = load_params(path, dtype=dtype)
    rules = make_rules(tensor_parallel_size, expert_parallel)
    params = shard_params(host_params, cfg, rules)
    return M3Model(cfg, params, rules, _DTYPES[dtype], path)
