#!/usr/bin/env bash
# Fuzzes every parser of untrusted bytes (fuzz/fuzz_targets/, cargo-fuzz on the nightly
# toolchain, AddressSanitizer and debug assertions on) for a bounded time each: 60 s per
# target, or ECHO_FUZZ_SECONDS; ECHO_FUZZ_JOBS targets at a time (default: one per core). Arguments: the targets to run (default: all of them).
# Installs cargo-fuzz (pinned) if it is missing. Starts from the committed seeds in
# fuzz/corpus/<target>/ plus what earlier runs found, kept in fuzz/target/corpus/<target>/
# (ignored by git); so a run never dirties the checkout. Exits non-zero if any target finds
# a crash, a leak, a timeout or an out-of-memory: the input is in fuzz/artifacts/<target>/
# and the libFuzzer log in fuzz/target/logs/<target>.log (its tail is printed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CARGO_FUZZ_VERSION=0.13.2
seconds=${ECHO_FUZZ_SECONDS:-60}
if ! [[ $seconds =~ ^[1-9][0-9]*$ ]]; then
  echo "ECHO_FUZZ_SECONDS must be a positive number of seconds, got '$seconds'" >&2
  exit 2
fi
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  echo "fuzzing needs the nightly toolchain (rustup toolchain install nightly)" >&2
  exit 1
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo ">> installing cargo-fuzz $CARGO_FUZZ_VERSION"
  cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked --quiet
fi
if (($# > 0)); then
  targets=("$@")
else
  mapfile -t targets < <(cargo +nightly fuzz list)
fi
echo ">> building the fuzz targets (cargo +nightly fuzz build: release, ASan, debug assertions)"
cargo +nightly fuzz build
mkdir -p fuzz/target/logs
# libFuzzer runs one process on one core: up to ECHO_FUZZ_JOBS targets (default: the number
# of cores) fuzz at once, each for the same time and on a core of its own, so the step takes
# about seconds * targets / jobs.
jobs=${ECHO_FUZZ_JOBS:-$(nproc)}
if ! [[ $jobs =~ ^[1-9][0-9]*$ ]]; then
  echo "ECHO_FUZZ_JOBS must be a positive number, got '$jobs'" >&2
  exit 2
fi
# The runs in progress (PID -> target), each under `timeout`: ended if we are.
declare -A running=()
trap 'for pid in "${!running[@]}"; do kill -TERM "$pid" 2>/dev/null; done; wait' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
failed=()
start_run() {
  local target=$1
  local corpus=fuzz/target/corpus/$target
  local log=fuzz/target/logs/$target.log
  mkdir -p "$corpus" "fuzz/corpus/$target"
  echo ">> fuzz $target for ${seconds}s (log: $log)"
  # New inputs go to the first corpus directory, so the committed seeds stay as they are.
  # The outer timeout only catches a run that overruns -max_total_time (a hang in startup).
  timeout --kill-after=10 $((seconds + 120)) \
    cargo +nightly fuzz run "$target" "$corpus" "fuzz/corpus/$target" -- \
    -max_total_time="$seconds" -timeout=60 -print_final_stats=1 >"$log" 2>&1 &
  running[$!]=$target
}
finish_run() { # waits for the next run to end and reports it
  local pid rc=0
  wait -n -p pid "${!running[@]}" || rc=$?
  local target=${running[$pid]}
  local log=fuzz/target/logs/$target.log
  unset "running[$pid]"
  echo "   $target:"
  grep -E '^(Done|stat::average_exec_per_sec|stat::peak_rss_mb)' "$log" | sed 's/^/   /' || true
  if ((rc != 0)); then
    ((rc == 124)) && echo "   $target: still running after $((seconds + 120))s, killed" >&2
    echo "   $target FAILED (exit $rc); the end of $log:" >&2
    tail -n 60 "$log" >&2
    failed+=("$target")
  fi
}
for target in "${targets[@]}"; do
  while ((${#running[@]} >= jobs)); do
    finish_run
  done
  start_run "$target"
done
while ((${#running[@]} > 0)); do
  finish_run
done
if ((${#failed[@]} > 0)); then
  echo "fuzzing found problems in: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
  exit 1
fi
echo "   fuzz: no crashes"
