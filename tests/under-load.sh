#!/usr/bin/env bash
# make test-under-load: make test RUNS times in a row (default 3) in a fresh clone of
# this checkout's HEAD, while two CPU-bound processes run beside it, as on a busy CI
# machine. Prints each run's time and status; exits 1 if any run failed.
set -uo pipefail
runs=${RUNS:-3}
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/feeder-under-load.XXXXXX)
git clone -q "$here" "$work/feeder"
python3 -c "while 1: pass" & hog1=$!
python3 -c "while 1: pass" & hog2=$!
trap 'kill $hog1 $hog2 2>/dev/null' EXIT
failed=0
for run in $(seq 1 "$runs"); do
  started=$(date +%s)
  if make -C "$work/feeder" test > "$work/run-$run.log" 2>&1; then status=passed; else status=FAILED; failed=1; fi
  echo "run $run of $runs: $status in $(( $(date +%s) - started )) s (log: $work/run-$run.log)"
  grep -E "^(FAILED|ERROR) " "$work/run-$run.log" | head -20
done
exit $failed
