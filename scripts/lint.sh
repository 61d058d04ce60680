#!/usr/bin/env bash
# Format, lint and type gates, changing nothing (scripts/fmt.sh fixes what it can). ruff,
# pyright, mypy and actionlint come with the dev extra; stubtest needs the built extension.
# An argument picks one half: `rust` (rustfmt, clippy, rustdoc, the ORDERING comments) or
# `python` (actionlint, ruff, pyright, stubtest: single-threaded, so CI runs this half beside
# the tests, which leave a core idle while they wait on sockets); none runs both.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" >/dev/null
half=${1:-all}
if [[ $half != all && $half != rust && $half != python ]]; then
  echo "usage: lint.sh [rust|python] (got '$half')" >&2
  exit 2
fi
if [[ $half != python ]]; then
  echo ">> cargo fmt --check"
  cargo fmt --all -- --check
  echo ">> cargo clippy (core, bindings, all targets)"
  # Two passes cover every configuration: the core alone (no bindings, no telemetry: the
  # `not(feature = "detailed-metrics")` code is in the core), and everything on. The bindings
  # have no code of their own for a build without the telemetry, so a third pass (`python`
  # alone) would check nothing the two do not.
  cargo clippy --quiet --all-targets -- -D warnings
  cargo clippy --quiet --all-targets --features python,detailed-metrics -- -D warnings
  # The code paths other platforms take (no shared memory, no memfd; readiness instead of
  # FIONREAD where that is absent) never build on Linux: clippy them for macOS, whose standard
  # library rustup can add without a linker (the check links nothing). Skipped, and said so,
  # where rustup cannot fetch it (offline).
  echo ">> cargo clippy for macOS (the non-Linux fallbacks)"
  if rustup target list --installed 2>/dev/null | grep -qx x86_64-apple-darwin \
    || rustup target add x86_64-apple-darwin >/dev/null 2>&1; then
    CC_x86_64_apple_darwin="$PWD/scripts/cc-stub.sh" \
      cargo clippy --quiet --lib --target x86_64-apple-darwin --features python -- -D warnings
  else
    echo "   skipped: rustup could not add the x86_64-apple-darwin standard library"
  fi
  echo ">> the fuzz crate (its own workspace): fmt and clippy"
  cargo fmt --manifest-path fuzz/Cargo.toml -- --check
  # In the root's target directory, where the passes above checked most of its dependencies.
  # A check links nothing, so libFuzzer's C++ need not be compiled for it: the archive the
  # fuzz build made stands in where there is one.
  libfuzzer=$(find fuzz/target -path '*/release/build/libfuzzer-sys-*/out/libfuzzer.a' \
    -print -quit 2>/dev/null || true)
  (
    [[ -n $libfuzzer ]] && export CUSTOM_LIBFUZZER_PATH=$PWD/$libfuzzer
    cargo clippy --quiet --manifest-path fuzz/Cargo.toml --all-targets --target-dir target \
      -- -D warnings
  )
  echo ">> rustdoc (warnings are errors)"
  RUSTDOCFLAGS=-Dwarnings cargo doc --quiet --no-deps --features python,detailed-metrics
  echo ">> every atomic ordering has an ORDERING: comment"
  bash scripts/check_orderings.sh
fi
[[ $half == rust ]] && exit 0
echo ">> actionlint: the GitHub Actions workflows"
actionlint .github/workflows/*.yml
echo ">> ruff"
ruff check "${PY_SOURCES[@]}"
ruff format --check "${PY_SOURCES[@]}"
echo ">> pyright (strict) on python/echo"
pyright python/echo
echo ">> stubtest: _echo.pyi against the compiled module"
python -m mypy.stubtest echo._echo --allowlist .mypy-stubtest-allowlist
