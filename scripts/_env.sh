# Shared by scripts/*.sh: a project virtualenv with the build and test tools, and the
# extension built into it (release mode). Idempotent; re-running only rebuilds what changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  echo ">> creating .venv"
  "$PY" -m venv .venv
fi
export VIRTUAL_ENV="$PWD/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"
if ! python -c "import maturin, numpy, optree, pytest, pytest_timeout, hypothesis, tqdm" 2>/dev/null; then
  echo ">> installing build and test tools into .venv"
  python -m pip install -q --upgrade pip
  python -m pip install -q "maturin>=1.5,<2" "numpy>=1.24" "optree>=0.11" "pytest>=8" \
    "pytest-timeout>=2.3" "hypothesis>=6.100" "tqdm>=4.66"
fi
echo ">> building the extension (release)"
maturin develop --release -q
