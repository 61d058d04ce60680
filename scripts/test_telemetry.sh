#!/usr/bin/env bash
# The telemetry build (cargo feature detailed-metrics): the core tests it changes, then the
# extension built with it into target/detailed-site and the whole pytest suite against it.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
echo ">> the telemetry build (cargo feature detailed-metrics)"
bash scripts/test_rust.sh --features detailed-metrics --lib --test store --test tcp
bash scripts/build_telemetry.sh target/detailed-site
PYTHONPATH=target/detailed-site bash scripts/test_py.sh -p no:cacheprovider
