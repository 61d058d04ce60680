#!/usr/bin/env bash
# pytest over python/tests with .venv's python, after building the extension. Extra
# arguments go to pytest (-k NAME, -x, ...). scripts/test_telemetry.sh runs it again with
# PYTHONPATH=target/detailed-site, against the detailed-metrics build.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
# The `test` extra: JAX on CPU, for the zero-copy hand-off tests and the docs' JAX examples.
bash scripts/venv.sh .venv test
echo ">> pytest${PYTHONPATH:+ with PYTHONPATH=$PYTHONPATH}"
python -m pytest python/tests -q "$@"
