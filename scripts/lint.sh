#!/usr/bin/env bash
# Format, lint and type gates: the same checks `just lint` runs.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" >/dev/null
if ! python -c "import ruff, pyright" 2>/dev/null; then
  python -m pip install -q "ruff>=0.6" "pyright>=1.1.380" "mypy>=1.11"
fi
echo ">> cargo fmt --check"
cargo fmt --all -- --check
echo ">> cargo clippy (core, bindings, all targets)"
cargo clippy --quiet --all-targets -- -D warnings
cargo clippy --quiet --all-targets --features python -- -D warnings
cargo clippy --quiet --all-targets --features python,detailed-metrics -- -D warnings
echo ">> rustdoc (warnings are errors)"
RUSTDOCFLAGS=-Dwarnings cargo doc --quiet --no-deps --features python,detailed-metrics
echo ">> every atomic ordering has an ORDERING: comment"
bash scripts/check_orderings.sh
echo ">> ruff"
ruff check python benches examples
ruff format --check python benches examples
echo ">> pyright (strict) on python/echo"
pyright python/echo
echo ">> stubtest: _echo.pyi against the compiled module"
python -m mypy.stubtest echo._echo --allowlist .mypy-stubtest-allowlist
