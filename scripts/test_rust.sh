#!/usr/bin/env bash
# cargo test of the core, debug build: unit, integration, stress and property tests. Extra
# arguments go to cargo test (scripts/test_telemetry.sh passes --features detailed-metrics).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
echo ">> cargo test${*:+ $*}"
cargo test --quiet "$@"
