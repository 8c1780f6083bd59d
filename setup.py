"""Build steps of the feeder distribution; everything else is in ``pyproject.toml``.

- Generate the protobuf modules from ``protos/feeder.proto`` before the packages are
  collected, so wheels and ``pip install .`` ship ``protos/feeder_pb2.py`` and
  ``feeder_pb2_grpc.py`` and need no protobuf compiler at run time.
- Build ``shards/_jpeg.c`` (JPEG window decoding and lossless restart markers, a plain C
  library loaded with ctypes) against the system's libjpeg-turbo. Optional: without
  a C compiler or libjpeg-turbo's headers the install goes on and the pipeline decodes
  with DALI (``shards.jpeg.unavailable_reason()`` says why).
- Build ``decode/_resize.c`` (bilinear resizes of a list of windows in one call, also
  loaded with ctypes). Optional too: without it the CPU resize is OpenCV's, one call
  per image (``decode.resize.native_unavailable_reason()`` says why).
"""

from __future__ import annotations

from pathlib import Path

from setuptools import Extension, setup
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


JPEG_LIBRARY = Extension(
    "shards._jpeg",
    sources=["shards/_jpeg.c"],
    libraries=["jpeg"],
    extra_compile_args=["-O2"],
    optional=True,
)

RESIZE_LIBRARY = Extension(
    "decode._resize",
    sources=["decode/_resize.c"],
    libraries=["m"],
    extra_compile_args=["-O2"],
    optional=True,
)

setup(cmdclass={"build_py": BuildWithProtos}, ext_modules=[JPEG_LIBRARY, RESIZE_LIBRARY])
