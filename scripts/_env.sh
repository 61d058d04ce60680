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
if [[ ${ECHO_NO_BUILD:-} != 1 && ${ECHO_BUILT:-} != "$PWD" ]]; then
  echo ">> building the extension (release)"
  maturin develop --release -q
  export ECHO_BUILT=$PWD
fi
