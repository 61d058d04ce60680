#!/usr/bin/env bash
# The loom models: every tests/loom_*.rs, built with --cfg loom (src/sync.rs then swaps in
# loom's atomics, mutexes and condvars) in target/loom, so the normal build stays cached.
# Extra arguments go to cargo test (a test name to run one model, say).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
models=()
for file in tests/loom_*.rs; do
  [[ -e $file ]] && models+=(--test "$(basename "$file" .rs)")
done
if ((${#models[@]} == 0)); then
  echo "loom: no tests/loom_*.rs to run" >&2
  exit 1
fi
echo ">> loom models: ${models[*]}"
# --profile loom: release's optimisation without its LTO and debug info (Cargo.toml).
RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 \
  cargo test --quiet --profile loom "${models[@]}" --target-dir target/loom "$@"
