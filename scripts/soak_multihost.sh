#!/usr/bin/env bash
# The multi-host soak (python/tests/test_multihost.py): a learner host and worker hosts as
# network namespaces, a seeded schedule of random faults (partitions, resets, stalls, slow
# links) for SECONDS (default 300; the test suite runs 8), then exactly-once delivery and
# bounded learner memory checked. Needs root and iproute2. ECHO_MULTIHOST_SOAK_SEED picks the
# schedule.
# Usage: scripts/soak_multihost.sh [SECONDS] [pytest args...]
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
seconds=${1:-300}
shift || true
ECHO_MULTIHOST_SOAK_S=$seconds ECHO_PYTEST_WORKERS=0 exec bash scripts/test_py.sh \
  python/tests/test_multihost.py -k soak -s "$@"
