#!/usr/bin/env bash
# Build the documentation site with warnings as errors (broken links, anchors, docstrings).
#
#   bash scripts/docs.sh            # -> target/site
#
# Uses its own virtualenv, target/docs-venv, created (and mkdocs installed into it) on the
# first run only; delete that folder to reinstall.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=target/docs-venv
if [[ ! -x "$VENV/bin/mkdocs" ]]; then
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q "mkdocs-material>=9.5" "mkdocstrings[python]>=0.26"
fi

# mkdocs-material prints a banner about MkDocs 2.0 on every build; it is not a docs warning.
export NO_MKDOCS_2_WARNING=1
"$VENV/bin/mkdocs" build --strict -d target/site "$@"
