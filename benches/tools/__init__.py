"""One-off tools, run by hand and by no ``just`` recipe: ``gpu_check.py`` (the pinned ring and
host-to-device copies on a machine with an NVIDIA GPU), ``load_1000.py`` (1,000 concurrent
TCP connections to one learner), ``issue10_ratios.py`` / ``issue10_rerun.py`` (before/after
ratios over several ``python -m benches --compare`` runs, and interleaved A/B re-runs of one
scenario with CPU per sample), and the ``issue11_*.py`` measurements behind the hardening
issue's closing note (RSS over server lifetimes, the ingress memory bound, idle-connection
lock-out, the longest GIL gap during a large ``update_priorities``, the accept rate under a
connection flood), which run the current build and another interpreter's echo interleaved
(``_issue11.py`` holds what they share), and ``issue12_v2_vs_v1.py`` (samples/s of wire v2
against v1 on the same learner, small and ~200 KB samples, K = 1, 4, 16 worker processes),
``issue15_batch_inserts.py`` (``submit_batch``/``send_batch`` against one call per row),
``issue13_checkpoint_stall.py`` (insert/sample latency with and without a checkpoint running,
checkpoint write/restore throughput against numpy ``tofile``/``fromfile``).
Each runs on its own (``python benches/tools/NAME.py``) and imports ``benches/py/helpers.py``
or ``_issue11.py``."""
