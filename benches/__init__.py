"""echo's benchmarks, one entry point: ``python -m benches``.

One session measures, in this order:

1. the machine's raw limits (:mod:`benches.limits`): single-thread memcpy GB/s with numpy,
   loopback TCP GB/s with a plain socket blast (64 KiB and 1 MiB ``sendall``), and the cost
   of flattening a 2-leaf and a 40-leaf pytree with optree;
2. the in-process scenarios (``benches/py/bench_inprocess.py``: ``small``, ``large``) and
   ``sample()`` on a complete batch by leaf count (``benches/py/bench_views.py``);
3. the TCP actor sweep (``benches/py/bench_tcp.py``: learner plus K worker processes).

Each scenario runs in a child process of the interpreter under test (ours, and with
``--compare PYTHON`` the other one, interleaved scenario by scenario), so the same scripts
measure either implementation. Results go to ``DIR/results.json``, with the child processes'
own JSON and logs under ``DIR/raw`` and ``DIR/logs``, and PNG plots when matplotlib is
importable. See ``python -m benches --help`` and ``docs/benchmarks.md``.

What the scripts share is in ``benches/py/helpers.py``, the ratios between two results in
``benches/py/compare.py``; one-off tools that no ``just`` recipe runs are in
``benches/tools``.
"""
