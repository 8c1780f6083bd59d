"""Protocol buffers of the feeder service.

The Python modules are generated from ``feeder.proto`` by the build (``make proto``);
when they are missing or older than the ``.proto`` (an install that skipped the
Makefile), they are generated here once, on first import.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _generate_if_stale() -> None:
    proto = _HERE / "feeder.proto"
    outputs = [_HERE / "feeder_pb2.py", _HERE / "feeder_pb2_grpc.py"]
    if all(p.exists() and p.stat().st_mtime >= proto.stat().st_mtime for p in outputs):
        return
    from grpc_tools import protoc  # build-time dependency, imported only when needed

    root = _HERE.parent
    args = ["protoc", f"-I{root}", f"--python_out={root}", f"--pyi_out={root}",
            f"--grpc_python_out={root}", str(proto)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed to compile {proto}")


_generate_if_stale()
