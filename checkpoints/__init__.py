"""Hugging Face MiniMax M3 checkpoints <-> the m3jax params tree.

`load_params` streams a safetensors checkpoint (single file or sharded; released, transformers or
transformers-VL tensor names; bf16 / fp32 / MXFP8) into numpy arrays laid out as `m3jax.params.param_specs`.
`write_checkpoint` and `make_tiny_checkpoint` produce such checkpoints, for tests and export.
"""

from checkpoints.errors import CheckpointError
from checkpoints.loader import load_params, read_config
from checkpoints.mxfp8 import dequantize_mxfp8, quantize_mxfp8
from checkpoints.tiny import make_tiny_checkpoint
from checkpoints.writer import write_checkpoint

__all__ = [
    "CheckpointError",
    "dequantize_mxfp8",
    "load_params",
    "make_tiny_checkpoint",
    "quantize_mxfp8",
    "read_config",
    "write_checkpoint",
]
