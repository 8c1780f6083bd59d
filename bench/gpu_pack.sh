#!/usr/bin/env bash
# Packs what the occasional GPU machine lacks into at most 3 parts of 56 MiB, each small
# enough to travel with one command (64 MiB per command, working tree included), for
# `bench/gpu_check.sh --site-parts DIR` to unpack.
#
# The GPU machine has Python 3.12 with torch, grpcio, protobuf, numpy, pytest and most
# common packages, and no NVIDIA DALI, webdataset, lmdb, grpcio-tools or pytest-timeout;
# nothing can be downloaded there. The wheels below are installed here for Python 3.12
# into one tree (grpcio and protobuf too, so generated code and runtime match), what is
# only loaded on demand and never used by the check is left out, and the tree is
# xz-compressed and split:
#   - DALI's and nvImageCodec's modules for other Pythons than 3.12, and headers;
#   - nvImageCodec's codec extensions but nvJPEG's and libjpeg-turbo's (it loads every
#     extension it finds, each on its own; JPEG 2000, TIFF, BMP, PNM and OpenCV never
#     decode the shards' JPEGs), hence no nvjpeg2k;
#   - nvCOMP (DALI opens it only for its inflate operator).
# DALI's own libraries are all linked to each other (DT_NEEDED) and stay.
# Beside them, under feeder-native/, the project's two C libraries (the CPU window decoder
# and the C resize: plain C loaded with ctypes, no Python ABI, glibc 2.14 symbols at most),
# built here and named for Python 3.12, and the libjpeg-turbo they link, which the machine
# may lack: the check copies them into its tree, so its CPU decode is the real one.
#
# Usage (repository root, with pip and xz):  bash bench/gpu_pack.sh [OUT_DIR]   (.gpu-parts)
# Then, back to back (the machine goes back after ~30 s idle, and the parts sent with it),
# the commands it prints.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
OUT=${1:-.gpu-parts}
MAX_PARTS=3
PART_BYTES=$((56 << 20))
PYTHON=${PYTHON:-python3}
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
PKGS=(
  nvidia-dali-cuda130==2.4.0 "nvidia-nvimgcodec-cu13>=0.9,<0.10" nvidia-nvjpeg
  astunparse gast optree makefun "libcst~=1.8" nvtx six
  webdataset braceexpand lmdb grpcio grpcio-tools grpcio-health-checking grpcio-reflection protobuf
  pytest-timeout
)
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT

"$PYTHON" -m pip download -q --no-deps "${PLAT[@]}" -d "$W/wheels" "${PKGS[@]}"
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$W/site" "${PLAT[@]}" "$W"/wheels/*.whl
site=$W/site
find "$site/nvidia/dali" "$site/nvidia/nvimgcodec" -name '*.cpython-3*.so' ! -name '*.cpython-312-*' -delete
rm -rf "$site/nvidia/dali/include" "$site/nvidia/nvimgcodec/include" "$site/nvidia/cu13/include" "$site/bin"
find "$site/nvidia/nvimgcodec/extensions" -type f ! -name 'libnvjpeg_ext.so*' ! -name 'libjpeg_turbo_ext.so*' -delete
BUILD_PYTHON=${BUILD_PYTHON:-.venv/bin/python}  # any Python with setuptools: the libraries use no Python API
"$BUILD_PYTHON" setup.py --quiet build_ext --build-lib "$W/native" --build-temp "$W/native-tmp" >/dev/null
native=$site/feeder-native
mkdir -p "$native/shards" "$native/decode" "$native/lib"
for built in "$W"/native/shards/_jpeg.*.so "$W"/native/decode/_resize.*.so; do
  stem=$(basename "$built" | cut -d. -f1)
  cp "$built" "$native/$(basename "$(dirname "$built")")/$stem.cpython-312-x86_64-linux-gnu.so"
done
jpeg_lib=$(ldd "$W"/native/shards/_jpeg.*.so | awk '/libjpeg/ { print $3 }')
cp -L "$jpeg_lib" "$native/lib/$(basename "$jpeg_lib")"
echo "installed for Python 3.12: $(du -sh "$site" | cut -f1) in $(find "$site" -type f | wc -l) files"

rm -rf "$OUT" && mkdir -p "$OUT"
tar -C "$site" -cf - . | xz -T0 -6 | split -b "$PART_BYTES" - "$OUT/part-"
parts=("$OUT"/part-*)
echo "packed: $(du -ch "${parts[@]}" | tail -1 | cut -f1) in ${#parts[@]} part(s) of at most 56 MiB under $OUT/"
if [ "${#parts[@]}" -gt "$MAX_PARTS" ]; then
  echo "gpu_pack: ${#parts[@]} parts, more than $MAX_PARTS: leave more out" >&2
  exit 1
fi

echo
echo "Commands for the GPU machine, an H200 (the first run's absolute figure is an H200's), back to back"
echo "(each within ~30 s of the last):"
n=${#parts[@]}
for i in "${!parts[@]}"; do
  p=${parts[$i]}
  if [ "$i" -lt $((n - 1)) ]; then
    echo "  run kind=\"nvidia-h200\" carry=[\"$p\"] command: mkdir -p /tmp/wh && cp $p /tmp/wh/"
  else
    echo "  run kind=\"nvidia-h200\" carry=[\"$p\"] timeout_s=330 command: mkdir -p /tmp/wh && cp $p /tmp/wh/ \\"
    echo "      && bash bench/gpu_check.sh --site-parts /tmp/wh"
  fi
done
echo "A rerun on the same warm machine: run timeout_s=330 command: bash bench/gpu_check.sh --site-parts /tmp/wh"
