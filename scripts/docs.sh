#!/usr/bin/env bash
# Build the documentation site with warnings as errors (broken links, anchors, docstrings).
#
#   bash scripts/docs.sh            # -> target/site
#
# Uses its own virtualenv, target/docs-venv, with pyproject.toml's docs extra installed by
# scripts/venv.sh (again only when that extra changes). First checks that every table of
# docs/benchmarks.md matches the record in benches/records/ it is rendered from
# (`python -m benches report --check`, standard library only); `python -m benches report`
# regenerates them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/venv.sh target/docs-venv docs
target/docs-venv/bin/python -m benches report --check
# mkdocs-material prints a banner about MkDocs 2.0 on every build; it is not a docs warning.
export NO_MKDOCS_2_WARNING=1
target/docs-venv/bin/mkdocs build --strict -d target/site "$@"
