#!/usr/bin/env bash
# Runs the core's unit tests, store tests and a small stress test under valgrind memcheck.
# Fails on any memory error or definite leak.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo test --quiet --no-run --lib --test store --test stress_store 2>/dev/null
run() {
  echo "   valgrind $1"
  ECHO_STRESS_COUNT=2000 valgrind --quiet --error-exitcode=99 --leak-check=full \
    --errors-for-leak-kinds=definite --show-possibly-lost=no "$1" --test-threads=2 -q >/dev/null
}
for name in echo store stress_store; do
  bin=$(ls -t target/debug/deps/${name}-* | grep -v '\.d$' | head -n 1)
  run "$bin"
done
echo "   valgrind: no errors"
