#!/usr/bin/env bash
# The GPU check, in one run on a machine with CUDA (no make, no venv):
#   (a) nvidia-smi and the versions in use,
#   (b) every `gpu`-marked test,
#   (c) bench/throughput.py --device gpu: the daemon (FeederLoader on cuda:0, batches
#       over CUDA IPC) vs the in-process loader, at 224 px and at 128 px, images/s per GPU,
#   (d) the daemon's pipeline alone (bench/pipeline.py) at 224 px.
# Everything lands in $OUT (default ./gpu-out): logs and JSON. The whole run keeps to
# a budget of BUDGET_S seconds (default 420, well inside 8 minutes): each step gets
# its own limit, cut to what is left, and a step with under 15 s left is skipped.
#
# Usage (repository root, python3 with torch, DALI and grpcio-tools importable):
#   PYTHONPATH=/tmp/site:$PWD bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-out}
BUDGET_S=${BUDGET_S:-420}
CACHE=${BENCH_CACHE:-/tmp/feeder-bench}   # sample data: made here, not sent back
THREADS=${THREADS:-8}                      # CPU budget of each benchmarked loader
BATCH=${BATCH:-128}
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:-$PWD}"
DEADLINE=$((SECONDS + BUDGET_S))
FAILED=()

# step NAME LIMIT_S COMMAND...: runs COMMAND under timeout, output to $OUT/NAME.log and
# the terminal; records a failure without stopping the run.
step() {
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 15 ]; then
    echo "== $name: skipped, ${left} s of the budget left" | tee "$OUT/$name.log"
    FAILED+=("$name(skipped)"); return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit} s, $((SECONDS)) s in)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "== $name: exit $rc"; FAILED+=("$name(exit $rc)"); }
}

# (a) the machine
step nvidia-smi 20 nvidia-smi
step versions 60 python3 -c '
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name} {p.total_memory >> 30} GiB uuid GPU-{p.uuid}")
import nvidia.dali as dali, nvidia.dali.backend as b
print("dali", dali.__version__, "sees", b.GetCUDADeviceCount(), "devices")
'

# Generated protobuf modules are not in the tree: make them (or remake a stale one).
if [ ! -f protos/feeder_pb2.py ] || [ protos/feeder.proto -nt protos/feeder_pb2.py ]; then
  step protoc 60 python3 -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. protos/feeder.proto
fi

# The JPEG library of shards/ (CPU window decoder, restart markers), where this machine
# has a C compiler and libjpeg-turbo's headers; without it the CPU paths use DALI and
# the sample shards are written without restart markers (the GPU path needs neither).
if ! python3 -c 'import sys; from shards import jpeg; sys.exit(not jpeg.available())' 2>/dev/null; then
  step jpeg-library 60 bash -c 'python3 setup.py --quiet build_ext --inplace || echo "not built: the CPU paths use DALI"' 
fi

# (b) every gpu-marked test (only the files that hold some: the others may need
# packages this machine lacks).
mapfile -t GPU_TESTS < <(grep -rlE 'mark\.gpu' tests --include='test_*.py' | sort)
echo "gpu test files: ${GPU_TESTS[*]}"
step gpu-tests 170 python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" -rs \
  --continue-on-collection-errors "${GPU_TESTS[@]}"

# Sample data for the benchmarks (made once; ~10 s on 2 cores).
step bench-data 90 python3 -c "from pathlib import Path; from bench.data import prepare_sample; print(prepare_sample(Path('$CACHE')))"

# (c) the daemon vs the in-process loader: whichever names this tree's bench uses.
LOADERS=$(python3 -c '
from bench.loaders import LOADERS
daemon = next(n for n in ("feeder-shm", "feeder", "feeder-grpc") if n in LOADERS)
inproc = next(n for n in ("inprocess", "dali") if n in LOADERS)
print(f"{daemon},{inproc}")')
echo "loaders: $LOADERS"
for px in 224 128; do
  step "throughput-gpu-$px" 110 python3 bench/throughput.py --device gpu --loaders "$LOADERS" \
    --image-size "$px" --batch-size "$BATCH" --threads "$THREADS" --seconds 5 --warmup 3 --repeats 2 \
    --cache "$CACHE" --json "$OUT/throughput-gpu-$px.json"
done

# (d) the pipeline alone, on GPU 0, output device to device.
step pipeline-gpu-224 60 python3 bench/pipeline.py --device gpu --image-size 224 --batch-size "$BATCH" \
  --threads "$THREADS" --seconds 5 --warmup-s 3 --repeats 3 --cache "$CACHE" --json "$OUT/pipeline-gpu-224.json"

echo "== done in ${SECONDS} s; results in $OUT"
ls -l "$OUT"
if [ "${#FAILED[@]}" -gt 0 ]; then
  echo "== failed: ${FAILED[*]}"
  exit 1
fi
