#!/usr/bin/env bash
# pytest over python/tests (pyproject.toml's testpaths; or the files given) with .venv's
# python, after building the extension, in 2 processes (ECHO_PYTEST_WORKERS), ending with the
# 15 slowest tests. Extra arguments go to pytest (-k NAME, -x, files, ...).
# scripts/test_telemetry.sh runs it again with PYTHONPATH=target/detailed-site, against the
# detailed-metrics build.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
# The `test` extra: JAX on CPU, for the zero-copy hand-off tests and the docs' JAX examples;
# pytest-xdist.
bash scripts/venv.sh .venv test
# In ECHO_PYTEST_WORKERS processes (pytest-xdist; default 2, 0 for none): much of the suite
# waits on sockets, child processes and timeouts, so 2 workers keep 2 cores busy. The tests
# bind ephemeral ports and write only to their own tmp_path, so they may run side by side.
# Each worker takes the next test when it is done (worksteal): the slow ones do not pile up
# on one of them. The tests marked `serial` assert a wall-clock bound: they run afterwards,
# in one process, with nothing beside them (a pass with none of them selected is fine). An
# `-m` among the arguments replaces these selections (then one pass, in workers).
workers=${ECHO_PYTEST_WORKERS:-2}
echo ">> pytest${PYTHONPATH:+ with PYTHONPATH=$PYTHONPATH} in $workers processes"
if ((workers == 0)); then
  exec python -m pytest -q --durations=15 "$@"
fi
pytest_pass() { # pytest "$@"; exit 5 (no test selected) counts as passing
  local rc=0
  python -m pytest "$@" || rc=$?
  ((rc == 0 || rc == 5)) || exit "$rc"
}
pytest_pass -q --durations=15 -n "$workers" --dist worksteal -m "not serial" "$@"
for arg in "$@"; do
  [[ $arg == -m || $arg == -m* ]] && exit 0
done
echo ">> pytest: the tests marked serial, in one process"
pytest_pass -q -m serial "$@"
