#!/usr/bin/env bash
# pytest over python/tests with .venv's python, after building the extension. Extra
# arguments go to pytest (-k NAME, -x, ...). scripts/test_telemetry.sh runs it again with
# PYTHONPATH=target/detailed-site, against the detailed-metrics build.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
echo ">> pytest${PYTHONPATH:+ with PYTHONPATH=$PYTHONPATH}"
python -m pytest python/tests -q "$@"
