#!/usr/bin/env bash
# The benchmarks: criterion (store; the ingress drain round), then scripts/bench_py.sh
# (python -m benches: the core suite by default, or the suites named), which gets the
# arguments.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo bench --bench store
cargo bench --bench ingress
bash scripts/bench_py.sh "$@"
