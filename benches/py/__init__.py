"""The benchmark scripts. Each one also runs on its own (``python benches/py/NAME.py``) with
any interpreter that has numpy and an ``echo``; ``python -m benches`` imports them. What they
share is in ``helpers.py``; ``compare.py`` prints the ratios between two of their results."""
