#!/usr/bin/env bash
# Builds what it needs and runs every test: Rust unit/integration/stress tests, the loom
# models, valgrind memcheck of the core tests (when valgrind is installed), and pytest.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"

echo ">> cargo test (core, debug build)"
cargo test --quiet

echo ">> loom models of the store protocol"
RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 \
  cargo test --quiet --release --test loom_store --target-dir target/loom

if command -v valgrind >/dev/null 2>&1; then
  echo ">> valgrind memcheck: ring/store unit tests, store tests, stress test (small count)"
  bash scripts/valgrind.sh
else
  echo ">> valgrind not installed: skipping the memcheck run (apt-get install valgrind)"
fi

echo ">> pytest"
python -m pytest python/tests -q

echo ">> the telemetry build (cargo feature detailed-metrics): core tests and the whole pytest suite"
cargo test --quiet --features detailed-metrics --lib --test store --test tcp
bash scripts/build_telemetry.sh target/detailed-site
PYTHONPATH=target/detailed-site python -m pytest python/tests -q -p no:cacheprovider
