"""Helpers that several test files share (fixtures live in ``conftest.py``). The test files
import them as ``helpers.NAME``: pytest puts ``python/tests`` on ``sys.path``."""
