"""One-off tools, run by hand and by no ``just`` recipe: ``gpu_check.py`` (the pinned ring and
host-to-device copies on a machine with an NVIDIA GPU) and ``load_1000.py`` (1,000 concurrent
TCP connections to one learner). Each runs on its own (``python benches/tools/NAME.py``) and
imports ``benches/py/helpers.py``, as the benchmark scripts do."""
