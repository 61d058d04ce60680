#!/usr/bin/env bash
# Builds what the CI steps after the tests need, in their order: the loom models, the core's
# tests under AddressSanitizer, cargo-fuzz and the fuzz targets (each script with its own
# flags and target directory, so the step that follows finds it built). .ci/run starts this in
# the background at the lowest CPU priority while the tests run: the Python tests leave the
# cores partly idle (waiting on worker processes, sockets and timeouts), and this takes only
# what they leave. Each step still runs its own build afterwards, which then has nothing left
# to do, or builds what this did not get to (and reports any error itself): a failure here
# fails nothing.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
status=0
echo ">> prebuild: the loom models"
bash scripts/loom.sh --no-run || status=1
echo ">> prebuild: the tests under AddressSanitizer"
bash scripts/asan.sh --no-run || status=1
echo ">> prebuild: the fuzz targets"
ECHO_FUZZ_BUILD_ONLY=1 bash scripts/fuzz.sh || status=1
exit "$status"
