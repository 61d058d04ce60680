#!/usr/bin/env bash
# Build the documentation site with warnings as errors (broken links, anchors, docstrings).
#
#   bash scripts/docs.sh            # -> target/site
#
# Uses its own virtualenv, target/docs-venv, with pyproject.toml's docs extra installed by
# scripts/venv.sh (again only when that extra changes).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/venv.sh target/docs-venv docs
# mkdocs-material prints a banner about MkDocs 2.0 on every build; it is not a docs warning.
export NO_MKDOCS_2_WARNING=1
target/docs-venv/bin/mkdocs build --strict -d target/site "$@"
