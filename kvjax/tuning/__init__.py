"""`kvjax tune`: picks the compression for a workload from a sample of it.

    result = kvjax.tune(model, tokenizer, text=sample, target="kl=0.05")
    result.write("tuned/")            # tuned.json, allocation/, front.png
    spec = kvjax.load_spec("tuned/tuned.json", model)

The sample becomes items (a context, then a continuation: the next text, or a question and
the full cache's answer), split into a tuning part and a held-out part. On the tuning part:

1. every candidate policy at budgets spaced in log space (compress-once policies exactly and
   cheaply from one scoring of each context, `_relax`; the others by real runs, first at
   the best compress-once budget and, where they meet the target there, at the budgets
   below it), which gives each policy's smallest budget that meets the target (the "best
   fixed setting");
2. for the best compress-once policy, a head allocation learned with optax (`_search.
   learn_allocation`: offsets per layer and kv head through a soft, annealed keep-mask,
   minimising KL to the full cache at the budget), trained on one half of the tuning items
   and judged on the other, and the smallest budget that meets the target with it, in
   whole pages; page sizes are compared on the kept counts;
3. the chosen setting with quantized K/V pages (`kv_dtypes`, int8 and int4): a quantized
   token takes a fraction of the bytes, so a larger budget in int8 may hold less than the
   float setting; each dtype's smallest budget meeting the target is measured by real runs
   (quantization changes what attention reads: the relaxation cannot see it), and kept
   where it holds fewer bytes.

The chosen setting is the one that meets the target with the least memory (or, for a memory
target, the lowest KL within it). The held-out part then checks the chosen setting and the
best fixed one with the real pipeline (`kvjax.prefill`, teacher-forced continuations or
generated answers): the numbers a user should believe.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from kvjax.fingerprint import model_fingerprint
from kvjax.seam import ModelShape
from kvjax.spec import CompressionSpec
from kvjax.tuning._eta import STEPS, Clock
from kvjax.tuning._result import Point, TuneResult, plot_front
from kvjax.tuning._settings import Search, at, best, better, choose, closest, pareto
from kvjax.tuning._spec_file import load_spec
from kvjax.tuning._target import Target, accuracy_bound, items_for_accuracy, parse_target
from kvjax.tuning._workload import question_items, split, text_items
from kvjax.tuning.scorer_training import train_scorer
from pallas_kernels.page_format import QUANTIZED_DTYPES

__all__ = [
    "Point",
    "Target",
    "TuneResult",
    "accuracy_bound",
    "items_for_accuracy",
    "load_spec",
    "parse_target",
    "plot_front",
    "train_scorer",
    "tune",
]


def tune(
    model,
    tokenizer,
    *,
    text: str | Sequence[int] | None = None,
    cases: Sequence[dict] | None = None,
    target: str | Target = "kl=0.05",
    policies: Sequence[str] = ("kvzip", "expected_attention", "snapkv", "h2o"),
    context_tokens: int = 1024,
    continuation_tokens: int = 32,
    max_items: int = 24,
    held_out: float = 0.34,
    steps: int = 40,
    page_sizes: Sequence[int] = (8, 16, 32),
    kv_dtypes: Sequence[str] = ("int8", "int4"),
    progress: Callable[[str], None] | None = print,
) -> TuneResult:
  """Chooses a `CompressionSpec` for a workload sample (see the module docstring).

  Args:
    text: continuation-fidelity sample (the target is then usually `kl=`).
    cases: question cases, {"context": text or ids, "question", "answer" (optional), "cue"
      (optional: how a plain-text model's answer starts, `kvjax.eval._answers.encode_question`)}.
    target: `Target` or 'kl=X' | 'accuracy=X' | 'memory=SIZE'.
    policies: candidates (compress-once ones are scored exactly; the others run for real).
    context_tokens: the context of each text window, in tokens (the windows are evenly
      spread over the text).
    continuation_tokens: the continuation of each text window, in tokens.
    max_items: at most this many items (text windows, or the first cases).
    held_out: share of the items kept for the final check.
    steps: optax steps of each half's allocation.
    kv_dtypes: quantized K/V dtypes to try the chosen setting with (() for none).
  """
  for kv_dtype in kv_dtypes:
    if kv_dtype not in QUANTIZED_DTYPES:
      raise ValueError(f"kv_dtypes must hold some of {QUANTIZED_DTYPES}, got {kv_dtype!r}")
  started = time.perf_counter()
  say = progress or (lambda _: None)
  target = parse_target(target) if isinstance(target, str) else target
  once, running = _check_request(model, text, cases, target, policies)
  if cases is not None:
    cases = list(cases)[:max_items]  # read once: an iterator is not consumed twice
    _check_accuracy_sample(target, len(cases), held_out)
  items = _items(
      model, tokenizer, text, cases, target, say, context_tokens, continuation_tokens, max_items
  )
  tune_items, held_items = split(items, held_out)
  items = tune_items + held_items
  say(
      f"{len(items)} items ({len(tune_items)} to tune on, {len(held_items)} held out); "
      f"target {target}"
  )
  clock = Clock(say, [s for s in STEPS if s != "kv_dtype" or kv_dtypes])
  clock.step("calibrate")
  search = Search(model, tokenizer, items, target, say, once, item_done=clock.advance)
  timing = {"calibrate_s": round(time.perf_counter() - started, 1)}
  tune_idx = list(range(len(tune_items)))
  chosen, baseline, reachable, why = _choose_setting(
      search, once, running, tune_idx, steps, page_sizes, kv_dtypes, timing, clock
  )
  say(why)
  # 4. The held-out check, with the real pipeline.
  clock.step("held_out")
  check_started = time.perf_counter()
  held = search.held_out_check(chosen.spec, baseline, list(range(len(tune_items), len(items))))
  timing["held_out_s"] = round(time.perf_counter() - check_started, 1)
  timing["total_s"] = round(time.perf_counter() - started, 1)
  return TuneResult(
      spec=chosen.spec,
      target=target,
      reachable=reachable,
      why=why,
      chosen=chosen,
      baseline=baseline,
      front=pareto(search.tried),
      points=search.tried,
      held_out=held,
      sample={
          "items": len(items),
          "tune_items": len(tune_items),
          "held_out_items": len(held_items),
          "kind": "text" if text is not None else "questions",
          "context_tokens": [len(it.ids) for it in items],
          "sample_tokens": len(tokenizer.encode(text)) if isinstance(text, str) else None,
      },
      timing=timing,
      model=str(getattr(model.config, "name", type(model).__name__)),
      fingerprint=model_fingerprint(model),
  )


def _choose_setting(
    search: Search,
    once,
    running,
    tune_idx,
    steps,
    page_sizes,
    kv_dtypes,
    timing: dict,
    clock: Clock | None = None,
) -> tuple[Point, Point | None, bool, str]:
  """Steps 1-3 of the module docstring on the tuning items: (the chosen point, the best
  fixed setting, whether the target is reachable, why in words); `timing` gets each step's
  seconds, `clock` hears where the run is."""
  target = search.target
  step = clock.step if clock is not None else lambda _: None
  step("fixed")
  started = time.perf_counter()
  # 1. Every policy with its defaults: the best fixed setting.
  fixed, best_once = search.fixed_settings(once, running, tune_idx)
  baseline = best(fixed.values(), target)
  timing["fixed_s"] = round(time.perf_counter() - started, 1)

  # 2. A learned allocation for the best compress-once policy, at its budget.
  step("learn")
  learn_started = time.perf_counter()
  start_from = (best_once or closest(search.tried, target)).spec
  policy = start_from.policy.name
  learned, judge = search.learned_setting(policy, start_from.budget, tune_idx, steps)
  plain = fixed.get(policy)
  if learned is not None and (plain is None or better(learned, plain, target)):
    learned = search.at_best_page_size(learned, page_sizes, tune_idx, judge)
  else:
    learned = None
  timing["learn_s"] = round(time.perf_counter() - learn_started, 1)
  chosen, why = choose(learned, plain, baseline, policy, target)
  if chosen is None:
    chosen = closest(search.tried, target)
    nearest = (
        f"the smallest: {chosen.spec.policy.name} at budget {chosen.spec.budget}, at most "
        f"{chosen.measured.kv_bytes_bound / 2**20:.2f} MiB per request"
        if target.metric == "memory"
        else f"the best: {chosen.spec.policy.name} at budget {chosen.spec.budget}, KL "
        f"{chosen.measured.kl:.4f}"
    )
    why = (
        f"no setting tried meets {target} ({nearest}); the target is not reachable with these "
        "policies: the closest setting is written, marked unreachable"
    )
    return chosen, baseline, False, why
  # 3. The chosen setting with quantized pages, where it holds less.
  if kv_dtypes:
    step("kv_dtype")
    quantized_started = time.perf_counter()
    quantized = search.quantized_setting(chosen, kv_dtypes, tune_idx[:8])
    timing["kv_dtype_s"] = round(time.perf_counter() - quantized_started, 1)
    if quantized is not None:
      chosen = quantized
      runs = f"(real runs on {quantized.items} items)"
      if target.metric == "memory":
        why += (
            f"; stored as {quantized.spec.kv_dtype} pages, a larger budget fits with a lower "
            f"KL: {at(quantized, kl=True)} {runs}"
        )
      else:
        why += (
            f"; stored as {quantized.spec.kv_dtype} pages it meets {target} at budget "
            f"{quantized.spec.budget} in {quantized.measured.kv_bytes / 2**20:.2f} MiB {runs}"
        )
  return chosen, baseline, True, why


def _items(
    model, tokenizer, text, cases, target, say, context_tokens, continuation_tokens, max_items
):
  """The workload's items: windows of the text sample, or the question cases answered by
  the full cache."""
  if text is not None:
    return text_items(
        tokenizer,
        text,
        context_tokens=context_tokens,
        continuation_tokens=continuation_tokens,
        max_items=max_items,
    )
  items = question_items(model, tokenizer, cases, progress=say)
  if target.metric == "accuracy":
    full_accuracy = np.mean([it.correct(it.full_answer) for it in items])
    say(f"full cache: accuracy {full_accuracy:.2f} on {len(items)} cases")
  return items


def _check_request(model, text, cases, target, policies) -> tuple[list[str], list[str]]:
  """(compress-once, running) policy names; errors for a request that cannot run, before
  any work."""
  if not isinstance(target, Target):
    raise TypeError(f"target must be a str or kvjax.tuning.Target, got {type(target).__name__}")
  if (text is None) == (cases is None):
    raise ValueError("give a text sample (text=) or question cases (cases=), not both or neither")
  if target.metric == "accuracy" and text is not None:
    raise ValueError(
        "target accuracy needs question cases (cases=); a text sample takes kl= or memory="
    )
  for p in policies:
    CompressionSpec(policy=p, budget=0.5)  # unknown names fail here
  once = [p for p in policies if CompressionSpec(policy=p, budget=0.5).once]
  if not once:
    raise ValueError(f"policies {list(policies)} include no compress-once policy (e.g. kvzip)")
  windows = ModelShape.of(model).windows  # TypeError for what is not a kvjax model
  if windows and all(windows):
    raise ValueError(
        f"every layer of this model slides a window ({len(windows)} of {len(windows)}): no "
        "policy compresses a sliding layer, so there is nothing for kvjax tune to choose"
    )
  return once, [p for p in policies if p not in once]


def _check_accuracy_sample(target: Target, num_cases: int, held_out: float) -> None:
  """An accuracy target needs enough tuning items to be told apart from chance."""
  if target.metric != "accuracy":
    return
  n_tune = len(split([None] * num_cases, held_out)[0])
  need = items_for_accuracy(target.value)
  if n_tune < need:
    raise ValueError(
        f"target {target} needs at least {need} tuning items (a perfect score on n items "
        f"bounds accuracy at n/(n+1)); {num_cases} cases hold out "
        f"{held_out:g} and leave {n_tune}: give about {int(np.ceil(need / (1 - held_out))) + 1} "
        "cases (max_items, --items)"
    )
