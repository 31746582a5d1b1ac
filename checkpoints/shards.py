"""A checkpoint directory's safetensors: one `model.safetensors`, or shards named by its index json."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from checkpoints.errors import CheckpointError
from checkpoints.safetensors_io import LazyTensor, TensorInfo, read_header, write_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class CheckpointFiles:
    """Every tensor header of a checkpoint directory, with the file that holds it."""

    directory: Path
    files: tuple[Path, ...]  # in load order
    tensors: dict[str, TensorInfo]


def open_checkpoint_files(directory: Path) -> CheckpointFiles:
    """Read all headers (cheap: no tensor data) and check the index against them."""
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    index = directory / INDEX_NAME
    listed: dict[str, str] | None = None
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e!r})") from e
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: weight_map must be a non-empty object")
        listed = {str(k): str(v) for k, v in weight_map.items()}
        files = tuple(directory / f for f in dict.fromkeys(sorted(listed.values())))
        for name, fname in listed.items():
            if not (directory / fname).is_file():
                raise CheckpointError(f"{index}: shard file {fname!r} (listed for tensor {name!r}) "
                                      "does not exist")
    else:
        files = tuple(sorted(directory.glob("*.safetensors")))
        if not files:
            raise CheckpointError(f"{directory}: no {SINGLE_NAME} or {INDEX_NAME} "
                                  "(no *.safetensors files at all)")

    tensors: dict[str, TensorInfo] = {}
    for path in files:
        infos, _ = read_header(path)
        for name, info in infos.items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} appears in both {tensors[name].file.name} "
                                      f"and {path.name}")
            tensors[name] = info
    if listed is not None:
        for name, fname in listed.items():
            if name not in tensors or tensors[name].file.name != fname:
                found = f"found in {tensors[name].file.name}" if name in tensors else "not in any shard"
                raise CheckpointError(f"{index}: lists tensor {name!r} in {fname}, but it is {found}")
    return CheckpointFiles(directory, files, tensors)


def _plan(tensors: Sequence[LazyTensor], max_shard_bytes: int) -> list[list[LazyTensor]]:
    """Greedy shards in the given order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[LazyTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def write_checkpoint_files(directory: Path, tensors: Sequence[LazyTensor],
                           max_shard_bytes: int | None) -> None:
    """Write `model.safetensors`, or shards plus the index when `max_shard_bytes` is given."""
    # A stale index or shard set from an earlier write would shadow (or mix into) the new files.
    for old in [directory / INDEX_NAME, directory / SINGLE_NAME, *directory.glob("model-*-of-*.safetensors")]:
        old.unlink(missing_ok=True)
    if max_shard_bytes is None:
        write_file(directory / SINGLE_NAME, tensors)
        return
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards = _plan(tensors, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_file(directory / fname, shard)
        weight_map.update({t.name: fname for t in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
