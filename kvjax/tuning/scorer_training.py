"""Training the `learned` policy's scorer (KVzap-style) with optax.

    scorer = kvjax.tuning.scorer_training.train_scorer(model, ids, model_name=models.DEFAULT_MODEL)
    scorer.save("my-scorer")            # orbax-checkpoint; `--scorer my-scorer` uses it

For windows of text, the targets are the log of `kvzip`'s scores (the most attention any
query pays a key while the model repeats the context) and the features the hidden states
entering each layer; a linear map per layer is fitted by Adam on the mean squared error.
A share of the windows is held out: the reported metrics are measured on them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kvjax.eval._data import text_windows
from kvjax.eviction.sliding import in_window
from kvjax.seam import ModelShape
from kvjax.policies.learned import Scorer, normalise
from kvjax.fingerprint import model_fingerprint
from kvjax.runtime.session import context_scores
from kvjax.spec import CompressionSpec
from kvjax._checks import check_int

LOG_FLOOR = 1e-6  # kvzip scores are attention probabilities: log(max(score, floor))


@partial(jax.jit, static_argnames="graphdef")
def _hidden_states(params, ids, *, graphdef):
  """[L, T, d]: the hidden state entering every layer, for one row of ids [1, T] (dense
  causal attention, within its window on a sliding layer: no cache needed to read a window
  of text once)."""
  model = nnx.merge(graphdef, params)
  t = ids.shape[1]
  behind = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]  # [T, S]
  windows = jnp.asarray(ModelShape.of(model).layer_windows, jnp.int32)

  def attend(q, k, v, record, layer):  # q [1, T, Hq, D], k/v [1, T, Hkv, D]
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    window = windows[layer]  # a sliding layer's query sees only its window
    seen = in_window(behind, window)
    probs = jax.nn.softmax(jnp.where(seen, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs, v).astype(q.dtype), record

  def after_layer(record, layer, h_in, h_out):
    return record.at[layer].set(h_in[0].astype(jnp.float32))

  d = model.config.d_model
  record = jnp.zeros((model.config.n_layers, t, d), jnp.float32)
  _, record = model.run(
      ids, jnp.arange(t)[None], record, attend, after_layer=after_layer, logits_at=jnp.zeros(1, int)
  )
  return record


def full_layers(model) -> np.ndarray:
  """[L] the layers a scorer ranks: a sliding layer holds its window, no policy scores it
  (its targets are 0 and its weights stay 0)."""
  return np.asarray([w == 0 for w in ModelShape.of(model).layer_windows])


def training_pairs(
    model, tokenizer, ids: Sequence[int], *, sink: int = 4
) -> tuple[np.ndarray, np.ndarray]:
  """(features [L, T', d], targets [L, T', H]) for one window of text ids: normalised hidden
  states and log kvzip scores, without the first `sink` tokens (always kept, never scored);
  on a sliding layer (`full_layers`) both are 0."""
  if not isinstance(getattr(model.config, "d_model", None), int):
    raise TypeError(
        f"{type(model).__name__}.config needs d_model (the hidden size) to train a scorer"
    )
  graphdef, params = nnx.split(model)
  hidden = _hidden_states(params, jnp.asarray([list(ids)], jnp.int32), graphdef=graphdef)
  spec = CompressionSpec(policy="kvzip", budget=0.5, sink=sink)
  scores, valid = context_scores(model, [list(ids)], spec, tokenizer=tokenizer)
  n = len(ids)
  scores = scores[:, 0, :, :n].transpose(0, 2, 1)  # [L, T, H]
  full = full_layers(model)
  if not valid[full, 0, :, :n].all():
    raise RuntimeError("kvzip scoring lost tokens of the window")  # a bug, not bad input
  features = np.array(normalise(hidden))[:, sink:]
  targets = np.log(np.maximum(scores, LOG_FLOOR))[:, sink:]
  features[~full], targets[~full] = 0.0, 0.0
  return features, targets.astype(np.float32)


def _fit(
    features: np.ndarray,
    targets: np.ndarray,
    *,
    steps: int,
    batch: int,
    learning_rate: float,
    seed: int,
    progress: Callable[[int, float], None] | None,
    layers: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Per-layer linear regression [L, d] -> [L, H] by Adam on the mean squared error over
  `layers` ([L] bool; all by default), over minibatches of `batch` tokens (all layers at
  once). Returns (weight [L, d, H], bias [L, H])."""
  l, n, d = features.shape
  counted = jnp.asarray(np.ones(l, bool) if layers is None else layers, jnp.float32)
  h = targets.shape[-1]
  params = {
      "weight": jnp.zeros((l, d, h), jnp.float32),
      "bias": jnp.asarray(targets.mean(axis=1)),  # start at each layer-head's mean log-score
  }
  schedule = optax.cosine_decay_schedule(learning_rate, steps, alpha=0.05)
  optimizer = optax.adam(schedule)
  state = optimizer.init(params)
  # Shuffled once; step i reads the i-th contiguous minibatch (a slice, not a gather).
  order = np.random.default_rng(seed).permutation(n)
  x_all, y_all = jnp.asarray(features[:, order]), jnp.asarray(targets[:, order])
  batches = max(1, n // batch)

  def loss_fn(params, x, y):  # x [L, N, d], y [L, N, H]
    pred = jnp.einsum("lnd,ldh->lnh", x, params["weight"]) + params["bias"][:, None]
    error = jnp.mean((pred - y) ** 2, axis=(1, 2))  # [L]
    return (error * counted).sum() / counted.sum()

  @jax.jit
  def step(params, state, x_all, y_all, i):
    start = (i % batches) * batch
    x = jax.lax.dynamic_slice_in_dim(x_all, start, batch, axis=1)
    y = jax.lax.dynamic_slice_in_dim(y_all, start, batch, axis=1)
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  for i in range(steps):
    params, state, loss = step(params, state, x_all, y_all, jnp.int32(i))
    if progress is not None and (i % 50 == 0 or i == steps - 1):
      progress(i + 1, float(loss))
  return np.asarray(params["weight"]), np.asarray(params["bias"])


def evaluate(
    scorer: Scorer, features: np.ndarray, targets: np.ndarray, keep: float = 0.25, layers=None
):
  """Held-out quality on `layers` ([L] bool; all by default): mean squared error and R^2 of
  the log-scores, and the share of the `keep` best tokens by kvzip (one ranking over those
  layers and all heads of each window) that the scorer also ranks in its best `keep`
  (features/targets: lists of per-window arrays)."""
  errors, overlaps, variance = [], [], []
  for x, y in zip(features, targets):
    chosen = np.arange(len(x)) if layers is None else np.flatnonzero(layers)
    pred = np.stack([np.asarray(scorer.predict(jnp.asarray(x[i]), i)) for i in chosen])
    y = y[chosen]
    errors.append(np.mean((pred - y) ** 2))
    variance.append(np.var(y))
    k = max(1, int(keep * y.size))
    best_true = set(np.argpartition(-y.ravel(), k - 1)[:k].tolist())
    best_pred = np.argpartition(-pred.ravel(), k - 1)[:k].tolist()
    overlaps.append(len(best_true.intersection(best_pred)) / k)
  mse = float(np.mean(errors))
  return {
      "mse": float(f"{mse:.4g}"),
      "r2": round(1.0 - mse / float(np.mean(variance)), 4),
      f"top{int(keep * 100)}_overlap": round(float(np.mean(overlaps)), 4),
  }


def check_options(model=None, *, context_tokens: int, windows: int, held_out: float) -> None:
  """ValueError for options `train_scorer` cannot use (`model`: also its context limit)."""
  check_int("context_tokens", context_tokens, 16)
  check_int("windows", windows, 2)
  if not 0.0 < held_out < 1.0:
    raise ValueError(f"held_out must be a fraction in (0, 1), got {held_out!r}")
  if int(round(held_out * windows)) >= windows:
    raise ValueError(f"held_out={held_out} leaves none of the {windows} windows to train on")
  if model is not None and context_tokens > model.config.max_context:
    raise ValueError(
        f"context_tokens={context_tokens} is longer than the model context "
        f"({model.config.max_context})"
    )


def train_scorer(
    model,
    tokenizer,
    ids: Sequence[int],
    *,
    model_name: str,
    context_tokens: int = 2048,
    windows: int = 24,
    held_out: float = 0.25,
    steps: int = 1500,
    batch: int = 1024,
    learning_rate: float = 3e-3,
    seed: int = 0,
    progress: bool = True,
) -> Scorer:
  """Trains a `learned` scorer for `model` on `windows` windows of `context_tokens` tokens
  of `ids` (the last `held_out` share of the windows is held out for the metrics)."""
  from tqdm.auto import tqdm

  check_options(model, context_tokens=context_tokens, windows=windows, held_out=held_out)
  if not full_layers(model).any():
    raise ValueError(
        f"every layer of this model slides a window ({model.config.n_layers}): a scorer ranks "
        "the full layers' tokens, and it has none"
    )
  check_int("steps", steps)
  check_int("batch", batch)
  if isinstance(learning_rate, bool) or not (
      isinstance(learning_rate, (int, float)) and 0 < learning_rate < float("inf")
  ):
    raise ValueError(f"learning_rate must be a positive number, got {learning_rate!r}")
  pairs = text_windows(list(ids), context_tokens, 0, windows)  # raises if the text is short
  num_test = max(1, int(round(held_out * windows)))
  start = time.perf_counter()
  features, targets = [], []
  for context, _ in tqdm(pairs, desc="kvzip scores", unit="window", disable=not progress):
    x, y = training_pairs(model, tokenizer, context)
    features.append(x)
    targets.append(y)
  scoring_seconds = time.perf_counter() - start
  train_x = np.concatenate(features[:-num_test], axis=1)
  train_y = np.concatenate(targets[:-num_test], axis=1)
  bar = tqdm(total=steps, desc="training", unit="step", disable=not progress)

  def report(done, loss):
    bar.update(done - bar.n)
    bar.set_postfix_str(f"mse {loss:.3f}")

  weight, bias = _fit(
      train_x,
      train_y,
      steps=steps,
      batch=min(batch, train_x.shape[1]),
      learning_rate=learning_rate,
      seed=seed,
      progress=report,
      layers=full_layers(model),
  )
  bar.close()
  scorer = Scorer(weight, bias, model=model_name, fingerprint=model_fingerprint(model))
  metrics = evaluate(scorer, features[-num_test:], targets[-num_test:], layers=full_layers(model))
  metrics.update(
      context_tokens=context_tokens,
      train_windows=windows - num_test,
      held_out_windows=num_test,
      steps=steps,
      scoring_seconds=round(scoring_seconds, 1),
      total_seconds=round(time.perf_counter() - start, 1),
  )
  return Scorer(weight, bias, model=model_name, fingerprint=scorer.fingerprint, metrics=metrics)
