#!/usr/bin/env bash
# Builds the Linux wheel that pip users get and checks that it installs and runs where there
# is no Rust toolchain:
#   1. maturin build --release --zig --compatibility manylinux2014: one abi3 wheel (CPython
#      3.10+) linked by zig against glibc 2.17, so RHEL 8, Ubuntu 20.04 and newer install it
#      (a plain `maturin build` links against this machine's glibc: manylinux_2_34 here);
#   2. auditwheel show: fails unless the wheel is manylinux_2_17 (manylinux2014) and abi3;
#   3. a fresh virtualenv (python -m venv, $PYTHON or python3), the wheel installed into it
#      with pip from a PATH without cargo or rustc (its dependencies as wheels only);
#   4. from a folder outside the checkout: `import echo` must come from that virtualenv, then
#      a short run of the demo (examples/demo.py, 2 workers x 2,048 samples).
# The wheel goes to dist/ (or $1). zig and auditwheel are the wheel extra of pyproject.toml,
# installed into .venv on top of dev; the extension is not built into .venv. The cargo target
# dir is reused between runs (CARGO_TARGET_DIR, default target/): a rebuild takes seconds.
# Under .ci/run (ECHO_BUILD_WHEEL=1) the wheel scripts/_env.sh built and installed is the one
# checked.
ECHO_NO_BUILD=1 source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" >/dev/null
bash scripts/venv.sh .venv wheel
out=${1:-dist}
arch=$(uname -m)
start=$SECONDS
mkdir -p "$out"
rm -f "$out"/id_echo-*.whl

# Under .ci/run (ECHO_BUILD_WHEEL=1), scripts/_env.sh has built this wheel from this checkout
# already, with the same command, and the tests ran against it: it is checked as it is (a
# rebuild would compile the whole crate again, as the telemetry build in between has
# overwritten its cdylib: cargo names a cdylib alike whatever its features).
built=(target/wheels-venv/id_echo-*.whl)
if [[ ${ECHO_BUILD_WHEEL:-} == 1 && ${ECHO_BUILT:-} == "$PWD" && -f ${built[0]} ]]; then
  echo ">> the wheel scripts/_env.sh built for this checkout: ${built[0]} (into $out)"
  cp "${built[@]}" "$out"/
else
  echo ">> maturin build --release --zig --compatibility manylinux2014 (into $out)"
  maturin build --release --zig --compatibility manylinux2014 --out "$out"
fi
wheels=("$out"/id_echo-*.whl)
if ((${#wheels[@]} != 1)) || [[ ! -f ${wheels[0]} ]]; then
  echo "wheel: expected one id_echo wheel in $out, found: ${wheels[*]}" >&2
  exit 1
fi
wheel=$(realpath "${wheels[0]}")
name=$(basename "$wheel")
echo "   built $name ($(du -h "$wheel" | cut -f1)) in $((SECONDS - start)) s"

echo ">> auditwheel show"
report=$(auditwheel show "$wheel")
echo "$report" | sed 's/^/   /'
# auditwheel wraps its sentences: read the report as one line.
flat=$(echo "$report" | tr -s ' \n' ' ')
if [[ $flat != *"consistent with the following platform tag: \"manylinux_2_17_$arch\""* ]]; then
  echo "wheel: auditwheel does not find $name manylinux_2_17_$arch (manylinux2014)" >&2
  exit 1
fi
if [[ $name != *-cp310-abi3-*manylinux_2_17_"$arch"* ]]; then
  echo "wheel: $name is not tagged cp310-abi3 manylinux_2_17_$arch" >&2
  exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# auditwheel judges versioned symbols only: a libc function newer than glibc 2.17 that the
# link left unversioned (zig's 2.17 stubs lack it) would pass it and fail to load on an old
# system. Only Python's own symbols may be unversioned.
echo ">> no unversioned libc symbols in the extension"
python3 -m zipfile -e "$wheel" "$tmp/unpacked"
unversioned=$(nm -D --undefined-only "$tmp"/unpacked/echo/*.so |
  awk '$1 == "U" && $2 !~ /@/ && $2 !~ /^_?Py/ { print $2 }')
if [[ -n $unversioned ]]; then
  echo "wheel: unversioned symbols (call them another way, e.g. libc::syscall):" $unversioned >&2
  exit 1
fi
echo "   none"
venv=$tmp/venv
echo ">> fresh virtualenv $venv (${PYTHON:-python3})"
"${PYTHON:-python3}" -m venv "$venv"
# PATH without any folder that holds cargo, rustc or rustup, and without .venv: what a user
# without a Rust toolchain has.
clean_path=
IFS=: read -ra dirs <<<"$PATH"
for dir in "${dirs[@]}"; do
  [[ -z $dir || $dir == "$VIRTUAL_ENV/bin" ]] && continue
  [[ -e $dir/cargo || -e $dir/rustc || -e $dir/rustup ]] && continue
  clean_path+=${clean_path:+:}$dir
done
# Everything below runs in a folder outside the checkout, with that PATH and no settings
# that point back into it.
cp examples/demo.py "$tmp/demo.py"
cd "$tmp"
run() {
  env -u VIRTUAL_ENV -u PYTHONPATH -u PYTHONHOME -u CARGO_HOME -u RUSTUP_HOME \
    -u CARGO_TARGET_DIR PATH="$clean_path" "$@"
}
echo ">> pip install the wheel, without a Rust toolchain on PATH"
run bash -c 'for tool in cargo rustc rustup; do
  if command -v "$tool"; then echo "wheel: $tool is still on PATH" >&2; exit 1; fi
done
echo "   no cargo, rustc or rustup on PATH"'
run "$venv/bin/python" -m pip install -q --disable-pip-version-check --only-binary=:all: "$wheel"

echo ">> import echo from $tmp"
where=$(run "$venv/bin/python" -c 'import echo; print(echo.__file__, echo.__version__)')
echo "   $where"
if [[ $where != "$venv"/lib/python*/site-packages/echo/__init__.py* ]]; then
  echo "wheel: echo was not imported from the fresh virtualenv $venv" >&2
  exit 1
fi

echo ">> the demo from the installed wheel (2 workers x 2,048 samples)"
run "$venv/bin/python" demo.py --workers 2 --samples 2048 --batch-size 256
echo ">> wheel: ok, $name in $((SECONDS - start)) s"
