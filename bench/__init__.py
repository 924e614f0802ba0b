"""Benchmarks of the duplexq pipeline, each figure against its reference.

Run with ``python -m bench`` (see ``bench/__main__.py``); results go to
``bench/results.json`` and ``docs/benchmarks.md``. Not collected by pytest.
"""
