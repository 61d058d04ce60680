#!/usr/bin/env bash
# Builds what it needs and runs every test: Rust unit/integration/stress/property tests, the
# loom models, valgrind memcheck of the core tests (when valgrind is installed), pytest, and
# the telemetry build's tests. Each step is a script of its own, with a just recipe.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
bash scripts/test_rust.sh
bash scripts/loom.sh
if command -v valgrind >/dev/null 2>&1; then
  bash scripts/valgrind.sh
else
  echo ">> valgrind not installed: skipping the memcheck run (apt-get install valgrind)"
fi
bash scripts/test_py.sh
bash scripts/test_telemetry.sh
