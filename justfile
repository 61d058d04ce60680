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

# `python -m benches` writes JSON, PNG plots (with matplotlib) and a summary table into
# benches/results/<timestamp>/; ARGS go to it (--quick, --out DIR, --workers 1,4,16,64,
# --launcher ray for Ray actors as TCP workers (needs ray in .venv), ...).
#
# Criterion (store, ingress drain round), then python -m benches (limits, in-process, TCP sweep)
bench *ARGS:
    cargo bench --bench store
    cargo bench --bench ingress
    .venv/bin/python -m benches {{ARGS}}

# ARGS go to benches/py/bench_replay.py: --peers /path/to/venv/bin/python (a virtualenv with
# dm-reverb and torchrl) compares in the same run.
#
# Replay tables: criterion on 1e6-item tables, then the Python benchmark (vs Reverb/TorchRL)
bench-replay *ARGS:
    cargo bench --bench sumtree
    cargo bench --bench replay
    .venv/bin/python benches/py/bench_replay.py {{ARGS}}

# The same scenarios with another installed echo, interleaved in one session, both on the plots.
#
# The benchmarks against another echo's venv (e.g. id-echo==0.2.1), with ratios ours / other
bench-compare OTHER_VENV *ARGS:
    .venv/bin/python -m benches --compare {{OTHER_VENV}}/bin/python {{ARGS}}

# The benchmarks' smoke run as CI runs it (python -m benches --quick, then check the JSON)
bench-smoke:
    bash scripts/bench_smoke.sh

# Build the documentation site into target/site (strict: warnings are errors)
docs:
    bash scripts/docs.sh
