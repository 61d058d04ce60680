#!/usr/bin/env bash
# Builds the extension with the `detailed-metrics` cargo feature and installs it into the
# folder given as $1 (default target/detailed-site). Put that folder first on PYTHONPATH to
# use it: PYTHONPATH=target/detailed-site python train.py
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" >/dev/null
dest=${1:-target/detailed-site}
rm -rf target/wheels-detailed "$dest"
# Under ECHO_BUILD_WHEEL=1 (CI), linked as the .venv wheel is (scripts/_env.sh): a different
# linker would make cargo build every dependency again.
zig=()
[[ ${ECHO_BUILD_WHEEL:-} == 1 ]] && zig=(--zig --compatibility manylinux2014)
maturin build --release -q "${zig[@]}" --features python,detailed-metrics -o target/wheels-detailed
python -m pip install -q --no-deps --target "$dest" target/wheels-detailed/id_echo-*.whl
echo ">> telemetry build installed in $dest"
