"""echo's benchmarks, one entry point: ``python -m benches`` (:mod:`benches.front`).

``python -m benches --list`` shows the named suites; ``python -m benches SUITE...`` runs them,
each writing a JSON record (:mod:`benches.records`); ``python -m benches report`` renders the
tables of ``docs/benchmarks.md`` from the committed records in ``benches/records/``.

The suites are registered in :mod:`benches.suites`. ``core``, the default, is the session of
:mod:`benches.cli`: the machine's raw limits (:mod:`benches.limits`), the in-process scenarios
(``benches/py/bench_inprocess.py``), ``sample()`` on a complete batch by leaf count
(``benches/py/bench_views.py``) and the TCP actor sweep (``benches/py/bench_tcp.py``). What the
scripts share is in ``benches/py/helpers.py`` and ``benches/suites/_common.py``; tools for
machines CI does not have (a GPU, 1,000 connections) are in ``benches/tools``.
"""
