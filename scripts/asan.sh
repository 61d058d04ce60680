#!/usr/bin/env bash
# The core's Rust tests (no `python` feature) under AddressSanitizer, on the nightly toolchain,
# in target/asan so the normal build stays cached (crossbeam's ci/san.sh). Every unit,
# integration, stress, property and TCP test runs, doctests too (RUSTDOCFLAGS); leak checking
# is on. Only std is not instrumented (-Zbuild-std needs rust-src, which is not installed):
# ASan still sees every access our code and its dependencies make. Extra arguments go to
# cargo test (a test name, `-- --nocapture`, ...).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
target=$(rustc +nightly -vV | sed -n 's/^host: //p')
echo ">> cargo +nightly test under AddressSanitizer ($target, target/asan)"
# --target keeps the sanitizer flags off build scripts and proc macros (which would need an
# ASan runtime at build time). detect_stack_use_after_return costs little here and catches
# references to dead stack frames; leaks are errors.
RUSTFLAGS="-Zsanitizer=address" RUSTDOCFLAGS="-Zsanitizer=address" \
  ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:detect_stack_use_after_return=1}" \
  cargo +nightly test --quiet --target "$target" --target-dir target/asan "$@"
