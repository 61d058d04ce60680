#!/usr/bin/env bash
# Every use of an atomic ordering in src/ needs an `ORDERING:` comment that ends at most three
# lines above it (or sits on the same line), saying what it publishes or acquires and what it
# pairs with, or why Relaxed is enough.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
status=0
while IFS= read -r file; do
  awk -v file="$file" '
    BEGIN { last = -100; in_block = 0; block_has = 0 }
    /^[[:space:]]*\/\// {
      if (!in_block) { in_block = 1; block_has = 0 }
      if ($0 ~ /ORDERING:/) block_has = 1
      if (block_has) last = NR
      next
    }
    { in_block = 0 }
    /ORDERING:/ { last = NR }
    /(Relaxed|Acquire|Release|AcqRel|SeqCst)[,)]/ && !/^use / {
      if (NR - last > 3) { printf "%s:%d: atomic ordering without an ORDERING: comment\n", file, NR; bad = 1 }
    }
    END { exit bad }
  ' "$file" || status=1
done < <(find src -name '*.rs')
exit $status
