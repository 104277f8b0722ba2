"""Evaluation harness: quality of a compressed cache against the full cache, and its cost.

Stable API (other tools call it): `fidelity`, `continuation_logits`, `compare_predictions`.
"""

from kvjax.eval._fidelity import compare_predictions, continuation_logits, fidelity

__all__ = ["compare_predictions", "continuation_logits", "fidelity"]
