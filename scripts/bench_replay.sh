#!/usr/bin/env bash
# Replay tables: criterion on 1e6-item tables (sum tree, replay), then the Python benchmark,
# benches/suites/replay_tables.py, which gets the arguments: --peers /path/to/venv/bin/python (a
# virtualenv with dm-reverb and torchrl) compares against Reverb and TorchRL in the same run.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cargo bench --bench sumtree
cargo bench --bench replay
python -m benches.suites.replay_tables "$@"
