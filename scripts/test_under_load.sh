#!/usr/bin/env bash
# The Python tests with every core busy: one CPU hog per core (a bounded busy loop at the
# tests' own priority), then pytest over python/tests RUNS times (default 3), each run's
# result counted. A test whose outcome depends on scheduling or on an unseeded draw shows up
# here long before it shows up in CI. Extra arguments go to pytest (-k NAME, a file, ...).
#
#   bash scripts/test_under_load.sh            # 3 runs of the whole suite under load
#   RUNS=10 bash scripts/test_under_load.sh python/tests/test_tcp.py
#
# Prints "under load: P of N runs passed" at the end; exits non-zero if any run failed. The
# hogs stop after HOG_SECONDS (default 3600) at the latest, and are ended by their PIDs when
# the runs are done.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
bash scripts/venv.sh .venv test
runs=${RUNS:-3}
cores=$(nproc)
hogs=()
stop_hogs() {
  for pid in "${hogs[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
}
trap stop_hogs EXIT
for _ in $(seq "$cores"); do
  timeout "${HOG_SECONDS:-3600}" python -c 'while True: pass' &
  hogs+=("$!")
done
echo ">> $cores CPU hogs running (PIDs ${hogs[*]}); pytest $runs times"
passed=0
for run in $(seq "$runs"); do
  echo ">> run $run of $runs"
  if python -m pytest python/tests -q -p no:cacheprovider "$@"; then
    passed=$((passed + 1))
  fi
done
echo ">> under load: $passed of $runs runs passed"
[[ $passed == "$runs" ]]
