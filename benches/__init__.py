"""echo's benchmarks, one entry point: ``python -m benches`` (:mod:`benches.front`).

``python -m benches --list`` shows the named suites; ``python -m benches SUITE...`` runs them,
each writing a JSON record (:mod:`benches.records`); ``python -m benches report`` renders the
tables of ``docs/benchmarks.md`` from the committed records in ``benches/records/``.

The suites are registered in :mod:`benches.suites`, and every suite and script lives there.
``core``, the default, is the session of :mod:`benches.suites.core`: the machine's raw limits
(:mod:`benches.limits`), the in-process scenarios (``core_inprocess``), ``sample()`` on a
complete batch by leaf count (``core_views``) and the TCP actor sweep (``core_tcp``). What
they share is in :mod:`benches.common`; running a measurement in a child process is
:mod:`benches.runner`; :mod:`benches.compare` prints the ratios between two script results;
tools for machines CI does not have (a GPU, 1,000 connections) are in ``benches/tools``.
"""
