# shellcheck shell=bash
# Sourced by scripts/*.sh: the project virtualenv .venv with the runtime dependencies and
# pyproject.toml's dev extra (build, test and lint tools; scripts/venv.sh), activated, and
# the extension built into it (release mode). Idempotent; re-running only rebuilds what
# changed. A script run by one that has built already (scripts/test.sh runs several) does
# not build again; ECHO_NO_BUILD=1 skips the build (scripts/fmt.sh needs only the tools).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/venv.sh .venv --deps dev
export VIRTUAL_ENV="$PWD/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"
# What ruff formats and lints (scripts/fmt.sh, scripts/lint.sh).
# shellcheck disable=SC2034
PY_SOURCES=(python benches examples scripts)
# ECHO_BUILD_WHEEL=1 (CI: .ci/run) builds the release wheel instead (manylinux2014, linked by
# zig, as scripts/wheel.sh builds it) and installs it into .venv: the tests then run against
# the wheel users get, scripts/wheel.sh checks that same file, and CI builds the release
# extension once, not twice. Without it, an editable install (`maturin develop`), which sees
# edits to python/echo at once.
if [[ ${ECHO_NO_BUILD:-} != 1 && ${ECHO_BUILT:-} != "$PWD" ]]; then
  if [[ ${ECHO_BUILD_WHEEL:-} == 1 ]]; then
    echo ">> building the release wheel (manylinux2014, zig) into target/wheels-venv"
    bash scripts/venv.sh .venv wheel
    rm -rf target/wheels-venv
    maturin build --release -q --zig --compatibility manylinux2014 --out target/wheels-venv
    python -m pip install -q --force-reinstall --no-deps target/wheels-venv/id_echo-*.whl
  else
    echo ">> building the extension (release)"
    maturin develop --release -q
  fi
  export ECHO_BUILT=$PWD
fi
