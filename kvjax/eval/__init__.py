"""Evaluation harness: quality of a compressed cache against the full cache, and its cost.

Stable API (other tools call it):

- `fidelity`, `continuation_logits`, `compare_predictions`: full vs compressed cache on the
  same text (KL, top-1 agreement, perplexities);
- `answer`: a greedy answer to a question about a compressed context; `context_prompt` and
  `answer_from_state`: the same in two steps, around a state kept or saved in between;
- tasks `passkey`, `multi_question` (one compressed context, several questions),
  `perplexity`, `instruction_retention`, `windowed_fidelity`;
- `bench` / `decode_cost`: KV bytes, prefill seconds, decode ms/token, eviction share;
- `run_sweep` (policies x budgets x request lengths) and `write_results` (results.json,
  results.md, PNG plots; schema in `kvjax.eval._report`, checked by `validate_results`);
- `default_text`: the shipped public-domain text used when no data is given;
  `DEFAULT_TEXT_SOURCE` says what it is (for reports).
"""

from kvjax.eval._cost import decode_cost
from kvjax.eval._data import DEFAULT_TEXT_SOURCE, default_text
from kvjax.eval._fidelity import compare_predictions, continuation_logits, fidelity
from kvjax.eval._report import METRICS, SCHEMA
from kvjax.eval._report import validate as validate_results
from kvjax.eval._report import write as write_results
from kvjax.eval._sweep import TASKS, bench
from kvjax.eval._sweep import run as run_sweep
from kvjax.eval._answers import answer, answer_from_state, context_prompt, resolve_budget
from kvjax.eval._tasks import (
    instruction_retention,
    multi_question,
    passkey,
    perplexity,
    windowed_fidelity,
)

__all__ = [
    "DEFAULT_TEXT_SOURCE",
    "METRICS",
    "SCHEMA",
    "TASKS",
    "answer",
    "answer_from_state",
    "bench",
    "compare_predictions",
    "context_prompt",
    "continuation_logits",
    "decode_cost",
    "default_text",
    "fidelity",
    "instruction_retention",
    "multi_question",
    "passkey",
    "perplexity",
    "resolve_budget",
    "run_sweep",
    "validate_results",
    "windowed_fidelity",
    "write_results",
]
