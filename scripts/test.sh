#!/usr/bin/env bash
# Builds what it needs and runs the tests of every feature: the core's Rust tests (unit,
# integration, stress, property), the Python tests, and the telemetry build's tests; each
# step is a script of its own, with a just recipe. Ends with each step's time (the steps
# print their slowest tests). The slowest suites are CI steps of their own (.ci/run): the
# loom models (exhaustive, minutes: scripts/loom.sh), the core's tests under valgrind
# memcheck and AddressSanitizer, the fuzz targets, and the benchmark suites' own tests
# (python/tests/test_bench_*.py, with the benchmark smoke run).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
STEPS_TITLE="test step times (seconds)"
source scripts/_steps.sh
step rust bash scripts/test_rust.sh
step python bash scripts/test_py.sh --ignore-glob='python/tests/test_bench_*.py'
step telemetry bash scripts/test_telemetry.sh
