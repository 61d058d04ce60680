#!/usr/bin/env bash
# A C compiler for the macOS clippy check, which links nothing: zstd-sys's build script
# compiles zstd's C sources, which this Linux host cannot compile for macOS. Each object it
# asks for is an empty one (clippy only needs the Rust side); anything else (the build
# script's compiler detection, `cc -E`) goes to the host's cc.
out=""
prev=""
for arg in "$@"; do
  if [ "$prev" = "-o" ]; then out="$arg"; fi
  prev="$arg"
done
if [ -n "$out" ]; then
  exec cc -c -x c /dev/null -o "$out"
fi
exec cc "$@"
