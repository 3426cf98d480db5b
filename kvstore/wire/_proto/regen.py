"""Regenerate the stubs in this package from proto/kvstore.proto.

The proto directory is mapped to the virtual path ``kvstore/wire/_proto`` so the generated
modules import each other as ``kvstore.wire._proto.*`` (a top-level ``proto`` package would
collide with the proto-plus distribution).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
GENERATED = ("kvstore_pb2.py", "kvstore_pb2.pyi", "kvstore_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    """Write the stubs under ``out_root/kvstore/wire/_proto``; returns their paths."""
    from grpc_tools import protoc

    (out_root / "kvstore" / "wire" / "_proto").mkdir(parents=True, exist_ok=True)
    args = [
        "protoc", f"-Ikvstore/wire/_proto={ROOT / 'proto'}", f"--python_out={out_root}",
        f"--grpc_python_out={out_root}", f"--pyi_out={out_root}", "kvstore/wire/_proto/kvstore.proto",
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return [out_root / "kvstore" / "wire" / "_proto" / name for name in GENERATED]


if __name__ == "__main__":
    for path in generate(ROOT):
        print(path)
    sys.exit(0)
