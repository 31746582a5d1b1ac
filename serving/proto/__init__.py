"""The gRPC API's schema (`m3jax.proto`) and its generated stubs, which are committed.

After editing m3jax.proto, regenerate the stubs from the repository root with `python -m serving.proto`
(needs the `test` extra's pinned grpcio-tools); a test regenerates them and fails if they differ.
"""

from __future__ import annotations

from pathlib import Path

PROTO = Path(__file__).with_name("m3jax.proto")
GENERATED = ("m3jax_pb2.py", "m3jax_pb2.pyi", "m3jax_pb2_grpc.py")


def generate(out_root: str | Path) -> list[Path]:
    """Run protoc (grpc_tools) on m3jax.proto, writing `<out_root>/serving/proto/<GENERATED>`.

    The include root is the repository root, so that the generated modules import each other as
    `serving.proto.m3jax_pb2` (protoc writes imports after the proto's path).
    """
    import importlib.resources
    import os

    from grpc_tools import protoc

    repo = PROTO.parents[2]
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    out = Path(out_root)
    args = ["grpc_tools.protoc", f"-I{repo}", f"-I{well_known}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", str(PROTO.relative_to(repo))]
    # protoc resolves the proto's own path against the include roots; run it from the repository root.
    cwd = os.getcwd()
    try:
        os.chdir(repo)
        code = protoc.main(args)
    finally:
        os.chdir(cwd)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")
    return [out / "serving" / "proto" / name for name in GENERATED]
