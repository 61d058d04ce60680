"""Skip markers for the tests that need an array framework CI may not install."""

from __future__ import annotations

import importlib.util

import pytest

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="PyTorch is not installed (CI leaves it out: a 539 MB wheel plus GBs of CUDA libs)",
)
needs_jax = pytest.mark.skipif(
    importlib.util.find_spec("jax") is None,
    reason="JAX is not installed (pip install -e '.[test]')",
)
