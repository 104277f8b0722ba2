"""Benchmark scripts; they print Markdown tables. They live beside the packages, outside the
wheel, and use kvjax's public API only (tests/test_packaging.py checks it). From the
repository root, either of

    python -m benchmarks.NAME [options]
    python benchmarks/NAME.py [options]

runs one (each script's docstring says what it measures and with which options)."""

from ._common import print_table

__all__ = ["print_table"]
