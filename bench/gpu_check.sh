#!/usr/bin/env bash
# The GPU check, in one run on a machine with CUDA (python3 and PYTHONPATH; no make, no venv):
#   unpack   the carried packages (--site-parts DIR: bench/gpu_pack.sh's parts) into $SITE,
#            and the carried native libraries (the CPU window decoder, the C resize) into
#            the tree, with the JPEG library they link on LD_LIBRARY_PATH,
#   machine  versions, devices, nvidia-smi, whether the native decoder loads,
#   protoc   the generated protobuf modules, where missing or older than the .proto,
#   data     the sample data (made once under $BENCH_CACHE): 8,000 training images,
#   gpu-tests  every `gpu`-marked test, 45 s each at most (the CUDA IPC ring's leak
#            test and the 50 streams whose memory must stay flat among them),
#   train    bench/train.py: the ResNet-50 trainer fed by the daemon against the same
#            trainer on synthetic data, whole epochs at 224 and 128 px, for three
#            daemons: GPU decode with its tuned CPU share, GPU only, CPU only (the
#            native decoder); the device's idle share between steps, and the projected
#            8-GPU imagenet-fastai time (a rehearsal: two daemons, a small ResNet),
#   throughput-224
#            bench/throughput.py --device gpu: the daemon (a FeederLoader rank on GPU 0,
#            batches over CUDA IPC) beside the in-process loader, images/s per GPU,
# then the summary (bench/gpu_summary.py), the only thing printed on the screen.
#
# Budget: BUDGET_S (300) seconds in all, unpacking included. Each step has its own limit,
# cut to what is left of the budget (a step with under 10 s left is skipped); at its
# limit the step's whole process group gets SIGTERM, 5 s later SIGKILL, and then every
# process the step started, whatever its session (it carries FEEDER_CHECK_RUN in its
# environment), is killed: nothing of one step runs on into the next. The steps go in
# the order of what matters most if time runs short.
#
# Output: at most 8 files in $OUT (./gpu-out): logs.txt (every step's output),
# gpu-tests.xml, train.json, throughput-224.json, summary.txt, summary.json.
#
# --rehearse: the same steps, limits, packing and clean-up on the CPU (--device cpu,
# the shared-memory daemon, a small trainer on a small sample, short windows, sample
# data made afresh, a 240 s budget), so the script itself is tested on any machine
# (tests/bench/test_gpu_check.py).
#
# Settings (environment): OUT, PYTHON (python3), SITE (/tmp/site), BUDGET_S, THREADS, BATCH,
# WINDOW_S / WARMUP_S / REPEATS (the measured windows), BENCH_CACHE (the sample data),
# TRAIN_IMAGES_PER_CLASS, ARCH, TRAIN_SIZES, TRAIN_BATCH.
#
# Usage (repository root):
#   PYTHONPATH=/tmp/site bash bench/gpu_check.sh [--site-parts DIR]
#   PYTHON=.venv/bin/python bash bench/gpu_check.sh --rehearse
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

REHEARSE=0
PARTS=""
while [ $# -gt 0 ]; do
  case $1 in
    --rehearse) REHEARSE=1 ;;
    --site-parts) PARTS=${2:?--site-parts needs a folder}; shift ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

OUT=${OUT:-./gpu-out}
PYTHON=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
if [ "$REHEARSE" = 1 ]; then
  MODE=rehearsal DEVICE=cpu DAEMON=feeder-shm
  BUDGET_S=${BUDGET_S:-240} THREADS=${THREADS:-2} BATCH=${BATCH:-32}
  WINDOW_S=${WINDOW_S:-1} WARMUP_S=${WARMUP_S:-0.5} REPEATS=${REPEATS:-1}
  TRAIN_IMAGES_PER_CLASS=${TRAIN_IMAGES_PER_CLASS:-8} ARCH=${ARCH:-resnet18} TRAIN_SIZES=${TRAIN_SIZES:-32,24}
  TRAIN_BATCH=${TRAIN_BATCH:-8}
  VARIANTS=(--variant "split=" --variant "cpu=--device cpu")  # the GPU's third (GPU only) is the first here
else
  MODE=gpu DEVICE=gpu DAEMON=feeder-cuda-ipc
  BUDGET_S=${BUDGET_S:-300} THREADS=${THREADS:-12} BATCH=${BATCH:-256}
  WINDOW_S=${WINDOW_S:-3} WARMUP_S=${WARMUP_S:-1} REPEATS=${REPEATS:-2}
  TRAIN_IMAGES_PER_CLASS=${TRAIN_IMAGES_PER_CLASS:-800} ARCH=${ARCH:-resnet50} TRAIN_SIZES=${TRAIN_SIZES:-224,128}
  TRAIN_BATCH=${TRAIN_BATCH:-256}
  VARIANTS=(--variant "split=" --variant "gpu-only=--cpu-decode-share 0" --variant "cpu=--device cpu")
fi
WINDOWS=(--seconds "$WINDOW_S" --warmup "$WARMUP_S" --repeats "$REPEATS")
MIN_STEP_S=10
KILL_AFTER_S=5                    # from SIGTERM to SIGKILL at a step's limit
SUMMARY_S=15                      # kept back for the summary
START=$SECONDS
DEADLINE=$((START + BUDGET_S - SUMMARY_S))
RUN_ID="gpu-check-$$-$RANDOM"     # in the environment of everything a step starts
INTERRUPTED=0
WORK=$(mktemp -d "${TMPDIR:-/tmp}/feeder-gpu-check.XXXXXX")
if [ -n "${BENCH_CACHE:-}" ]; then CACHE=$BENCH_CACHE    # sample data: made here, not sent back
elif [ "$REHEARSE" = 1 ]; then CACHE=$WORK/bench          # made afresh: part of what is rehearsed
else CACHE=/tmp/feeder-bench; fi
mkdir -p "$OUT"
rm -f "$OUT"/{logs.txt,summary.txt,summary.json,gpu-tests.xml,throughput-224.json,train.json}
LOG=$OUT/logs.txt
: >"$WORK/steps.tsv"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
HAVE_SMI=0; command -v nvidia-smi >/dev/null 2>&1 && HAVE_SMI=1
SAMPLER=""
CURRENT="" CURRENT_START=0 CURRENT_LIMIT=0   # the step running now

note() { printf '%s\n' "$*" >>"$LOG"; }

# sample_gpu NAME: GPU memory in use now, then every 0.5 s until stop_sampling.
sample_gpu() {
  [ "$HAVE_SMI" = 1 ] || return 0
  local query=(nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits)
  timeout 10 "${query[@]}" >"$WORK/gpumem-$1.base" 2>/dev/null
  "${query[@]}" -lms 500 >"$WORK/gpumem-$1.csv" 2>/dev/null &
  SAMPLER=$!
}
stop_sampling() {
  [ -n "$SAMPLER" ] || return 0
  kill "$SAMPLER" 2>/dev/null; wait "$SAMPLER" 2>/dev/null; SAMPLER=""
}

# sweep: kills what any step left running (new sessions included); prints what it killed.
sweep() { "$PYTHON" -m bench.proctree --kill "FEEDER_CHECK_RUN=$RUN_ID" 2>&1 | tr '\n' ' '; }

# step NAME LIMIT_S COMMAND...: runs COMMAND under its limit, output appended to logs.txt.
step() {
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS)) started=$SECONDS rc status left_behind
  if [ "$left" -lt "$MIN_STEP_S" ]; then
    note "===== $name: skipped, ${left} s of the budget left"
    printf '%s\tskipped (budget)\t0\t0\t%s\t\n' "$name" "$limit" >>"$WORK/steps.tsv"
    return 0
  fi
  if [ "$limit" -gt $((left - KILL_AFTER_S)) ]; then limit=$((left - KILL_AFTER_S)); fi
  note "===== $name (limit ${limit} s, $((SECONDS - START)) s into the run): $*"
  CURRENT=$name CURRENT_START=$SECONDS CURRENT_LIMIT=$limit
  case $name in throughput-*|train) sample_gpu "$name" ;; esac
  # timeout leads a process group of its own and signals all of it at the limit. In the
  # background, so that a signal to this script is handled at once (finish sweeps it).
  FEEDER_CHECK_RUN=$RUN_ID timeout --signal=TERM --kill-after="$KILL_AFTER_S" "$limit" "$@" >>"$LOG" 2>&1 </dev/null &
  wait $!
  rc=$?
  stop_sampling
  left_behind=$(sweep)
  case $rc in
    0) status=ok ;;
    124|137) status="killed at its limit" ;;
    *) status="exit $rc" ;;
  esac
  note "===== $name: $status after $((SECONDS - started)) s${left_behind:+; $left_behind}"
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - started))" "$limit" \
    "$left_behind" >>"$WORK/steps.tsv"
  CURRENT=""
  return 0
}

interrupted() {
  note "===== interrupted${CURRENT:+ during $CURRENT}"
  [ -z "$CURRENT" ] || printf '%s\tinterrupted\t143\t%s\t%s\t\n' "$CURRENT" "$((SECONDS - CURRENT_START))" \
    "$CURRENT_LIMIT" >>"$WORK/steps.tsv"
  INTERRUPTED=143
  exit 143
}

finish() {
  trap - EXIT TERM INT
  exec 2>>"$LOG"  # the shell's own notes (a step killed meanwhile) go to the log, not the screen
  stop_sampling
  local left_behind summary_rc=1
  left_behind=$(sweep)
  [ -z "$left_behind" ] || note "===== at the end: $left_behind"
  FEEDER_CHECK_RUN=$RUN_ID timeout -s KILL "$SUMMARY_S" "$PYTHON" -m bench.gpu_summary --out "$OUT" \
    --work "$WORK" --mode "$MODE" --budget-s "$BUDGET_S" 2>>"$LOG" && summary_rc=0
  if [ ! -s "$OUT/summary.txt" ]; then  # the summary itself failed: the steps at least
    { echo "== feeder GPU check ($MODE): no summary (see logs.txt); steps:"; cat "$WORK/steps.tsv"; } |
      tee "$OUT/summary.txt"
  fi
  rm -rf "$WORK"
  [ "$INTERRUPTED" -ne 0 ] && exit "$INTERRUPTED"
  exit "$summary_rc"
}
trap finish EXIT
trap interrupted TERM INT

note "feeder GPU check ($MODE) in $PWD: budget ${BUDGET_S} s, $THREADS CPU threads, batch $BATCH, out $OUT"

if [ -n "$PARTS" ]; then
  # The parts are one xz-compressed tar split in pieces; python3 unpacks it (no xz needed).
  UNPACK_PY='
import sys, tarfile
with tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz") as pack:
    pack.extractall(sys.argv[1], filter="data")
'
  step unpack 45 bash -c 'cat "$1"/part-* | "$2" -c "$3" "$4" && ls "$4"' _ "$PARTS" "$PYTHON" "$UNPACK_PY" "$SITE"
  export PYTHONPATH="$SITE:$PYTHONPATH"
  # The native libraries (plain C, loaded with ctypes: no Python ABI), built by gpu_pack.sh
  # under this Python's suffix, and the JPEG library they link, which the machine may lack.
  if [ -d "$SITE/feeder-native" ]; then
    cp "$SITE"/feeder-native/shards/*.so shards/ 2>>"$LOG"
    cp "$SITE"/feeder-native/decode/*.so decode/ 2>>"$LOG"
    export LD_LIBRARY_PATH="$SITE/feeder-native/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi

MACHINE_PY='
import importlib, shutil, subprocess, sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name} {p.total_memory >> 30} GiB uuid GPU-{p.uuid}")
for name in ("nvidia.dali", "grpc", "google.protobuf", "pytest_timeout"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), "from", getattr(module, "__file__", "?"))
    except ImportError as e:
        print(name, "missing:", e)
try:
    from nvidia.dali import backend
    print("DALI sees", backend.GetCUDADeviceCount(), "CUDA devices")
except ImportError as e:
    print("no DALI:", e)
from shards import jpeg
from decode import resize
print("window decoder:", jpeg.unavailable_reason() or "loads", "| C resize:",
      resize.native_unavailable_reason() or "loads")
if shutil.which("nvidia-smi"):
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout)
'
step machine 30 "$PYTHON" -c "$MACHINE_PY"

# Generated protobuf modules are not in the tree: make them (or remake a stale one).
if [ ! -f protos/feeder_pb2.py ] || [ protos/feeder.proto -nt protos/feeder_pb2.py ]; then
  step protoc 30 "$PYTHON" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. protos/feeder.proto
fi

TRAIN_CACHE=$CACHE
step data 90 "$PYTHON" -c "from pathlib import Path; from bench.data import prepare_sample
print(prepare_sample(Path('$CACHE')))
print(prepare_sample(Path('$TRAIN_CACHE'), train_per_class=$TRAIN_IMAGES_PER_CLASS))"

# Every gpu-marked test (only the files that hold some: the others may need packages
# this machine lacks). pytest-timeout (carried) stops a test at 45 s; without it, a
# hanging test's stack is printed at 40 s and the step's limit ends it.
mapfile -t GPU_TESTS < <(grep -rlE 'mark\.gpu' tests --include='test_*.py' | sort)
PER_TEST=(--timeout 45)
if ! "$PYTHON" -c 'import pytest_timeout' 2>/dev/null; then
  PER_TEST=(-o faulthandler_timeout=40); note "no pytest-timeout here: no per-test limit"
elif [ -n "${PYTEST_DISABLE_PLUGIN_AUTOLOAD:-}" ]; then
  PER_TEST=(-p pytest_timeout --timeout 45)
fi
step gpu-tests 90 "$PYTHON" -m pytest -m gpu -v -p no:cacheprovider -o addopts="" --strict-markers -rfEs \
  "${PER_TEST[@]}" --durations 15 --junitxml "$OUT/gpu-tests.xml" --continue-on-collection-errors "${GPU_TESTS[@]}"

# The trainer fed by three daemons against the same trainer on synthetic data: whole
# epochs (the first of each size a warm-up), validation every epoch, one rank.
step train 130 "$PYTHON" bench/train.py --arch "$ARCH" --sizes "$TRAIN_SIZES" --batch-size "$TRAIN_BATCH" \
  --nproc 1 --epochs-per-size 2 --repeats 1 --skip-accuracy --cache "$TRAIN_CACHE" \
  --images-per-class "$TRAIN_IMAGES_PER_CLASS" --daemon-device "$DEVICE" --threads "$THREADS" \
  "${VARIANTS[@]}" --json "$OUT/train.json"

step throughput-224 60 "$PYTHON" bench/throughput.py --device "$DEVICE" --loaders "$DAEMON,inprocess" \
  --image-size 224 --batch-size "$BATCH" --threads "$THREADS" "${WINDOWS[@]}" --cache "$CACHE" \
  --json "$OUT/throughput-224.json"
