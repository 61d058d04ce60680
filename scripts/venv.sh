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
# One install into DIR at a time: CI runs scripts side by side, and two pip processes in one
# site-packages would trip over each other. The second waits, then finds its stamp current.
exec 9>"$venv/.install-lock"
if command -v flock >/dev/null; then
  flock 9
fi
stamp="$venv/.requirements-$(printf '%s' "$*" | tr -c 'A-Za-z0-9' '_').txt"
# A file of its own for the wanted list: scripts that run at once (CI runs some side by side)
# each check the stamp without touching another's.
wanted=$(mktemp "$stamp.XXXXXX")
trap 'rm -f "$wanted"' EXIT
"$venv/bin/python" scripts/requirements.py "$@" >"$wanted"
if cmp -s "$wanted" "$stamp"; then
  exit 0
fi
echo ">> installing into $venv: $(tr '\n' ' ' <"$wanted")"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -r "$wanted"
mv "$wanted" "$stamp"
