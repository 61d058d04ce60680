#!/usr/bin/env bash
# Formats everything in place: rustfmt, ruff format, then ruff's fixable lint findings.
# scripts/lint.sh checks the same without changing anything.
ECHO_NO_BUILD=1 source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cargo fmt --all
cargo fmt --manifest-path fuzz/Cargo.toml
ruff format "${PY_SOURCES[@]}"
ruff check --fix "${PY_SOURCES[@]}"
