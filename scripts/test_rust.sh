#!/usr/bin/env bash
# cargo test of the core, debug build: unit, integration, stress and property tests, then the
# doctests; ends with the test binaries' run times, slowest first. Extra arguments go to
# cargo test instead, run as it is (scripts/test_telemetry.sh passes --features
# detailed-metrics and the binaries it wants).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
echo ">> cargo test${*:+ $*}"
if (($# > 0)); then
  cargo test --quiet "$@"
  exit
fi
# Every test binary cargo test would run, built once; each then runs from the package root,
# as cargo test runs it.
mapfile -t binaries < <(
  cargo test --quiet --no-run --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message.get("executable") \
            and message["profile"]["test"]:
        print(message["executable"])
'
)
timings=()
for binary in "${binaries[@]}"; do
  t0=$SECONDS
  "$binary" -q
  timings+=("$((SECONDS - t0)) $(basename "$binary" | sed 's/-[0-9a-f]*$//')")
done
t0=$SECONDS
cargo test --quiet --doc
timings+=("$((SECONDS - t0)) doctests")
echo ">> the slowest Rust test binaries (seconds)"
printf '%s\n' "${timings[@]}" | sort -rn | head -n 10 | awk '{ printf "   %6s  %s\n", $1, $2 }'
