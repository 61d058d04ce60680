#!/usr/bin/env bash
# pytest over python/tests (pyproject.toml's testpaths; or the files given) with .venv's
# python, after building the extension, ending with the 15 slowest tests. Extra arguments
# go to pytest (-k NAME, -x, files, ...). scripts/test_telemetry.sh runs it again with
# PYTHONPATH=target/detailed-site, against the detailed-metrics build.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
# The `test` extra: JAX on CPU, for the zero-copy hand-off tests and the docs' JAX examples.
bash scripts/venv.sh .venv test
echo ">> pytest${PYTHONPATH:+ with PYTHONPATH=$PYTHONPATH}"
python -m pytest -q --durations=15 "$@"
