#!/usr/bin/env bash
# `python -m benches` with .venv's python, after building the extension and installing the
# bench extra (tqdm progress bars, matplotlib plots). It writes JSON, PNG plots and a summary
# table into benches/results/<timestamp>/. Arguments go to it: --quick, --out DIR,
# --workers 1,4,16,64, --launcher ray (Ray actors as TCP workers; needs ray in .venv),
# --compare OTHER_PYTHON (another installed echo, interleaved in one session), ...
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
bash scripts/venv.sh .venv bench
python -m benches "$@"
