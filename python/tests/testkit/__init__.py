"""Helpers that several test files share (fixtures live in ``conftest.py``). The test files
import them as ``testkit.NAME``: pytest puts ``python/tests`` on ``sys.path``. Not named
``helpers``: ``benches/py``'s scripts import their own ``helpers`` module as a top-level name
first, and a test that imports one of them (``test_bench_sequence.py``) must get that one."""
