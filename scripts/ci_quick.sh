#!/usr/bin/env bash
# What matters for most changes, in a few minutes on 2 cores (`just ci-quick`): the release
# extension built (incrementally) once, the format and lint gates that need no second build
# (rustfmt, clippy on the default features, ruff), the core's Rust tests, the Python tests
# with -x, and the check that docs/benchmarks.md matches its records. `just ci` (.ci/run)
# runs everything: loom, valgrind, the telemetry build, ASan, fuzzing, rustdoc, pyright,
# stubtest, the docs site, the wheel and the benchmark smoke run. Extra arguments go to
# pytest (-k NAME, a file, ...). Ends with a table of each step's time.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
bash scripts/venv.sh .venv test
STEPS_TITLE="ci-quick step times"
source scripts/_steps.sh
step fmt cargo fmt --all -- --check
step ruff ruff check "${PY_SOURCES[@]}"
step ruff-fmt ruff format --check "${PY_SOURCES[@]}"
step clippy cargo clippy --quiet --all-targets -- -D warnings
step report python -m benches report --check
step cargo env ECHO_STRESS_COUNT=20000 cargo test --quiet
step pytest python -m pytest python/tests -q -x -p no:cacheprovider "$@"
