# echo's task runner. `pip install rust-just` (in the dev extra) provides `just`.
# CI runs `bash .ci/run`, which calls the same scripts as `just test` and `just lint`.

default:
    @just --list

# Build the extension into .venv and run the demo (learner + producers, throughput)
demo *ARGS:
    bash scripts/demo.sh {{ARGS}}

# Build and run every test: cargo, loom, valgrind (if installed), pytest
test:
    bash scripts/test.sh

# Only the Python tests (after a build)
test-py *ARGS:
    .venv/bin/python -m pytest python/tests {{ARGS}}

# The loom models of the store protocol
test-loom:
    RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test --release --test loom_store --target-dir target/loom

# The core's tests under valgrind memcheck
valgrind:
    bash scripts/valgrind.sh

# Build with the detailed metrics (CAS counters, histograms) into target/detailed-site;
# use it with PYTHONPATH=target/detailed-site
install-telemetry:
    bash scripts/build_telemetry.sh target/detailed-site

# Format everything
fmt:
    cargo fmt --all
    .venv/bin/ruff format python benches examples
    .venv/bin/ruff check --fix python benches examples

# Format, clippy, ORDERING comments, ruff, pyright, stubtest
lint:
    bash scripts/lint.sh

# In-process benchmark of this build (JSON into benches/results/)
bench:
    mkdir -p benches/results
    cargo bench --bench store
    .venv/bin/python benches/py/bench_inprocess.py --label ours --json benches/results/inprocess-ours.json

# The same benchmark against another installed echo (e.g. a venv with id-echo==0.2.1), with ratios
bench-compare OTHER_VENV:
    mkdir -p benches/results
    .venv/bin/python benches/py/bench_inprocess.py --label ours --json benches/results/inprocess-ours.json
    {{OTHER_VENV}}/bin/python benches/py/bench_inprocess.py --label other --json benches/results/inprocess-other.json
    .venv/bin/python benches/py/compare.py benches/results/inprocess-ours.json benches/results/inprocess-other.json

# Build the documentation site into target/site (strict: warnings are errors)
docs:
    bash scripts/docs.sh
