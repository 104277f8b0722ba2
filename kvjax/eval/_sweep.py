"""Sweeps of a task over policies x budgets x request lengths, into one results dict
(see `kvjax.eval._report` for its schema)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvjax.eviction.allocation import HeadAllocation
from kvjax.eval import _answers, _data, _report, _tasks
from kvjax.eval._cost import decode_cost
from kvjax.policies import POLICIES, get_policy
from kvjax.spec import CompressionSpec

TASKS = ("fidelity", "passkey", "multi_question", "perplexity", "retention", "bench")

# Task options passed on to the task functions when given (their defaults apply otherwise).
_OPTIONS = {
    "passkey": ("depths", "trials", "fillers"),
    "multi_question": ("facts", "trials"),
    "retention": ("depths",),
}


def bench(
    model,
    ids: Sequence[int],
    *,
    context_tokens: int,
    spec: CompressionSpec,
    decode_steps: int = 32,
    repeats: int = 3,
) -> dict:
  """Cost of one request of `context_tokens` tokens (prompt from `ids`, then
  `decode_steps` generated tokens): KV bytes held, prefill seconds, decode ms/token and
  eviction's share of the decode step (see `decode_cost`)."""
  prompt = context_tokens - decode_steps
  if prompt < 1 or len(ids) < prompt:
    raise ValueError(
        f"a {context_tokens}-token request with {decode_steps} decode steps needs a prompt of "
        f"{prompt} tokens; the text has {len(ids)}"
    )
  return decode_cost(model, list(ids[:prompt]), spec, decode_steps=decode_steps, repeats=repeats)


def expand_policies(names: Sequence[str]) -> list[str]:
  """Policy names with "all" expanded; unknown names raise ValueError."""
  out = []
  for name in names:
    for n in POLICIES if name == "all" else [name]:
      get_policy(n)  # raises on an unknown name
      if n not in out:
        out.append(n)
  if not out:
    raise ValueError("no policy given")
  return out


def check_options(task: str, options: dict) -> None:
  """Raises ValueError for a bad task option (depths, trials, facts, fillers); the CLI calls
  it before the model loads."""
  if "depths" in options:
    _tasks.check_depths(options["depths"])
  if "trials" in options:
    _tasks.check_counts(trials=options["trials"])
  if "facts" in options:
    _tasks.check_facts(options["facts"])
  if "fillers" in options:
    _tasks.check_fillers(options["fillers"])


def configurations(policies, budgets, lengths):
  """(length, policy, budget) in run order; the full cache once per length, first."""
  for length in lengths:
    if "full" in policies:
      yield length, "full", None
    for policy in policies:
      if policy != "full":
        for budget in budgets:
          yield length, policy, budget


def _base(spec: CompressionSpec | None) -> CompressionSpec:
  """`spec` without the choices each configuration makes (`_PER_CONFIG` in the CLI)."""
  if spec is None:
    return CompressionSpec()
  return spec.replace(policy="full", budget=None, threshold=None, scorer=None, allocation=None)


def _allocation_record(allocation: HeadAllocation | None) -> dict | None:
  if allocation is None:
    return None
  return {"policy": allocation.policy, "path": allocation.path and str(allocation.path)}


def sweep_allocation(
    spec: CompressionSpec | None, allocation: str | HeadAllocation | None, policies
) -> HeadAllocation | None:
  """The head allocation a sweep applies to the rows of the policy it was learned on:
  `allocation` (a directory or a HeadAllocation), else `spec`'s (a tuned spec's). ValueError
  when that policy is not among `policies` (names with options count as theirs)."""
  if allocation is None:
    return None if spec is None else spec.allocation
  if not isinstance(allocation, HeadAllocation):
    allocation = HeadAllocation.load(allocation)
  if allocation.policy not in {get_policy(p).name for p in expand_policies(policies)}:
    raise ValueError(
        f"the allocation {allocation.path or ''} was learned on policy {allocation.policy!r}, "
        f"which is not among the policies {list(policies)}"
    )
  return allocation


def configuration_specs(
    spec: CompressionSpec | None,
    policies: Sequence[str],
    budgets: Sequence[int | float | str],
    context_tokens: Sequence[int],
    *,
    threshold: float | None = None,
    scorer: str | None = None,
    allocation: str | HeadAllocation | None = None,
    resolve: bool = True,
) -> tuple[dict, dict]:
  """Every configuration's spec, {(length, policy, budget): spec}, and (with `resolve`) its
  budget in tokens, built and checked before anything runs: `spec` with each policy and
  budget (`threshold` where the budget is 'auto', `scorer` where the policy is 'learned',
  the head allocation, `sweep_allocation`, where the policy is the one it was learned on)."""
  base = _base(spec)
  allocation = sweep_allocation(spec, allocation, policies)
  names = {p: get_policy(p).name for p in expand_policies(policies)}  # "kvzip:chunk=256" is kvzip
  specs = {
      c: base.replace(
          policy=c[1],
          budget=c[2],
          threshold=threshold if c[2] == "auto" else None,
          scorer=scorer if c[1] == "learned" else None,
          allocation=allocation if allocation and allocation.policy == names[c[1]] else None,
      )
      for c in configurations(list(names), budgets, context_tokens)
  }
  kept = {c: _answers.resolve_budget(s, c[0]) for c, s in specs.items()} if resolve else {}
  return specs, kept


def run(
    task: str,
    model,
    tokenizer,
    *,
    policies: Sequence[str],
    budgets: Sequence[int | float],
    context_tokens: Sequence[int],
    ids: Sequence[int] | None = None,
    cases: list[dict] | None = None,
    options: dict | None = None,
    spec: CompressionSpec | None = None,
    threshold: float | None = None,
    scorer: str | None = None,
    allocation: str | HeadAllocation | None = None,
    config: dict | None = None,
    progress: bool = True,
    on_row: Callable[[dict], None] | None = None,
) -> dict:
  """Runs `task` for every (request length, policy, budget) and returns the results.

  `spec` holds every other compression choice (sink, page size, ...); each configuration
  is `spec` with its policy and budget (and `threshold` where the budget is 'auto', `scorer`
  where the policy is 'learned', `allocation` or `spec`'s where the policy is the one it was
  learned on). `options` are the task's own (windows, depths, ...).
  `ids` is the text (fidelity, multi_question, perplexity, retention, bench, and passkey's
  "text" filler); `cases` the user's QA records for passkey (synthetic cases otherwise).
  Every configuration is checked before any runs, so bad input fails fast; a configuration
  that crashes is recorded as failed. `on_row(results)` runs after each configuration
  (e.g. to save what finished).
  """
  from tqdm.auto import tqdm

  options = dict(options or {})
  policies = expand_policies(policies)
  _check_request(task, options, policies, budgets, context_tokens, threshold, model)
  allocation = sweep_allocation(spec, allocation, policies)
  specs, kept = configuration_specs(
      spec,
      policies,
      budgets,
      context_tokens,
      threshold=threshold,
      scorer=scorer,
      allocation=allocation,
  )
  grid = list(specs)
  base = _base(spec)
  for length in context_tokens:
    _check_data(task, tokenizer, length, ids, cases, options)

  results = _report.new_results(
      task,
      model,
      {
          **(config or {}),
          "policies": policies,
          "budgets": list(budgets),
          "context_tokens": list(context_tokens),
          "spec": {
              **{k: v for k, v in base.to_dict().items() if k not in ("policy", "budget")},
              "threshold": threshold,
              "scorer": scorer,
              # A tuned head allocation applies to its own policy's rows (configuration_specs).
              "allocation": _allocation_record(allocation),
          },
          **options,
      },
  )
  references = {}
  bar = tqdm(grid, desc=f"kvjax {task}", unit="config", disable=not progress, leave=False)
  for length, policy, budget in bar:
    bar.set_postfix_str(f"{policy} budget={budget} @{length}")
    start = time.perf_counter()
    try:
      metrics = _run_one(
          task,
          model,
          tokenizer,
          length,
          specs[length, policy, budget],
          ids,
          cases,
          options,
          references,
      )
    except Exception as err:  # noqa: BLE001 - a crashed configuration is a result too
      metrics = {"cases": 1, "failed": 1, "errors": [f"{type(err).__name__}: {err}"]}
    seconds = time.perf_counter() - start
    row = {"policy": policy, "budget": budget, "budget_tokens": kept[length, policy, budget]}
    results["rows"].append(_row(task, row, length, metrics, seconds))
    if on_row is not None:
      on_row(results)
  return results


def _check_request(task, options, policies, budgets, context_tokens, threshold, model) -> None:
  """Raises ValueError for a sweep that cannot run, before any work."""
  if task not in TASKS:
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")
  check_options(task, options)
  if any(p != "full" for p in policies) and not budgets:
    raise ValueError("policies other than 'full' need at least one --budget")
  if not context_tokens or any(not isinstance(n, int) or n < 1 for n in context_tokens):
    raise ValueError(f"context_tokens must be positive ints, got {context_tokens!r}")
  limit = model.config.max_context
  for n in context_tokens:
    if n > limit:
      raise ValueError(f"context_tokens={n} exceeds the model context {limit}")
    if task in _answers.ANSWER_TOKENS:
      _answers.check_room(model, n, _answers.ANSWER_TOKENS[task])
  if threshold is not None and "auto" not in budgets:
    raise ValueError(f"threshold={threshold} applies only with budget 'auto'")


def _row(task: str, row: dict, length: int, metrics: dict, seconds: float) -> dict:
  """One configuration's result row: its policy and budget (`row`), request length, cases
  run and failed, seconds and the task's metrics."""
  return {
      **row,
      "context_tokens": length,
      "cases": metrics["cases"],
      "failed": metrics["failed"],
      "errors": metrics["errors"],
      "seconds": round(seconds, 3),
      "metrics": {m: _number(metrics.get(m)) for m in _report.METRICS[task]},
      **({"answers": metrics["answers"]} if "answers" in metrics else {}),
  }


def _check_data(task, tokenizer, length, ids, cases, options):
  """Raises ValueError when the data cannot make a request of `length` tokens."""
  if task == "passkey":
    if cases is None:
      if ids is None and set(options.get("fillers", ())) & set(_tasks.TEXT_FILLERS):
        raise ValueError("the passkey 'text' and 'needles' fillers need text token ids")
      _tasks.passkey_cases(tokenizer, length, ids=ids, **_given(task, options))
    return
  if ids is None:
    raise ValueError(f"task {task!r} needs text token ids")
  if task == "multi_question":
    _tasks.multi_question_cases(tokenizer, ids, length, **_given(task, options))
  elif task in ("fidelity", "perplexity"):
    _data.text_windows(list(ids), length, options["continuation_tokens"], options["windows"])
  elif len(ids) < length:
    raise ValueError(f"the text has {len(ids)} tokens, too short for a {length}-token request")


def _given(task: str, options: dict) -> dict:
  """The options of `task` that were given."""
  return {k: options[k] for k in _OPTIONS.get(task, ()) if k in options}


def _number(value):
  return None if value is None else float(value)


def _run_one(task, model, tokenizer, length, spec, ids, cases, options, references):
  """One configuration."""
  if task == "passkey":
    return _tasks.passkey(
        model,
        tokenizer,
        context_tokens=length,
        spec=spec,
        ids=ids,
        cases=cases,
        **_given(task, options),
    )
  if task == "multi_question":
    return _tasks.multi_question(
        model, tokenizer, ids, context_tokens=length, spec=spec, **_given(task, options)
    )
  if task in ("fidelity", "perplexity"):
    fn = _tasks.windowed_fidelity if task == "fidelity" else _tasks.perplexity
    return fn(
        model,
        tokenizer,
        ids,
        context_tokens=length,
        continuation_tokens=options["continuation_tokens"],
        windows=options["windows"],
        spec=spec,
        references=references,
    )
  if task == "retention":
    return _tasks.instruction_retention(
        model, tokenizer, ids, context_tokens=length, spec=spec, **_given(task, options)
    )
  metrics = bench(
      model,
      ids,
      context_tokens=length,
      spec=spec,
      decode_steps=options.get("decode_steps", 32),
      repeats=options.get("repeats", 3),
  )
  return {**metrics, "cases": 1, "failed": 0, "errors": []}
