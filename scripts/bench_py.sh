#!/usr/bin/env bash
# `python -m benches` with .venv's python, after building the extension and installing the
# bench extra (tqdm progress bars, matplotlib plots). It writes each suite's JSON record (and
# for the core suite plots and a summary table) into benches/results/<timestamp>/. Arguments
# go to it: suite names (--list shows them; default core), --quick, --out DIR, --save,
# --set KEY=VALUE, --compare OTHER_PYTHON (another installed echo, interleaved), and core's
# --workers 1,4,16,64, --launcher ray (Ray actors as TCP workers; needs ray in .venv), ...
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
bash scripts/venv.sh .venv bench
python -m benches "$@"
