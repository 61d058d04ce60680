#!/usr/bin/env bash
# Smoke run of the benchmarks, for CI: the benchmark suites' own tests
# (python/tests/test_bench_*.py: each suite run on tiny sizes and its record checked; about
# 2 minutes, the Ray suite's local cluster the longest), then `python -m benches --quick`
# with the .venv's python (the core suite: raw limits, both in-process scenarios, the TCP
# sweep at K = 1, 4 for 1.5 s each) and a check of the JSON it wrote: the session's
# results.json and the suite's record. Needs the `test` extra (scripts/test_py.sh installs
# it); without matplotlib it writes no PNGs and says so. Output: target/bench-smoke/ (or $1).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" >/dev/null
OUT=${1:-target/bench-smoke}
bash scripts/test_py.sh python/tests/test_bench_*.py
rm -rf "$OUT"
echo ">> python -m benches --quick --out $OUT"
start=$SECONDS
# --max-seconds: no scenario starts later than that; timeout: a hard stop (the driver then
# ends the scenario it is running, with the worker processes it started).
timeout -k 10 150 .venv/bin/python -m benches --quick --out "$OUT" --max-seconds 100
json="$OUT/results.json"
record="$OUT/core.json"
if [[ ! -s "$json" ]]; then
  echo "bench smoke: $json was not written" >&2
  exit 1
fi
.venv/bin/python - "$json" "$record" <<'EOF'
import json
import sys

doc = json.load(open(sys.argv[1], encoding="utf-8"))
record = json.load(open(sys.argv[2], encoding="utf-8"))
for key in ("suite", "machine", "interpreters", "commit", "parameters", "tables"):
    if not record.get(key):
        sys.exit(f"bench smoke: {sys.argv[2]}: the record has no {key}")
missing = [k for k in ("memcpy", "loopback_64k", "loopback_1m", "flatten_small", "flatten_large")
           if k not in doc["limits"]]
missing += [f"inprocess {n}" for n in ("small", "large") if n not in doc["inprocess"].get("ours", {})]
missing += [f"tcp {n}" for n in ("small", "large") if n not in doc["tcp"].get("ours", {})]
missing += ["views"] if "views" not in doc or not doc["views"].get("ours") else []
if missing or not doc["ours_correct"]:
    sys.exit(f"bench smoke: {sys.argv[1]}: missing {missing}, correct {doc['ours_correct']}")
print(f"bench smoke: {sys.argv[1]} complete, every scenario correct")
EOF
echo ">> bench smoke: ok in $((SECONDS - start)) s"
