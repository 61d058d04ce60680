#!/usr/bin/env bash
# The telemetry build (cargo feature detailed-metrics): the core tests it changes, then the
# extension built with it into target/detailed-site and, against it, the Python tests of what
# the feature adds or instruments: the detailed counters and histograms (test_metrics), the
# stats and Prometheus views of them (test_info*, test_prometheus, test_counters_paths, the
# metrics guide's examples), and the contended insert and drain paths the CAS counters and
# drain histograms sit in (test_concurrency, test_batch_inserts). Arguments replace that
# selection (e.g. `python/tests` for the whole suite against the telemetry build).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
echo ">> the telemetry build (cargo feature detailed-metrics)"
bash scripts/test_rust.sh --features detailed-metrics --lib --test store --test tcp
bash scripts/build_telemetry.sh target/detailed-site
if (($# == 0)); then
  set -- python/tests/test_metrics.py python/tests/test_info.py python/tests/test_info_values.py \
    python/tests/test_prometheus.py python/tests/test_counters_paths.py \
    python/tests/test_concurrency.py python/tests/test_batch_inserts.py \
    python/tests/test_docs_examples.py -k "not test_docs_example or metrics or prometheus"
fi
PYTHONPATH=target/detailed-site bash scripts/test_py.sh -p no:cacheprovider "$@"
