#!/usr/bin/env bash
# The GPU check, in one run on a machine with CUDA (python3 and PYTHONPATH; no make, no venv):
#   unpack   the carried packages (--site-parts DIR: bench/gpu_pack.sh's parts) into $SITE,
#            and the carried native libraries (the CPU window decoder, the C resize) into
#            the tree, with the JPEG library they link on LD_LIBRARY_PATH; a rerun on the
#            same machine without --site-parts uses what an earlier run unpacked there,
#   machine  the card (its name and kind, H200 or H100, printed), versions, nvidia-smi,
#            whether the native decoder loads, whether NVML reads the JPEG engines,
#   protoc   the generated protobuf modules, where missing or older than the .proto,
#   data     the sample data, made once under $BENCH_CACHE by one process per core and
#            sized to the machine (50 training images a class per core, 100 to 800),
#   throughput-224
#            bench/throughput.py --device gpu: the daemon (a FeederLoader rank on GPU 0,
#            batches over CUDA IPC) beside the in-process loader, images/s per GPU,
#   train    bench/train.py: the ResNet-50 trainer's step fed by three daemons (GPU decode
#            with its tuned CPU share, GPU only, CPU only with the native decoder) against
#            the same step on synthetic data, at 224 then 128 px, over steady windows (a
#            warm-up per daemon, then 3 interleaved rounds of settle steps and a timed
#            window each; no validation or checkpoint inside; a daemon's stream dropped
#            after its window, so what it made ahead is never counted); beside the step
#            times the device's idle share and the JPEG engines' utilisation (NVML),
#   gpu-tests  every `gpu`-marked test, 45 s each at most (the CUDA IPC ring's leak
#            test and the 50 streams whose memory must stay flat among them),
# then the summary (bench/gpu_summary.py), the only thing printed on the screen. Every
# figure it compares is measured in this run, on this card.
#
# Budget: BUDGET_S (300) seconds in all, unpacking included. Each step has its own limit;
# the limits add up to the budget less the summary's 15 s and a 10 s margin (the tests
# get what the others leave), so no step is skipped for time. At its limit the step's
# whole process group gets SIGTERM, 5 s later SIGKILL, and then every process the step
# started, whatever its session (it carries FEEDER_CHECK_RUN in its environment), is
# killed: nothing of one step runs on into the next. The measuring steps write their
# JSON as they go, so a step cut short keeps what it finished.
#
# Output: at most 8 files in $OUT (./gpu-out): logs.txt (every step's output),
# gpu-tests.xml, train.json, throughput-224.json, summary.txt, summary.json.
#
# --rehearse: the same steps, limits, budget, packing and clean-up on the CPU (--device
# cpu, the shared-memory daemon, a small trainer on a small sample, short windows, sample
# data made afresh), so the script itself is tested on any machine
# (tests/bench/test_gpu_check.py).
#
# Settings (environment): OUT, PYTHON (python3), SITE (/tmp/site), BUDGET_S, THREADS, BATCH,
# WINDOW_S / WARMUP_S / REPEATS (the throughput windows), BENCH_CACHE (the sample data),
# TRAIN_IMAGES_PER_CLASS, ARCH, TRAIN_SIZES, TRAIN_BATCH, TRAIN_WINDOW / TRAIN_SETTLE /
# TRAIN_WARMUP / TRAIN_REPEATS (the trainer's windows, in steps).
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
CORES=$(nproc 2>/dev/null || echo 1)
if [ "$REHEARSE" = 1 ]; then
  MODE=rehearsal DEVICE=cpu DAEMON=feeder-shm
  BUDGET_S=${BUDGET_S:-300} THREADS=${THREADS:-2} BATCH=${BATCH:-32}
  WINDOW_S=${WINDOW_S:-1} WARMUP_S=${WARMUP_S:-0.5} REPEATS=${REPEATS:-1}
  TRAIN_IMAGES_PER_CLASS=${TRAIN_IMAGES_PER_CLASS:-8} ARCH=${ARCH:-resnet18} TRAIN_SIZES=${TRAIN_SIZES:-32,24}
  TRAIN_BATCH=${TRAIN_BATCH:-8} TRAIN_WINDOW=${TRAIN_WINDOW:-6} TRAIN_SETTLE=${TRAIN_SETTLE:-2}
  TRAIN_WARMUP=${TRAIN_WARMUP:-2} TRAIN_REPEATS=${TRAIN_REPEATS:-2}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # a small model on two busy cores: one thread waits least
  VARIANTS=(--variant "split=" --variant "cpu=--device cpu")  # the GPU's third (GPU only) is the first here
else
  MODE=gpu DEVICE=gpu DAEMON=feeder-cuda-ipc
  BUDGET_S=${BUDGET_S:-300} THREADS=${THREADS:-12} BATCH=${BATCH:-256}
  WINDOW_S=${WINDOW_S:-3} WARMUP_S=${WARMUP_S:-2} REPEATS=${REPEATS:-2}  # the split share settles in the warm-up
  PER_CLASS=$((CORES * 50)); [ "$PER_CLASS" -gt 800 ] && PER_CLASS=800; [ "$PER_CLASS" -lt 100 ] && PER_CLASS=100
  TRAIN_IMAGES_PER_CLASS=${TRAIN_IMAGES_PER_CLASS:-$PER_CLASS} ARCH=${ARCH:-resnet50} TRAIN_SIZES=${TRAIN_SIZES:-224,128}
  TRAIN_BATCH=${TRAIN_BATCH:-256} TRAIN_WINDOW=${TRAIN_WINDOW:-16} TRAIN_SETTLE=${TRAIN_SETTLE:-6}
  TRAIN_WARMUP=${TRAIN_WARMUP:-64} TRAIN_REPEATS=${TRAIN_REPEATS:-3}
  VARIANTS=(--variant "split=" --variant "gpu-only=--cpu-decode-share 0" --variant "cpu=--device cpu")
fi
WINDOWS=(--seconds "$WINDOW_S" --warmup "$WARMUP_S" --repeats "$REPEATS")
MIN_STEP_S=10
KILL_AFTER_S=5                    # from SIGTERM to SIGKILL at a step's limit
SUMMARY_S=15                      # kept back for the summary
MARGIN_S=10                       # kept back beside it
# Each step's limit, s, in the order they run (bench/README.md's device-time plan); the
# tests get what the others leave of the budget, so the limits add up to it.
ORDER=(unpack machine protoc data throughput-224 train gpu-tests)
declare -A LIMIT=([unpack]=25 [machine]=20 [protoc]=10 [data]=25 [throughput-224]=45 [train]=90)
FIXED_S=0; for name in "${!LIMIT[@]}"; do FIXED_S=$((FIXED_S + LIMIT[$name])); done
LIMIT[gpu-tests]=$((BUDGET_S - SUMMARY_S - MARGIN_S - FIXED_S))
[ "${LIMIT[gpu-tests]}" -ge "$MIN_STEP_S" ] || LIMIT[gpu-tests]=$MIN_STEP_S  # a smaller budget: cut as it goes
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

note "feeder GPU check ($MODE) in $PWD: budget ${BUDGET_S} s, $CORES cores, $THREADS CPU threads, batch $BATCH, out $OUT"
note "step limits (s): $(for name in "${ORDER[@]}"; do printf '%s %s, ' "$name" "${LIMIT[$name]}"; done)summary $SUMMARY_S, margin $MARGIN_S"

# The carried packages: from the parts given, else from an earlier run's unpacking on
# this machine (a rerun), so a rerun keeps DALI, the native decoder and the resize.
if [ -n "$PARTS" ]; then
  # The parts are one xz-compressed tar split in pieces; python3 unpacks it (no xz needed).
  # A stamp of the parts' names and sizes: the same parts already unpacked are not again.
  UNPACK='
stamp=$(cd "$1" && ls -l part-* | awk "{ print \$5, \$NF }")
if [ -f "$4/.parts" ] && [ "$(cat "$4/.parts")" = "$stamp" ]; then echo "$4 holds these parts already"; exit 0; fi
cat "$1"/part-* | "$2" -c "$3" "$4" && echo "$stamp" >"$4/.parts" && ls "$4"'
  UNPACK_PY='
import sys, tarfile
with tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz") as pack:
    pack.extractall(sys.argv[1], filter="data")
'
  step unpack "${LIMIT[unpack]}" bash -c "$UNPACK" _ "$PARTS" "$PYTHON" "$UNPACK_PY" "$SITE"
elif [ -d "$SITE/feeder-native" ]; then
  note "no --site-parts: using $SITE as an earlier run unpacked it"
elif [ "$MODE" = gpu ]; then
  note "no --site-parts and nothing unpacked in $SITE: no DALI, no native decoder (the machine step says so)"
fi
if [ -d "$SITE" ]; then
  export PYTHONPATH="$SITE:$PYTHONPATH"
  # The native libraries (plain C, loaded with ctypes: no Python ABI), built by gpu_pack.sh
  # under this Python's suffix, and the JPEG library they link, which the machine may lack.
  # The tree is a fresh copy at every call: they are copied into it every run.
  if [ -d "$SITE/feeder-native" ]; then
    cp "$SITE"/feeder-native/shards/*.so shards/ 2>>"$LOG"
    cp "$SITE"/feeder-native/decode/*.so decode/ 2>>"$LOG"
    export LD_LIBRARY_PATH="$SITE/feeder-native/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi

step machine "${LIMIT[machine]}" "$PYTHON" -m bench.gpu_machine --json "$WORK/machine.json"

# Generated protobuf modules are not in the tree: make them (or remake a stale one).
if [ ! -f protos/feeder_pb2.py ] || [ protos/feeder.proto -nt protos/feeder_pb2.py ]; then
  step protoc "${LIMIT[protoc]}" "$PYTHON" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
    protos/feeder.proto
fi

# One sample for both measuring steps, made by one process per core.
step data "${LIMIT[data]}" "$PYTHON" -c "from pathlib import Path; from bench.data import prepare_sample
print(prepare_sample(Path('$CACHE'), train_per_class=$TRAIN_IMAGES_PER_CLASS, workers=$CORES))"
SAMPLE=(--cache "$CACHE" --images-per-class "$TRAIN_IMAGES_PER_CLASS")

# The one figure comparable with the first run's (an H200's): first, before the trainer.
step throughput-224 "${LIMIT[throughput-224]}" "$PYTHON" bench/throughput.py --device "$DEVICE" \
  --loaders "$DAEMON,inprocess" --image-size 224 --batch-size "$BATCH" --threads "$THREADS" "${WINDOWS[@]}" \
  "${SAMPLE[@]}" --json "$OUT/throughput-224.json"

# The trainer's step fed by each daemon against the same step on synthetic data, one rank.
step train "${LIMIT[train]}" "$PYTHON" bench/train.py --arch "$ARCH" --sizes "$TRAIN_SIZES" \
  --batch-size "$TRAIN_BATCH" --nproc 1 --window-steps "$TRAIN_WINDOW" --settle-steps "$TRAIN_SETTLE" \
  --warmup-steps "$TRAIN_WARMUP" --repeats "$TRAIN_REPEATS" --skip-accuracy "${SAMPLE[@]}" \
  --daemon-device "$DEVICE" --threads "$THREADS" "${VARIANTS[@]}" --json "$OUT/train.json"

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
step gpu-tests "${LIMIT[gpu-tests]}" "$PYTHON" -m pytest -m gpu -v -p no:cacheprovider -o addopts="" \
  --strict-markers -rfEs "${PER_TEST[@]}" --durations 15 --junitxml "$OUT/gpu-tests.xml" \
  --continue-on-collection-errors "${GPU_TESTS[@]}"
