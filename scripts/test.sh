#!/usr/bin/env bash
# Builds what it needs and runs every test of every feature: the core's Rust tests (unit,
# integration, stress, property), the loom models, the Python tests, and the telemetry
# build's tests; each step is a script of its own, with a just recipe. Ends with each step's
# time (the steps print their slowest tests). The slow memory checkers of the same tests
# run as CI steps of their own (.ci/run): AddressSanitizer (scripts/asan.sh) and valgrind
# memcheck (scripts/valgrind.sh).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
STEPS_TITLE="test step times (seconds)"
source scripts/_steps.sh
step rust bash scripts/test_rust.sh
step loom bash scripts/loom.sh
step python bash scripts/test_py.sh
step telemetry bash scripts/test_telemetry.sh
