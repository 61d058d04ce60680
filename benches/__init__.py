"""echo's benchmarks, one entry point: ``python -m benches`` (:mod:`benches.front`).

``python -m benches --list`` shows the named suites; ``python -m benches SUITE...`` runs them,
each writing a JSON record (:mod:`benches.records`); ``python -m benches report`` renders the
tables of ``docs/benchmarks.md`` from the committed records in ``benches/records/``.

The suites are registered in :mod:`benches.suites`. ``core``, the default, is the session of
:mod:`benches.cli`: the machine's raw limits (:mod:`benches.limits`), the in-process scenarios
(``benches/suites/core_inprocess.py``), ``sample()`` on a complete batch by leaf count
(``benches/suites/core_views.py``) and the TCP actor sweep (``benches/suites/core_tcp.py``).
Every suite and script lives in ``benches/suites``; what they share is in
``benches/common.py`` (:mod:`benches.compare` prints the ratios between two script results);
tools for machines CI does not have (a GPU, 1,000 connections) are in ``benches/tools``.
"""
