"""One safetensors file, read and written by hand.

Format: 8-byte little-endian header length, a JSON header
`{name: {dtype, shape, data_offsets}, "__metadata__": {...}}`, then the raw little-endian tensor bytes.
Reading memory-maps the data, so a tensor costs no host memory until its pages are touched, and every dtype
ml_dtypes knows (bf16, fp8) works without torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from checkpoints.errors import CheckpointError

# safetensors dtype string <-> numpy dtype. F8_E8M0 holds MX scales when torch wrote them as float8_e8m0fnu.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_DTYPE_NAMES: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}

# A header bigger than this is a corrupt length field, not a real header (the 23k-tensor release is ~3 MB).
_MAX_HEADER_BYTES = 100 << 20


def dtype_name(dtype: np.dtype) -> str:
    """safetensors' name for a numpy dtype."""
    try:
        return _DTYPE_NAMES[np.dtype(dtype)]
    except KeyError:
        raise CheckpointError(f"dtype {np.dtype(dtype)} has no safetensors name") from None


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One header entry: enough to validate a tensor before touching its bytes."""

    name: str
    dtype: str  # safetensors spelling, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # byte offsets relative to the data section
    end: int
    file: Path


def read_header(path: Path) -> tuple[dict[str, TensorInfo], int]:
    """Parse a file's header. Returns the tensors and the absolute offset of the data section."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: too short to be a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER_BYTES):
                raise CheckpointError(f"{path}: header length {n} is impossible for a {size}-byte file")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_start = 8 + n
    data_size = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = entry["dtype"], tuple(int(s) for s in entry["shape"])
            start, end = entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r} ({e})") from e
        if not 0 <= start <= end <= data_size:
            raise CheckpointError(f"{path}: tensor {name!r} data_offsets [{start}, {end}] lie outside the "
                                  f"{data_size}-byte data section")
        if dtype in DTYPES and end - start != math.prod(shape) * DTYPES[dtype].itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} has {end - start} bytes for shape {list(shape)} "
                                  f"of {dtype}")
        tensors[name] = TensorInfo(name, dtype, shape, int(start), int(end), path)
    return tensors, data_start


class SafetensorsFile:
    """An open safetensors file whose tensors are zero-copy views of one read-only memory map."""

    def __init__(self, path: Path):
        self.path = path
        self.tensors, self._data_start = read_header(path)
        self._mmap: np.memmap | None = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        # Dropping the last reference unmaps the file; views handed out keep it alive until they go too.
        self._mmap = None

    def get(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        if info.dtype not in DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info.dtype}")
        dtype = DTYPES[info.dtype]
        if info.end == info.start:
            return np.empty(info.shape, dtype)
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._mmap[self._data_start + info.start: self._data_start + info.end]
        return raw.view(dtype).reshape(info.shape)


@dataclasses.dataclass(frozen=True)
class LazyTensor:
    """A tensor to write, produced only when its bytes are due (so a writer holds one tensor at a time)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    make: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def write_file(path: Path, tensors: Iterable[LazyTensor], metadata: dict[str, str] | None = None) -> None:
    """Write one safetensors file; tensors are laid out in the order given."""
    tensors = list(tensors)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-aligned, as the reference writer does
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors:
            arr = np.ascontiguousarray(t.make())
            if arr.shape != t.shape or arr.dtype != np.dtype(t.dtype):
                raise CheckpointError(f"{path}: tensor {t.name!r} produced {arr.dtype}{list(arr.shape)}, "
                                      f"declared {np.dtype(t.dtype)}{list(t.shape)}")
            # Through a uint8 view: custom ml_dtypes do not export the buffer protocol themselves.
            f.write(memoryview(arr.reshape(-1).view(np.uint8)))
