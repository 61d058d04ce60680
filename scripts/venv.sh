#!/usr/bin/env bash
# Creates the virtualenv DIR (with $PYTHON, default python3) when it is missing and installs
# pyproject.toml extras into it: the lines scripts/requirements.py prints for the same
# arguments, where every tool version is declared.
#
#   bash scripts/venv.sh .venv --deps dev           # what scripts/_env.sh does
#   bash scripts/venv.sh target/docs-venv docs      # what scripts/docs.sh does
#
# Idempotent and quick: DIR/.requirements-<arguments>.txt holds the lines last installed for
# those arguments; while pyproject.toml still gives the same lines, nothing is installed.
# Delete the stamp (or DIR) to install again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=$1
shift
if [[ ! -x $venv/bin/python ]]; then
  echo ">> creating $venv"
  "${PYTHON:-python3}" -m venv "$venv"
fi
stamp="$venv/.requirements-$(printf '%s' "$*" | tr -c 'A-Za-z0-9' '_').txt"
"$venv/bin/python" scripts/requirements.py "$@" >"$stamp.new"
if cmp -s "$stamp.new" "$stamp"; then
  rm -f "$stamp.new"
  exit 0
fi
echo ">> installing into $venv: $(tr '\n' ' ' <"$stamp.new")"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -r "$stamp.new"
mv "$stamp.new" "$stamp"
