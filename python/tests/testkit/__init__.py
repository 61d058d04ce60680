"""Helpers that several test files share (fixtures live in ``conftest.py``). The test files
import them as ``testkit.NAME``: pytest puts ``python/tests`` on ``sys.path``. Not named
``helpers``: a name that generic is easily shadowed by another top-level module on
``sys.path``."""
