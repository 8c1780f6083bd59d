"""Build step of the feeder distribution: generate the protobuf modules from
``protos/feeder.proto`` before the packages are collected, so wheels and
``pip install .`` ship ``protos/feeder_pb2.py`` and ``feeder_pb2_grpc.py`` and need no
protobuf compiler at run time. Everything else is in ``pyproject.toml``."""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO = Path("protos") / "feeder.proto"


def generate_protos() -> None:
    """Run protoc (from grpcio-tools, a build requirement) on ``PROTO``, writing the
    generated modules beside it when they are missing or older than it."""
    proto = ROOT / PROTO
    outputs = [proto.with_name("feeder_pb2.py"), proto.with_name("feeder_pb2_grpc.py")]
    if all(p.exists() and p.stat().st_mtime >= proto.stat().st_mtime for p in outputs):
        return
    from grpc_tools import protoc  # build-time only

    args = ["protoc", f"-I{ROOT}", f"--python_out={ROOT}", f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}", str(proto)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed to compile {proto}")


class BuildWithProtos(build_py):
    """``build_py`` that generates the protobuf modules first."""

    def run(self) -> None:
        generate_protos()
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
