# echo's task runner. Every recipe runs one script in scripts/ (the scripts' headers say more);
# .ci/run calls the same scripts. `just` comes with the dev extra: .venv/bin/just once any
# script has made .venv, or `pip install rust-just`.

default:
    @just --list

# Build the extension into .venv and run the demo (learner + producers, throughput)
demo *ARGS:
    bash scripts/demo.sh {{ARGS}}

# All that CI runs: the README test command, lint, docs, the wheel check, the bench smoke run
ci:
    bash .ci/run

# What matters for most changes in a few minutes: fmt, clippy, ruff, cargo test, pytest -x
ci-quick *ARGS:
    bash scripts/ci_quick.sh {{ARGS}}

# The README test command: cargo test, pytest (but the benchmarks' tests), the telemetry build
test:
    bash scripts/test.sh

# The core's Rust tests (cargo test, debug build); ARGS go to cargo test
test-rust *ARGS:
    bash scripts/test_rust.sh {{ARGS}}

# Build, then only the Python tests; ARGS go to pytest
test-py *ARGS:
    bash scripts/test_py.sh {{ARGS}}

# The tests and benchmark that need PyTorch (installed once into target/torch-site, ~5 GB)
test-torch *ARGS:
    bash scripts/test_torch.sh {{ARGS}}

# The multi-host soak: namespaces, seeded random faults for SECONDS (default 300), as root
soak-multihost *ARGS:
    bash scripts/soak_multihost.sh {{ARGS}}

# The loom models: every tests/loom_*.rs; ARGS go to cargo test
test-loom *ARGS:
    bash scripts/loom.sh {{ARGS}}

# The core's tests under valgrind memcheck
valgrind:
    bash scripts/valgrind.sh

# The core's Rust tests under AddressSanitizer (nightly, target/asan); ARGS go to cargo test
asan *ARGS:
    bash scripts/asan.sh {{ARGS}}

# Fuzz every target for 60 s each (ECHO_FUZZ_SECONDS=N for longer), or only the TARGETS named
fuzz *TARGETS:
    bash scripts/fuzz.sh {{TARGETS}}

# The detailed-metrics build: its core tests, then its Python tests (ARGS: other pytest files)
test-telemetry *ARGS:
    bash scripts/test_telemetry.sh {{ARGS}}

# Build with the detailed metrics into target/detailed-site (use with PYTHONPATH=that)
install-telemetry:
    bash scripts/build_telemetry.sh target/detailed-site

# Format everything in place (rustfmt, ruff format, ruff check --fix)
fmt:
    bash scripts/fmt.sh

# Format check, clippy, rustdoc, ORDERING comments, ruff, pyright, stubtest (HALF: rust or python)
lint *HALF:
    bash scripts/lint.sh {{HALF}}

# Criterion (store, ingress drain round), then python -m benches ARGS (default: the core suite)
bench *ARGS:
    bash scripts/bench.sh {{ARGS}}

# The benchmark suites, one line each (python -m benches --list)
bench-list:
    .venv/bin/python -m benches --list

# Rewrite docs/benchmarks.md's tables from the committed records in benches/records/
bench-report:
    python3 -m benches report

# Replay tables: criterion on 1e6-item tables, then the Python benchmark (vs Reverb/TorchRL)
bench-replay *ARGS:
    bash scripts/bench_replay.sh {{ARGS}}

# The benchmarks against another echo's venv (e.g. id-echo==0.2.1), with ratios ours / other
bench-compare OTHER_VENV *ARGS:
    bash scripts/bench_py.sh --compare {{OTHER_VENV}}/bin/python {{ARGS}}

# The benchmarks' smoke run as CI runs it (python -m benches --quick, then check its record)
bench-smoke:
    bash scripts/bench_smoke.sh

# Build the documentation site into target/site (strict: warnings are errors)
docs:
    bash scripts/docs.sh

# The manylinux2014 abi3 wheel into dist/ (or DIR), checked: auditwheel, a fresh venv, the demo
wheel *DIR:
    bash scripts/wheel.sh {{DIR}}
