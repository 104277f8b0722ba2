"""Calibration data, the quality and memory of candidate settings on it, and learning a head
allocation with optax."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kvjax.eviction.allocation import HeadAllocation, transform
from kvjax.fingerprint import model_fingerprint
from kvjax.cache.pages import pages_for
from kvjax.seam import ModelShape
from kvjax.runtime.session import prefill, scored_context
from kvjax.cache.sizing import held_pages_bound, passed_pages
from kvjax.spec import CompressionSpec
from kvjax.tuning import _relax
from kvjax.tuning._workload import Item
from pallas_kernels.page_format import token_bytes

Progress = Callable[[str], None]


@dataclasses.dataclass
class Calibration:
  """Items read once with the full cache: their K/V, continuations and the full cache's
  predictions, padded to one shape; and each compress-once policy's scores of them."""

  items: list[Item]
  shape: ModelShape
  keys: np.ndarray  # [L, I, H, N, D]
  values: np.ndarray
  valid: np.ndarray  # [I, N]
  marked: np.ndarray  # [I, N]
  tokens: np.ndarray  # [I, T]
  positions: np.ndarray  # [I, T]
  weights: np.ndarray  # [I, T]
  teacher: np.ndarray | None  # [I, T, V] full-cache log-probs
  scores: dict  # policy name -> [L, I, H, N] float32

  @property
  def lengths(self) -> np.ndarray:
    return self.valid.sum(-1)


def calibrate(
    model,
    tokenizer,
    items: Sequence[Item],
    policies: Sequence[str],
    *,
    progress: Progress | None = None,
    item_done: Callable[[int, int], None] | None = None,
) -> Calibration:
  """Scores every item's context with each compress-once policy (the context's K/V come from
  the first: every policy reads the same full context) and the full cache's predictions;
  `progress(line)` and `item_done(items_done, items_total)` after each item."""
  shape = ModelShape.of(model)
  if not policies:
    raise ValueError("calibrate needs at least one compress-once policy")
  per_policy = {p: [] for p in policies}
  keys, values = [], []
  for i, item in enumerate(items):
    for p in policies:
      scored = scored_context(
          model, [item.prompt], CompressionSpec(policy=p, budget=0.5), tokenizer=tokenizer
      )
      n = len(item.ids)
      per_policy[p].append(scored.scores[:, 0, :, :n])
      if p == policies[0]:
        keys.append(scored.keys[:, 0, :, :n])
        values.append(scored.values[:, 0, :, :n])
    if progress is not None:
      progress(f"scored item {i + 1}/{len(items)} ({len(item.ids)} tokens) with {list(policies)}")
    if item_done is not None:
      item_done(i + 1, len(items))
  # Predictions of continuation[1:], from continuation[:-1] fed after the context (the first
  # continuation token's prediction is made before compression: identical to the full cache).
  conts = [np.asarray(it.continuation[:-1], np.int32) for it in items]
  weights = [
      (np.arange(len(c)) + 1 >= it.scored_from).astype(np.float32) for c, it in zip(conts, items)
  ]
  lengths = np.asarray([len(it.ids) for it in items])
  t = max(len(c) for c in conts)
  calibration = Calibration(
      items=list(items),
      shape=shape,
      keys=_relax.pad_stack(keys, 2, 0.0).transpose(1, 0, 2, 3, 4),
      values=_relax.pad_stack(values, 2, 0.0).transpose(1, 0, 2, 3, 4),
      valid=_relax.pad_stack([np.ones(n, bool) for n in lengths], 0, False),
      marked=_relax.pad_stack([np.asarray(it.marked, bool) for it in items], 0, False),
      tokens=_relax.pad_stack(conts, 0, 0),
      positions=np.stack([n + np.arange(t) for n in lengths]).astype(np.int32),
      weights=_relax.pad_stack(weights, 0, 0.0),
      teacher=None,
      scores={p: _relax.pad_stack(s, 2, 0.0).transpose(1, 0, 2, 3) for p, s in per_policy.items()},
  )
  graphdef, params = nnx.split(model)
  teacher = []
  for batch in batches(calibration, CompressionSpec()):
    teacher.append(
        np.asarray(
            _relax.teacher_logprobs(
                graphdef, params, batch, num_layers=shape.n_layers, num_heads=shape.n_kv_heads
            )
        )
    )
  calibration.teacher = np.concatenate(teacher)
  return calibration


BATCH = 4  # items per forward pass (memory: K/V of 4 contexts, logits of 4 continuations)


def batches(cal: Calibration, spec: CompressionSpec, index: Sequence[int] | None = None):
  """`_relax.Batch`es of the items (`index`: a subset), with `spec`'s protected tokens and
  budget (the full cache when it evicts nothing)."""
  index = list(range(len(cal.items))) if index is None else list(index)
  for start in range(0, len(index), BATCH):
    sel = np.asarray(index[start : start + BATCH])
    yield make_batch(cal, spec, sel)


def make_batch(cal: Calibration, spec: CompressionSpec, sel: np.ndarray) -> _relax.Batch:
  n = cal.valid.shape[1]
  lengths = cal.lengths[sel]
  windows = _windows(cal)
  full, h = int((windows == 0).sum()), cal.shape.n_kv_heads
  if spec.evicts:
    budgets = [spec.budget_tokens(cal.items[i].budget_length) for i in sel]
    recent = np.asarray([spec.recent_tokens(b) for b in budgets])
    idx = np.arange(n)
    fixed = cal.marked[sel] | (idx < spec.sink) | (idx >= (lengths - recent)[:, None])
    kept = np.asarray(budgets) * full * h
  else:
    fixed = np.ones((len(sel), n), bool)
    kept = lengths * full * h
  return _relax.Batch(
      keys=jnp.asarray(cal.keys[:, sel]),
      values=jnp.asarray(cal.values[:, sel]),
      valid=jnp.asarray(cal.valid[sel]),
      fixed=jnp.asarray(fixed & cal.valid[sel]),
      tokens=jnp.asarray(cal.tokens[sel]),
      positions=jnp.asarray(cal.positions[sel]),
      weights=jnp.asarray(cal.weights[sel]),
      teacher=jnp.asarray(cal.teacher[sel]) if cal.teacher is not None else None,
      kept=jnp.asarray(kept, jnp.int32),
      window=jnp.asarray(windows, jnp.int32),
  )


def _windows(cal: Calibration) -> np.ndarray:
  """[L] each layer's sliding window, 0 for a full layer."""
  return np.asarray(cal.shape.layer_windows, np.int64)


def _held_tokens(cal: Calibration, counts: np.ndarray, index, page_size: int) -> np.ndarray:
  """[L, I, H] tokens each sequence holds once the context is read: `counts` (what the
  masks keep) on the full layers; on a sliding layer, its window's latest tokens in whole
  pages (`kvjax.eviction.slide` frees only the pages the window has wholly passed)."""
  windows = _windows(cal)[:, None, None]
  lengths = cal.lengths[np.asarray(index)][None, :, None]
  held = lengths - passed_pages(lengths, windows, page_size) * page_size
  return np.where(windows > 0, held, counts)


@dataclasses.dataclass(frozen=True)
class Measured:
  """A setting's quality and memory on a set of items."""

  kl: float  # mean over items of the mean KL(full || compressed) per scored prediction
  kl_se: float  # its standard error over items
  agree: float  # share of items whose every scored prediction has the full cache's top token
  kv_bytes: float  # mean K/V bytes held per item once its context is compressed
  kv_bytes_max: int
  # The most any request of these lengths can hold at this setting, whatever its content:
  # kept tokens rounded up to whole pages per sequence (what a memory target is held to).
  kv_bytes_bound: int
  kept_fraction: float  # mean share of the context's K/V entries kept
  kl_items: tuple[float, ...]
  agree_items: tuple[bool, ...]


def evaluate_once(
    model,
    cal: Calibration,
    spec: CompressionSpec,
    index: Sequence[int] | None = None,
    judge: dict | None = None,
) -> Measured:
  """A compress-once spec (optionally with an allocation) on the calibrated items, exactly
  (hard masks), without prefilling anything again. `judge` maps items to the allocation
  that ranks them instead of the spec's (cross-fitting: one never trained on the item)."""
  graphdef, params = nnx.split(model)
  index = list(range(len(cal.items))) if index is None else list(index)
  scores = cal.scores[spec.policy.name]
  kls, agrees, counts = [], [], []
  for start in range(0, len(index), BATCH):
    sel = np.asarray(index[start : start + BATCH])
    batch = make_batch(cal, spec, sel)
    raw = jnp.asarray(scores[:, sel])
    if judge is not None:
      ranked = jnp.concatenate(
          [judge[int(i)].rank(raw[:, k : k + 1]) for k, i in enumerate(sel)], axis=1
      )
    else:
      ranked = raw if spec.allocation is None else spec.allocation.rank(raw)
    kl, agree, kept = _relax.hard_eval(graphdef, params, batch, ranked, spec.sharing)
    kls.extend(np.asarray(kl).tolist())
    agrees.extend(np.asarray(agree).tolist())
    counts.append(np.asarray(kept))  # [L, b, H]
  counts = np.concatenate(counts, axis=1)
  return _measured(cal, spec, index, kls, agrees, counts)


def _standard_error(values) -> float:
  values = np.asarray(values, np.float64)
  return float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else 0.0


def _page_bytes(cal: Calibration, spec: CompressionSpec) -> int:
  kv_dtype = spec.kv_dtype or cal.shape.dtype
  return 2 * spec.page_size * token_bytes(cal.shape.head_dim, kv_dtype)


def _bytes_bound(cal: Calibration, spec: CompressionSpec, index) -> int:
  """The most bytes any item of `index` can hold at `spec`, whatever its content: the full
  layers' sequences under the budget, the sliding layers' their windows."""
  h = cal.shape.n_kv_heads
  full = int((_windows(cal) == 0).sum()) * h
  windows_only = _held_tokens(
      cal, np.zeros((cal.shape.n_layers, len(index), h)), index, spec.page_size
  )
  window_pages = pages_for(windows_only, spec.page_size).sum((0, 2))  # [items]
  pages = max(
      _page_bound(spec, cal.items[i].budget_length, full) + int(w)
      for i, w in zip(index, window_pages)
  )
  return pages * _page_bytes(cal, spec)


def _measured(cal, spec, index, kls, agrees, counts) -> Measured:
  counts = _held_tokens(cal, counts, index, spec.page_size)
  held = pages_for(counts, spec.page_size).sum((0, 2)) * _page_bytes(cal, spec)  # [items]
  lengths = cal.lengths[np.asarray(index)]
  kept = counts.sum((0, 2)) / (lengths * cal.shape.n_layers * cal.shape.n_kv_heads)
  return Measured(
      kl=float(np.mean(kls)),
      kl_se=_standard_error(kls),
      agree=float(np.mean(agrees)),
      kv_bytes=float(held.mean()),
      kv_bytes_max=int(held.max()),
      kv_bytes_bound=_bytes_bound(cal, spec, index),
      kept_fraction=float(kept.mean()),
      kl_items=tuple(float(k) for k in kls),
      agree_items=tuple(bool(a) for a in agrees),
  )


def _page_bound(spec: CompressionSpec, length: int, sequences: int) -> int:
  """Most pages a request of `length` tokens holds once its context is read."""
  budget = spec.budget_tokens(length) if spec.evicts else None
  return held_pages_bound(
      length, budget, sequences=sequences, page_size=spec.page_size, once=spec.once
  )


def evaluate_running(
    model,
    cal: Calibration,
    spec: CompressionSpec,
    index: Sequence[int] | None = None,
    tokenizer=None,
) -> Measured:
  """A spec whose policy evicts while it reads: each item prefilled and fed its
  continuation for real (`kvjax.eval.continuation_logits`: eviction while reading and
  decoding applies), against the calibrated full-cache predictions."""
  from kvjax.eval._fidelity import continuation_logits
  from kvjax.eval._answers import at_budget

  index = list(range(len(cal.items))) if index is None else list(index)
  kls, agrees, held, kept = [], [], [], []
  for i in index:
    item = cal.items[i]
    stats = {}
    logits, _ = continuation_logits(
        model,
        item.prompt,
        item.continuation,
        at_budget(spec, item.budget_length),
        tokenizer=tokenizer,
        stats=stats,
    )
    held.append(stats["kv_bytes"])
    kept.append(stats["kept_fraction"])
    kl, agree = _scored_kl(cal, i, cal.teacher[i, : len(item.continuation) - 1], logits)
    kls.append(kl)
    agrees.append(agree)
  return Measured(
      kl=float(np.mean(kls)),
      kl_se=_standard_error(kls),
      agree=float(np.mean(agrees)),
      kv_bytes=float(np.mean(held)),
      kv_bytes_max=int(np.max(held)),
      kv_bytes_bound=_bytes_bound(cal, spec, index),
      kept_fraction=float(np.mean(kept)),
      kl_items=tuple(kls),
      agree_items=tuple(agrees),
  )


# ---- learning an allocation --------------------------------------------------------------


def learn_allocation(
    model,
    cal: Calibration,
    spec: CompressionSpec,
    *,
    index: Sequence[int] | None = None,
    steps: int = 60,
    learning_rate: float = 0.1,
    temperatures: tuple[float, float] = (1.0, 0.1),
    l2: float = 0.03,
    progress: Progress | None = None,
) -> HeadAllocation:
  """Per-(layer, kv head) offsets for `spec`'s policy at `spec`'s budget, by Adam on the
  relaxed loss (soft keep-masks whose temperature anneals geometrically between
  `temperatures`), over the items `index`, a minibatch of `BATCH` per step, from zeros (the
  policy's own ranking)."""
  graphdef, params = nnx.split(model)
  index = list(range(len(cal.items))) if index is None else list(index)
  raw = cal.scores[spec.policy.name]
  # The ranked entries only: a sliding layer's scores (0 where its window freed the token)
  # would set the transform and the scale the temperatures and l2 are in units of.
  ranked = (_windows(cal) == 0)[:, None, None, None]
  valid = np.broadcast_to(cal.valid[None, :, None, :] & ranked, raw.shape)
  log_scores = bool((raw[valid] >= 0).all())
  z = transform(raw, log_scores, 1.0)
  scale = float(np.std(z[valid])) or 1.0
  z = (z / scale).astype(np.float32)
  l, h = cal.shape.n_layers, cal.shape.n_kv_heads
  offsets = jnp.zeros((l, h), jnp.float32)
  optimizer = optax.adam(learning_rate)
  opt_state = optimizer.init(offsets)
  grad_fn = jax.jit(jax.value_and_grad(_relax.relaxed_loss), static_argnames=("graphdef",))
  rng = np.random.default_rng(0)
  hi, lo = temperatures
  first = last = None
  for step in range(steps):
    temperature = hi * (lo / hi) ** (step / max(steps - 1, 1))
    sel = np.sort(rng.choice(index, size=min(BATCH, len(index)), replace=False))
    batch = make_batch(cal, spec, sel)
    loss, grads = grad_fn(offsets, graphdef, params, batch, jnp.asarray(z[:, sel]), temperature, l2)
    if not bool(jnp.isfinite(grads).all()):
      raise FloatingPointError(f"the relaxed loss has a non-finite gradient at step {step}")
    updates, opt_state = optimizer.update(grads, opt_state, offsets)
    offsets = optax.apply_updates(offsets, updates)
    last = float(loss)
    first = last if first is None else first
    if progress is not None and (step % 10 == 0 or step == steps - 1):
      progress(
          f"  step {step + 1}/{steps}: relaxed KL {float(loss):.4f} (temperature "
          f"{temperature:.3f})"
      )
  offsets = np.asarray(_relax.centred(offsets, jnp.asarray(_windows(cal) == 0)))
  return HeadAllocation(
      offsets=offsets,
      policy=spec.policy.name,
      log_scores=log_scores,
      scale=scale,
      model=str(getattr(model.config, "name", type(model).__name__)),
      fingerprint=model_fingerprint(model),
      metrics={
          "steps": steps,
          "budget": spec.budget,
          "l2": l2,
          "relaxed_kl_first": first,
          "relaxed_kl_last": last,
      },
  )


def mean_allocation(allocations: Sequence[HeadAllocation]) -> HeadAllocation:
  """The mean of allocations learned for one policy on one calibration (same transform)."""
  first = allocations[0]
  return dataclasses.replace(
      first,
      offsets=np.mean([a.offsets for a in allocations], axis=0),
      metrics={"parts": [a.metrics for a in allocations]},
      path=None,
  )


def fractions(low: float = 0.04, high: float = 0.7, count: int = 9) -> list[float]:
  """Budgets (fractions of the context) spaced evenly in log space."""
  return [round(float(x), 4) for x in np.geomspace(low, high, count)]


def _scored_kl(cal: Calibration, i: int, teacher, logits) -> tuple[float, bool]:
  """KL of item i's scored predictions of continuation[1:] (`logits` [T, V]: all of the
  continuation's, the first made before compression) against `teacher` log-probs [T-1, V],
  and whether every scored top token is the teacher's (as `_relax.hard_eval` judges)."""
  teacher = jnp.asarray(teacher, jnp.float32)
  got = jax.nn.log_softmax(jnp.asarray(logits[1:], jnp.float32), -1)
  weights = jnp.asarray(cal.weights[i, : teacher.shape[0]])
  kl = float(_relax.kl_per_item(teacher[None], got[None], weights[None])[0])
  same = (jnp.argmax(got, -1) == jnp.argmax(teacher, -1)) | (weights == 0)
  return kl, bool(same.all())


def held_out_check(
    model, tokenizer, cal: Calibration, spec: CompressionSpec, index, references=None
) -> dict:
  """`spec` on held-out items with the real pipeline, as `kvjax.eval` runs it: the context
  prefilled (and compressed) by `kvjax.prefill` with the budget resolved per request, then
  the continuation teacher-forced (KL against the full cache run the same way, over the same
  predictions as the tuning items) or the question answered greedily (accuracy).
  `references` (a dict) keeps the full cache's logits per item for the next call."""
  from kvjax.eval._fidelity import continuation_logits
  from kvjax.eval._answers import ask, at_budget

  kls, correct, held = [], [], []
  for i in index:
    item = cal.items[i]
    resolved = at_budget(spec, item.budget_length) if spec.evicts else spec
    if item.question is None:
      ids, cont = list(item.ids), list(item.continuation)
      references = {} if references is None else references
      if i not in references:
        references[i] = continuation_logits(model, ids, cont, spec.full_cache())[0]
      reference = references[i]
      stats = {}
      logits, _ = continuation_logits(model, ids, cont, resolved, tokenizer=tokenizer, stats=stats)
      held.append(stats["kv_bytes"])
      teacher = jax.nn.log_softmax(jnp.asarray(reference[1:], jnp.float32), -1)
      kls.append(_scored_kl(cal, i, teacher, logits)[0])
    else:
      question = list(item.continuation[: item.scored_from])
      answer_tokens = len(item.continuation) - item.scored_from
      state = prefill(
          model, [item.prompt], resolved, tokenizer=tokenizer, reserve=len(question) + 64
      )
      held.append(state.kv_bytes())
      text, _, _ = ask(
          model, tokenizer, state, question, max_new_tokens=max(answer_tokens, 24), donate=True
      )
      correct.append(item.correct(text))
  out = {
      "items": len(index),
      "kv_mib": round(float(np.mean(held)) / 2**20, 4),
      "kv_bytes_max": int(np.max(held)),
  }
  if kls:
    out["kl"] = round(float(np.mean(kls)), 6)
    out["kl_se"] = round(_standard_error(kls), 6)
  if correct:
    out["accuracy"] = round(float(np.mean(correct)), 4)
  return out
