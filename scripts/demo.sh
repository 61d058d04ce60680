#!/usr/bin/env bash
# Builds what it needs and runs the demo: a learner consuming batches from several producers,
# printing throughput. Extra arguments go to examples/demo.py (try --help).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
python examples/demo.py "$@"
