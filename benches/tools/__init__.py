"""Tools run by hand on machines CI does not have, outside ``python -m benches``:
``gpu_check.py`` (the pinned ring and host-to-device copies on a machine with an NVIDIA GPU),
``gpu_prefetch_check.py`` (``dataset_iter(device=..., prefetch=N)`` with PyTorch on a GPU) and
``load_1000.py`` (1,000 concurrent TCP connections to one learner). Each runs on its own
(``python benches/tools/NAME.py``) and imports ``benches/common.py``. Measurements that
any machine can run are suites of ``python -m benches`` (``--list``)."""
