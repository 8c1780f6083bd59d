#!/usr/bin/env bash
# make test-under-load: make test RUNS times in a row (default 3) in a fresh clone of
# this checkout's HEAD (its first run installs), while HOGS CPU-bound processes (default
# 2) run beside it, as on a busy CI machine; HOGS=0 is the quiet machine. Prints each
# run's time and status; exits 1 if any run failed. The runs' logs stay in the folder it
# names; the clone (its 7 GB venv) is removed at the end.
set -uo pipefail
runs=${RUNS:-3}
hog_count=${HOGS:-2}
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/feeder-under-load.XXXXXX)
hogs=()
cleanup() {
  [ ${#hogs[@]} -gt 0 ] && kill "${hogs[@]}" 2>/dev/null
  rm -rf "$work/feeder"
}
trap cleanup EXIT
git clone -q "$here" "$work/feeder" || exit 1
echo "make test $runs times in a fresh clone of $(git -C "$work/feeder" rev-parse --short HEAD)" \
     "beside $hog_count CPU-bound processes on $(nproc) CPUs; logs in $work"
for _ in $(seq 1 "$hog_count"); do
  python3 -c "while 1: pass" &
  hogs+=($!)
done
failed=0
for run in $(seq 1 "$runs"); do
  started=$(date +%s)
  if make -C "$work/feeder" test > "$work/run-$run.log" 2>&1; then status=passed; else status=FAILED; failed=1; fi
  echo "run $run of $runs: $status in $(( $(date +%s) - started )) s (log: $work/run-$run.log)"
  grep -E "^(FAILED|ERROR) |^make.*Error" "$work/run-$run.log" | head -20
done
exit $failed
