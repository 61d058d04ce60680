#!/usr/bin/env bash
# Runs the core's unit tests (replay tables included), store tests, a small stress test, the
# replay table tests and the sum tree's property tests under valgrind memcheck. Fails on any memory error or definite leak.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
echo ">> valgrind memcheck: unit tests, store, stress (small count), replay and property tests"
cargo test --quiet --no-run --lib --test store --test stress_store --test prop_sumtree --test replay \
  --test prop_replay \
  2>/dev/null
# Valgrind runs a process's threads one at a time, on one core: two test binaries at a time
# (ECHO_VALGRIND_JOBS, default the number of cores) keep every core busy.
jobs=${ECHO_VALGRIND_JOBS:-$(nproc)}
declare -A running=() # PID -> "binary log"
trap 'for pid in "${!running[@]}"; do kill "$pid" 2>/dev/null; done; wait' EXIT
finish() { # waits for the next run to end; on a failure prints the end of its log and exits
  local pid rc=0
  wait -n -p pid "${!running[@]}" || rc=$?
  local bin log
  read -r bin log <<<"${running[$pid]}"
  unset "running[$pid]"
  # The test binary's output is in its log, target/valgrind-<name>.log; on a failure its end
  # is printed (exit 99: a memory error or a definite leak; another: a failing test, named there).
  if ((rc != 0)); then
    echo "   valgrind $bin FAILED (exit $rc); the end of $log:" >&2
    tail -n 60 "$log" >&2
    exit "$rc"
  fi
}
run() {
  local bin=$1
  shift
  while ((${#running[@]} >= jobs)); do
    finish
  done
  local log
  log=target/valgrind-$(basename "$bin" | sed 's/-[0-9a-f]*$//').log
  echo "   valgrind $bin"
  ECHO_STRESS_COUNT=2000 valgrind --quiet --error-exitcode=99 --leak-check=full \
    --errors-for-leak-kinds=definite --show-possibly-lost=no "$bin" --test-threads=2 -q "$@" \
    >"$log" 2>&1 &
  running[$!]="$bin $log"
}
latest() { # the newest test binary cargo built for $1 (not its .d file)
  local file newest=""
  for file in target/debug/deps/"$1"-*; do
    [[ $file != *.d && ( -z $newest || $file -nt $newest ) ]] && newest=$file
  done
  echo "$newest"
}
for name in echo store stress_store; do
  run "$(latest "$name")"
done
# Replay tables without the two chi-square tests (10^5 draws of the same paths the other
# tests take; a minute under valgrind).
run "$(latest replay)" --skip sampling_is_uniform --skip follows_priority_to_the_exponent
PROPTEST_CASES=32 run "$(latest prop_replay)"
# The sum tree's property tests: 16 cases instead of 256, and without the 1e6-draw frequency
# tests (pure arithmetic over the same code paths, about a minute under valgrind).
PROPTEST_CASES=16 run "$(latest prop_sumtree)" --skip frequencies
while ((${#running[@]} > 0)); do
  finish
done
echo "   valgrind: no errors"
