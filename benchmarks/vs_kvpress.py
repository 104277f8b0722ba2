"""kvjax's compression quality against NVIDIA kvpress (PyTorch + transformers), on the same model
and the same token windows, with kvjax's fidelity metric on both sides.

The two libraries cannot share a process (kvpress 0.5.5 needs transformers < 5.3, kvjax's
environment has a newer one), so the benchmark has two sides and a table step:

    python -m benchmarks.vs_kvpress --side kvjax --out DIR
    /tmp/kvpress-venv/bin/python benchmarks/vs_kvpress.py --side kvpress --out DIR
    python -m benchmarks.vs_kvpress --table --out DIR

`--side kvjax` (kvjax's environment) tokenizes the shipped default text
(`kvjax.eval.default_text()`, the tokenizer of `models.load_llama()`), cuts `--windows`
windows of `--context-tokens` + `--continuation-tokens` tokens at the offsets
`kvjax.eval.windowed_fidelity` uses (evenly spread starts, `np.linspace(0, n - span, windows)`),
writes them to DIR/windows.json, and measures kvjax: for every window the full-cache logits
once, then for every pair and kept fraction `kvjax.eval.fidelity` (the context prefilled under
the spec, the continuation teacher-forced) in three configurations, into DIR/kvjax.json:

  - "matched": kvpress' way where kvjax can express it: the context read whole, compressed once,
    every layer and kv head keeping the same fraction
    (`CompressionSpec(policy=p, budget=b, compress="once", head_budget="uniform")`); for kvzip,
    whose kvpress press ranks all layers and heads together and repeats the 2048-token context
    in one pass, `CompressionSpec(policy="kvzip:chunk=2048", budget=b, head_budget="global")`;
    kvjax's default protected tokens (the first 4, the last budget // 4);
  - "press": "matched" with the tokens the press itself protects (`sink`, `recent` from
    `PRESS_PROTECTS`) and SnapKVPress' window and kernel (`PRESS_POLICY`), so that what remains
    between the two columns is how each library scores;
  - "default": kvjax's own default for the policy (`CompressionSpec(policy=p, budget=b)`:
    running eviction for streaming/knorm/snapkv/tova/h2o/h2o_mean, one global ranking for kvzip
    and expected_attention).

The h2o_mean row has no press of its own: ObservedAttentionPress' score is kvjax's h2o_mean, so
the table shows the h2o row's kvpress run beside it.

`--side kvpress` (a separate environment with kvpress, torch and transformers < 5.3; it imports
neither jax nor kvjax) reads DIR/windows.json, loads the same GGUF with transformers in float32
and, per window, runs the full cache once and then each press the way kvpress' README uses one
(the press as a context manager around the model's forward over the context; then the
continuation, teacher-forced in one forward at its true positions, over the compressed cache),
into DIR/kvpress.json.

The metric is kvjax's (`kvjax.eval.compare_predictions`): over the continuation's predictions
(the first from the last context position), mean KL(P_full || P_compressed) in nats (each
position's KL clipped at 0) and top-1 agreement, each side against its own full cache.

`--table` (either environment) reads both files and writes DIR/results.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import sys
import time

import numpy as np

OUT = "docs/results/quality/vs_kvpress"
KVPRESS_PYTHON = "/tmp/kvpress-venv/bin/python"

# (name, kvpress press class, kvjax policy of the pair)
PAIRS = (
    ("streaming", "StreamingLLMPress", "streaming"),
    ("knorm", "KnormPress", "knorm"),
    ("snapkv", "SnapKVPress", "snapkv"),
    ("tova", "TOVAPress", "tova"),
    ("expected_attention", "ExpectedAttentionPress", "expected_attention"),
    ("kvzip", "KVzipPress", "kvzip"),
    ("h2o", "ObservedAttentionPress", "h2o"),
    # ObservedAttentionPress' score (attention received / queries that could see the key) is
    # kvjax's h2o_mean: the same press, a second kvjax row (kvpress runs it once).
    ("h2o_mean", "ObservedAttentionPress", "h2o_mean"),
)
PAIR_NAMES = tuple(p[0] for p in PAIRS)
KVPRESS_SAME_AS = {"h2o_mean": "h2o"}  # rows whose kvpress side is another row's run
# The tokens each press never evicts (its first `sink` and last `recent`), and the press'
# parameters kvjax has a knob for: kvjax's "press" configuration.
PRESS_PROTECTS = {
    "streaming": {"sink": 4, "recent": 0},  # n_sink=4; the newest tokens are what it keeps
    "knorm": {"sink": 0, "recent": 0},
    "snapkv": {"sink": 0, "recent": 64},  # the 64-query observation window gets the max score
    "tova": {"sink": 0, "recent": 1},  # the last token gets the max score
    "expected_attention": {"sink": 4, "recent": 0},  # n_sink=4 get the max score
    "kvzip": {"sink": 4, "recent": 0},  # n_sink=4 get the max score
    "h2o": {"sink": 0, "recent": 0},
    "h2o_mean": {"sink": 0, "recent": 0},
}
PRESS_POLICY = {"snapkv": "snapkv:window=64,kernel=5", "kvzip": "kvzip:chunk=2048"}
VARIANTS = ("kvpress", "matched", "press", "default")


def window_starts(total: int, span: int, count: int) -> list[int]:
  """Starts of `count` windows of `span` tokens over `total` tokens, as kvjax's
  `windowed_fidelity` places them (evenly spread, the last ending at the text's end)."""
  return np.linspace(0, total - span, count).astype(int).tolist() if count > 1 else [0]


def compare(reference_logits, logits, targets) -> dict:
  """kvjax's `compare_predictions` in NumPy (float64): KL(P_ref || P) in nats (mean over
  positions, each clipped at 0), top-1 agreement, perplexities of `targets`."""

  def log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))

  ref, got = log_softmax(reference_logits), log_softmax(logits)
  kl = np.maximum((np.exp(ref) * (ref - got)).sum(-1), 0.0)
  rows = np.arange(len(targets))
  return {
      "kl": float(kl.mean()),
      "top1": float((ref.argmax(-1) == got.argmax(-1)).mean()),
      "ppl_full": float(np.exp(-ref[rows, targets].mean())),
      "ppl": float(np.exp(-got[rows, targets].mean())),
  }


def summarize(windows: list[dict]) -> dict:
  """Means over the windows that ran (equal lengths: the mean over all predictions) and the
  standard error of the mean KL over windows."""
  done = [w for w in windows if "kl" in w]
  if not done:
    return {"kl": None, "kl_se": None, "top1": None, "kept_fraction": None, "ran": 0}
  kl = np.array([w["kl"] for w in done])
  return {
      "kl": float(kl.mean()),
      "kl_se": float(kl.std(ddof=1) / math.sqrt(len(kl))) if len(kl) > 1 else None,
      "top1": float(np.mean([w["top1"] for w in done])),
      "ppl": float(np.exp(np.mean([np.log(w["ppl"]) for w in done]))),
      "ppl_full": float(np.exp(np.mean([np.log(w["ppl_full"]) for w in done]))),
      "kept_fraction": float(np.mean([w["kept_fraction"] for w in done])),
      "ran": len(done),
  }


def write_json(path: pathlib.Path, data: dict) -> None:
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(data, indent=1) + "\n")
  tmp.replace(path)


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def full_cache_row(reference: np.ndarray, continuation) -> tuple[list[float], list[int]]:
  """The full cache's log-probability of each continuation token and its argmax, from its
  logits [N, V]."""
  logp = reference - reference.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp.astype(np.float64)).sum(-1, keepdims=True))
  targets = logp[np.arange(len(continuation)), continuation]
  return [float(v) for v in targets], [int(v) for v in reference.argmax(-1)]


def measure(side: str, windows, records: dict, full_logits, case_row, save) -> dict:
  """The loop both sides run: per window the full cache once, then every case.

  windows: [(context ids, continuation ids)]; records: {case: record} to append each window's
  row to; full_logits(context, continuation) -> logits [N, V]; case_row(case, context,
  continuation, reference) -> {"kl", "top1", "ppl", "ppl_full", "kept_fraction"};
  save(windows_done, full) after every window. A failed case is reported in its row, not
  skipped. Returns the full cache's record.
  """
  full = {"target_logprob": [], "argmax": [], "seconds": 0.0}
  for w, (context, continuation) in enumerate(windows):
    t = time.perf_counter()
    reference = np.asarray(full_logits(context, continuation), np.float32)
    full["seconds"] += time.perf_counter() - t
    logprob, argmax = full_cache_row(reference, continuation)
    full["target_logprob"].append(logprob)
    full["argmax"].append(argmax)
    for case, record in records.items():
      t = time.perf_counter()
      try:
        row = case_row(case, context, continuation, reference)
      except Exception as err:  # noqa: BLE001 - a failed case is reported, not skipped
        row = {"error": f"{type(err).__name__}: {err}"}
      row["seconds"] = time.perf_counter() - t
      record["seconds"] += row["seconds"]
      record["windows"].append(row)
      outcome = (
          f"kl={row['kl']:.5f} top1={row['top1']:.3f} kept={row['kept_fraction']:.3f}"
          if "kl" in row
          else row["error"]
      )
      log(f"{side} window {w} {' '.join(map(str, case))}: {outcome} ({row['seconds']:.1f}s)")
    save(w + 1, full)
  save(len(windows), full)
  return full


def side_record(side, versions, command, windows_done, t0, full, records) -> dict:
  """One side's results file: its versions and command, and per case the rows of every window
  with their summary."""
  return {
      "side": side,
      "versions": versions,
      "command": command,
      "windows_done": windows_done,
      "wall_s": time.perf_counter() - t0,
      "full_reference": full,
      "results": [dict(r, **summarize(r["windows"])) for r in records.values()],
  }


def new_record(name: str, budget: float, variant: str, **extra) -> dict:
  return {
      "pair": name,
      "budget": budget,
      "variant": variant,
      **extra,
      "windows": [],
      "seconds": 0.0,
  }


# --------------------------------------------------------------------------- kvjax side


def kvjax_specs(name: str, policy: str, budget: float) -> dict:
  """kvjax's three configurations of a pair: "matched" (compressed once, kvpress' budget
  sharing), "press" (matched, plus the press' protected tokens and window parameters) and
  "default" (kvjax's own defaults)."""
  import kvjax

  if policy == "kvzip":
    matched = kvjax.CompressionSpec(policy="kvzip:chunk=2048", budget=budget, head_budget="global")
  else:
    matched = kvjax.CompressionSpec(
        policy=policy, budget=budget, compress="once", head_budget="uniform"
    )
  press = matched.replace(policy=PRESS_POLICY.get(name, policy), **PRESS_PROTECTS[name])
  return {
      "matched": matched,
      "press": press,
      "default": kvjax.CompressionSpec(policy=policy, budget=budget),
  }


def cut_windows(args, out: pathlib.Path, source, ids: list[int]) -> list[tuple[list, list]]:
  """`args.windows` (context, continuation) pairs of the default text, written to
  out/windows.json for the kvpress side."""
  ctx_n, cont_n = args.context_tokens, args.continuation_tokens
  span = ctx_n + cont_n
  if len(ids) < span * args.windows:
    raise SystemExit(f"the default text has {len(ids)} tokens, too few for {args.windows} windows")
  starts = window_starts(len(ids), span, args.windows)
  pairs = [(ids[s : s + ctx_n], ids[s + ctx_n : s + span]) for s in starts]
  write_json(
      out / "windows.json",
      {
          "model": source.name,
          "gguf": str(source.path),
          "text": "kvjax.eval.default_text()",
          "text_tokens": len(ids),
          "context_tokens": ctx_n,
          "continuation_tokens": cont_n,
          "starts": starts,
          "windows": [
              {"start": s, "context": c, "continuation": n} for s, (c, n) in zip(starts, pairs)
          ],
      },
  )
  log(f"kvjax: {len(ids)} text tokens, windows at {starts}")
  return pairs


def run_kvjax(args) -> None:
  if not __package__:  # `python benchmarks/vs_kvpress.py`: import from the repository root
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  import jax

  import kvjax
  import models
  from kvjax.eval import continuation_logits, default_text, fidelity

  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  t0 = time.perf_counter()
  model, tokenizer = models.load_llama()
  windows = cut_windows(args, out, models.resolve_model(), tokenizer.encode(default_text()))
  specs = {
      (name, budget, variant): spec
      for name, _, policy in PAIRS
      if name in args.pairs
      for budget in args.budgets
      for variant, spec in kvjax_specs(name, policy, budget).items()
  }
  records = {
      case: new_record(*case, spec={k: v for k, v in spec.to_dict().items() if v is not None})
      for case, spec in specs.items()
  }
  # The full cache of every case (`kvjax.eval.fidelity`'s reference: the spec's layout, the
  # model's dtype); `sink` and `recent` only steer eviction, so one reference serves all.
  (reference_spec,) = {
      spec.full_cache().replace(kv_dtype=None, sink=4, recent=None) for spec in specs.values()
  }

  def case_row(case, context, continuation, reference):
    at = specs[case].replace(budget=specs[case].budget_tokens(len(context)))
    r = fidelity(model, context, continuation, at, reference_logits=reference, tokenizer=tokenizer)
    return {k: float(r[k]) for k in ("kl", "top1", "ppl", "ppl_full", "kept_fraction")}

  versions = {
      "kvjax": kvjax.__version__,
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "python": platform.python_version(),
  }
  command = " ".join(["python -m benchmarks.vs_kvpress", *args.argv])
  measure(
      "kvjax",
      windows,
      records,
      lambda context, continuation: continuation_logits(
          model, context, continuation, reference_spec
      )[0],
      case_row,
      lambda done, full: write_json(
          out / "kvjax.json", side_record("kvjax", versions, command, done, t0, full, records)
      ),
  )
  log(f"kvjax side done in {time.perf_counter() - t0:.0f}s")


# --------------------------------------------------------------------------- kvpress side


def load_kvpress_model(args, gguf: pathlib.Path):
  """The GGUF in transformers, float32, with a tokenizer directory KVzipPress can load."""
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer

  model = AutoModelForCausalLM.from_pretrained(
      str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
  ).eval()
  # KVzipPress loads its tokenizer with AutoTokenizer.from_pretrained(model.config.name_or_path),
  # which cannot read a GGUF: save the GGUF's tokenizer to a directory and point the config at it.
  # Without its chat template: the windows are raw text, not a chat-formatted context (with the
  # template KVzipPress would take the context's first tokens for the template's prefix and
  # leave them unscored); kvpress' own path for a tokenizer without a template then repeats
  # "\n\nRepeat the previous context exactly." + "\n" + the context.
  tok_dir = pathlib.Path(args.work) / "tokenizer"
  tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
  tokenizer.chat_template = None
  tokenizer.save_pretrained(tok_dir)
  model.config.name_or_path = str(tok_dir)
  return model


def kvpress_forward(model, context, continuation, press=None, attn="sdpa"):
  """Logits [N, V] predicting each continuation token, the context read with `press` as
  kvpress' README uses one (a context manager around the forward), the continuation
  teacher-forced in one forward at its true positions; and the fraction of the context's K/V
  entries the cache keeps."""
  import torch
  from transformers import DynamicCache

  if model.config._attn_implementation != attn:
    model.set_attn_implementation(attn)
  for layer in model.model.layers:
    # KVzipPress leaves its masks on the attention modules; the patched sdpa attention clears
    # them at the next prefill, eager attention (not patched) would not: clear them here.
    layer.self_attn.masked_key_indices = None
  cache = DynamicCache()
  ctx = torch.tensor([context], dtype=torch.long)
  with torch.no_grad():
    if press is None:
      first = model(input_ids=ctx, past_key_values=cache, logits_to_keep=1).logits[0, -1]
    else:
      with press(model):
        first = model(input_ids=ctx, past_key_values=cache, logits_to_keep=1).logits[0, -1]
    layers = model.config.num_hidden_layers
    heads = model.config.num_key_value_heads
    kept = sum(cache.get_seq_length(i) for i in range(layers)) * heads
    masked = 0
    for layer in model.model.layers:
      idx = getattr(layer.self_attn, "masked_key_indices", None)
      if idx is not None:  # KVzipPress masks (fake-compresses) instead of dropping
        masked += int(idx[0].numel())
    forced = torch.tensor([continuation[:-1]], dtype=torch.long)
    positions = torch.arange(len(context), len(context) + forced.shape[1])[None]
    rest = model(input_ids=forced, past_key_values=cache, position_ids=positions).logits[0]
  kept_fraction = (kept - masked) / (layers * heads * len(context))
  return torch.cat([first[None], rest]).numpy(), kept_fraction


def agreement_with_kvjax(full: dict, kvjax_full: dict | None) -> dict:
  """How the two full caches agree on the windows both have run."""
  if kvjax_full is None or not full["argmax"]:
    return {}
  n = min(len(full["argmax"]), len(kvjax_full["argmax"]))
  a, b = np.array(full["argmax"][:n]), np.array(kvjax_full["argmax"][:n])
  la, lb = np.array(full["target_logprob"][:n]), np.array(kvjax_full["target_logprob"][:n])
  return {
      "windows": n,
      "argmax_agreement": float((a == b).mean()),
      "max_abs_target_logprob_diff": float(np.abs(la - lb).max()),
  }


def run_kvpress(args) -> None:
  # kvpress' environment: no jax, no kvjax.
  import kvpress
  import torch
  import transformers

  torch.set_num_threads(args.threads)
  out = pathlib.Path(args.out)
  spec = json.loads((out / "windows.json").read_text())
  t0 = time.perf_counter()
  model = load_kvpress_model(args, pathlib.Path(spec["gguf"]))
  log(f"kvpress: model loaded in {time.perf_counter() - t0:.1f}s")
  press_class = {name: press for name, press, _ in PAIRS}
  records = {
      (name, budget): new_record(name, budget, "kvpress", press=None)
      for name in PAIR_NAMES
      if name in args.pairs and name not in KVPRESS_SAME_AS
      for budget in args.budgets
  }
  kvjax_file = out / "kvjax.json"
  kvjax_full = json.loads(kvjax_file.read_text())["full_reference"] if kvjax_file.exists() else None

  def case_row(case, context, continuation, reference):
    name, budget = case
    press = getattr(kvpress, press_class[name])(compression_ratio=1.0 - budget)
    records[case]["press"] = repr(press)
    attn = "eager" if name == "h2o" else "sdpa"  # ObservedAttentionPress reads the weights
    logits, kept = kvpress_forward(model, context, continuation, press, attn)
    return dict(compare(reference, logits, np.asarray(continuation)), kept_fraction=kept)

  versions = {
      "kvpress": _version("kvpress"),
      "torch": torch.__version__,
      "transformers": transformers.__version__,
      "python": platform.python_version(),
      "torch_threads": torch.get_num_threads(),
  }
  command = " ".join([sys.executable, "benchmarks/vs_kvpress.py", *args.argv])

  def save(done, full):
    full["vs_kvjax_full"] = agreement_with_kvjax(full, kvjax_full)
    write_json(
        out / "kvpress.json", side_record("kvpress", versions, command, done, t0, full, records)
    )

  windows = [(w["context"], w["continuation"]) for w in spec["windows"][: args.windows]]
  assert all(len(c) == spec["context_tokens"] for c, _ in windows)
  measure(
      "kvpress",
      windows,
      records,
      lambda context, continuation: kvpress_forward(model, context, continuation)[0],
      case_row,
      save,
  )
  log(f"kvpress side done in {time.perf_counter() - t0:.0f}s")


def _version(package: str) -> str:
  from importlib.metadata import version

  return version(package)


# --------------------------------------------------------------------------- table

DIFFERENCES = """\
Read from kvpress 0.5.5's `kvpress/presses/*.py` and kvjax's `kvjax/policies/*.py` and
`kvjax/spec.py`; neither side was tuned.

- **Protected tokens** (what the *press* column changes). kvjax never evicts the first `sink`
  (default 4) and the last `recent` (default budget // 4: 256 tokens at 50 % of 2048, 128 at
  25 %) tokens of every sequence, for every policy. kvpress protects per press:
  StreamingLLMPress the 4 sinks (and the newest tokens by construction), SnapKVPress its
  64-query observation window, TOVAPress the last token, ExpectedAttentionPress and KVzipPress
  the 4 sinks, KnormPress and ObservedAttentionPress nothing. The continuation right after the
  context leans on the newest tokens, so kvjax's recent window accounts for most of the gap
  between the *kvpress* and *matched* columns where a press does not keep them (knorm, kvzip,
  expected attention, h2o).
- **When compression runs.** kvpress compresses each layer's cache once, in a hook after that
  layer's attention over the whole context (the prefill, including the first prediction from
  the last context position, sees the full cache), and never evicts during the continuation.
  kvjax's *matched* and *press* columns do the same (`compress="once"`: the context is read with
  nothing evicted, ranked once, the continuation appended without eviction). kvjax's
  *default* for streaming, knorm, snapkv, tova, h2o and h2o_mean evicts while it reads (after
  every 256-token prefill chunk, once a sequence passes its budget plus a margin) and at every
  continuation step: the K/V of later context tokens are computed over an already compressed
  cache, and the cache stays at its budget during the continuation.
- **Budget sharing.** kvpress' scorer presses (StreamingLLM, Knorm, SnapKV, TOVA,
  ExpectedAttention, ObservedAttention) keep `int(2048 * kept)` tokens in every layer and kv
  head, as kvjax's *matched* and *press* columns do (`head_budget="uniform"`). KVzipPress
  (default `layerwise=False`) ranks all layers and kv heads together, as kvjax's kvzip does in
  every column (`head_budget="global"`). kvjax's *default* for expected_attention is the global
  ranking too, where kvpress' press is uniform.
- **Scores and GQA aggregation** (SmolLM2-135M: 9 query heads, 3 kv heads).
  StreamingLLM: the same tokens (4 sinks + the newest), so the *kvpress*, *matched* and *press*
  numbers agree to the rounding of two implementations. SnapKV: kvpress averages the window's
  attention over its 64 queries, avg-pools it (kernel 5) and averages over a kv head's query
  heads; kvjax sums the attention of the last 32 queries (*press*: 64) over a kv head's query
  heads and max-pools it (kernel 7; *press*: 5). TOVA: kvpress averages the last query's
  attention over *all* query heads and keeps the same tokens in every kv head; kvjax scores each
  kv head by its own query heads' attention (summed). ObservedAttentionPress: the attention a
  key receives from the whole context divided by the number of queries that can see it,
  averaged over the kv head's query heads, which is kvjax's `h2o_mean` (second row, same kvpress
  run); kvjax's `h2o` is the plain sum, which favours early tokens. KVzip: both take the max
  over a kv head's query heads and over the repeating queries.
- **Expected attention.** The same estimator (pre-RoPE query mean and covariance without the
  first 4 positions, the rotation averaged over the next 512 positions, softmax of the expected
  logit averaged over a kv head's query heads, times ||v||). kvpress gives the 4 sink keys the
  maximum score and leaves them out of the softmax; kvjax keeps them in the softmax. kvjax
  updates the statistics chunk by chunk (256 tokens), rescoring after each; kvpress computes
  them from the whole context at once (the same statistics at the end).
- **KVzip.** kvpress repeats the context after "\\n\\nRepeat the previous context exactly." +
  "\\n" (its path for a tokenizer without a chat template, used here because the windows are
  raw text: with SmolLM2's template KVzipPress would take the context's first tokens for the
  template's prefix and never score them), `chunk_size`=2048 tokens per pass (the whole context
  in one pass), each pass attending to the 4 sinks, its chunk and itself; it masks the dropped
  entries (a fake key whose attention underflows to 0) instead of removing them. kvjax's prompt
  is "\\n\\nRepeat the previous context exactly.\\n\\n"; *matched* and *press* repeat the whole
  context in one pass (`kvzip:chunk=2048`), *default* in four 512-token passes, each attending
  to the first page (16 tokens) and its own span, placed after the whole context; kvjax removes
  the dropped entries and re-lays out the pool.
- **Numerics.** Both sides run float32 on CPU from the same Q4_1 GGUF, dequantized by each
  loader (the two full caches are compared above). Each side's KL is against its own full
  cache; kvpress' teacher-forced continuation is one 63-token forward at the true positions
  (2048...), kvjax's a decode loop of one token per step.
"""


def cell(r: dict | None) -> str:
  """ "KL ± s.e. / top-1" of one result, or n/a."""
  if not r or r.get("kl") is None:
    return "n/a"
  se = f" ± {r['kl_se']:.4f}" if r.get("kl_se") is not None else ""
  return f"{r['kl']:.4f}{se} / {100 * r['top1']:.1f}%"


def fmt_kept(r: dict | None) -> str:
  return "n/a" if not r or r.get("kept_fraction") is None else f"{100 * r['kept_fraction']:.1f}%"


def results_index(jx: dict, kp: dict, n_windows: int) -> dict:
  """{(pair, budget, variant): result over the first `n_windows` windows} over both sides;
  rows whose kvpress side is another row's run (h2o_mean) point at that run."""
  index = {
      (r["pair"], r["budget"], r["variant"]): dict(r, **summarize(r["windows"][:n_windows]))
      for side in (jx, kp)
      for r in side["results"]
  }
  for name, same in KVPRESS_SAME_AS.items():
    for (pair, budget, variant), r in list(index.items()):
      if pair == same and variant == "kvpress":
        index[(name, budget, variant)] = r
  return index


def table_intro(windows: dict, kp: dict, n_windows: int) -> list[str]:
  cont = windows["continuation_tokens"]
  return [
      "# Quality against kvpress",
      "",
      (
          f"kvjax against NVIDIA kvpress {kp['versions']['kvpress']} on {windows['model']} "
          f"(`{pathlib.Path(windows['gguf']).name}`, float32, CPU), on the same token windows: "
          f"**{n_windows} windows x {cont} teacher-forced continuation predictions** "
          f"({n_windows * cont} predictions per cell) after a {windows['context_tokens']}-token "
          f"context compressed to the kept fraction; the windows come from kvjax's default text "
          f"({windows['text_tokens']} tokens) at token offsets {windows['starts'][:n_windows]}, as "
          "`kvjax.eval.windowed_fidelity` places them."
      ),
      "",
      (
          "Each cell: mean KL(P_full || P_compressed) in nats over the predictions ± its standard "
          "error over the windows / top-1 agreement with the full cache's argmax; each side against "
          "its own full cache (kvjax's fidelity metric, `kvjax.eval.fidelity`). Lower KL and higher "
          "top-1 are better. Columns:"
      ),
      "",
      (
          "- *kvpress*: the press with `compression_ratio = 1 - kept`, its other parameters at their "
          "defaults, used as a context manager around the forward over the context;"
      ),
      (
          "- *kvjax matched*: compressed once after the context with the same fraction kept in every "
          "layer and kv head, as kvpress' scorer presses do: `CompressionSpec(policy=p, budget=b, "
          'compress="once", head_budget="uniform")`; for kvzip one global ranking with the whole '
          'context repeated in one pass, as KVzipPress does: `CompressionSpec(policy="kvzip:'
          'chunk=2048", budget=b, head_budget="global")`; kvjax\'s default protected tokens (the '
          "first 4 and the last budget // 4);"
      ),
      (
          "- *kvjax press*: *matched* with the press' own protected tokens instead (`sink`, `recent`: "
          "none for knorm and h2o, the 4 sinks for streaming, expected attention and kvzip, the last "
          "64 for snapkv, the last one for tova) and SnapKV's window of 64 and kernel of 5 "
          "(`snapkv:window=64,kernel=5`);"
      ),
      (
          "- *kvjax default*: `CompressionSpec(policy=p, budget=b)` (running eviction while reading "
          "and decoding for streaming, knorm, snapkv, tova, h2o, h2o_mean; compressed once with one "
          "global ranking for expected_attention and kvzip)."
      ),
      "",
  ]


def table_rows(index: dict, budgets: list[float]) -> tuple[list[str], list[str]]:
  """The table's lines (one row per pair and kept fraction) and what was left out or failed."""
  lines = [
      "| kvpress press | kvjax policy | kept | kvpress | kvjax matched | kvjax press | "
      "kvjax default |",
      "|---|---|---:|---:|---:|---:|---:|",
  ]
  left_out = []
  for name, press, policy in PAIRS:
    for budget in budgets:
      rows = {v: index.get((name, budget, v)) for v in VARIANTS}
      if not any(rows.values()):
        continue
      failed = sorted(
          {f"{v}: {w['error']}" for v, r in rows.items() if r for w in r["windows"] if "error" in w}
      )
      if failed:
        left_out.append(f"{press} / {policy} at {budget:.0%}, failed windows: " + "; ".join(failed))
      if not (rows["kvpress"] or {}).get("ran"):
        left_out.append(f"{press} at {budget:.0%}: no kvpress result, row left out")
        continue
      same = KVPRESS_SAME_AS.get(name)
      press_cell = press + (f" (the {same} row's run)" if same else "")
      cells = " | ".join(cell(rows[v]) for v in VARIANTS)
      lines.append(f"| {press_cell} | {policy} | {budget:.0%} | {cells} |")
  return lines + [""], left_out


def per_row(index: dict, budgets: list[float], show) -> list[str]:
  """`show(result)` for each variant of every pair and budget that ran, "a / b / c / d"."""
  shown = []
  for name in PAIR_NAMES:
    for budget in budgets:
      got = [index.get((name, budget, v)) for v in VARIANTS]
      if any(got):
        shown.append(f"{name} {budget:.0%}: " + " / ".join(show(r) for r in got))
  return shown


def full_cache_lines(jx: dict, kp: dict, cont: int, n_windows: int) -> list[str]:
  jf, kf = jx["full_reference"], kp["full_reference"]
  cross = kf.get("vs_kvjax_full") or {}
  ppl = lambda f: float(np.exp(-np.mean(f["target_logprob"][:n_windows])))  # noqa: E731
  agreement = (
      f"; argmax agreement {100 * cross['argmax_agreement']:.1f}% over "
      f"{cross['windows'] * cont} predictions; largest difference of a target token's "
      f"log-probability {cross['max_abs_target_logprob_diff']:.1e} nats."
      if cross
      else "."
  )
  return [
      "The two full caches on the same windows: perplexity of the continuations "
      f"{ppl(jf):.3f} (kvjax) and {ppl(kf):.3f} (transformers)" + agreement,
      "",
  ]


def how_it_was_run(args, jx: dict, kp: dict, seconds: list[str]) -> list[str]:
  jv, kv = jx["versions"], kp["versions"]
  jf, kf = jx["full_reference"], kp["full_reference"]
  return [
      "## How it was run",
      "",
      (
          f"- kvjax side: kvjax {jv['kvjax']}, jax {jv['jax']} ({jv['backend']}), Python "
          f"{jv['python']}; wall time {jx['wall_s'] / 60:.1f} min (of which the full cache "
          f"{jf['seconds']:.0f} s)."
      ),
      (
          f"- kvpress side: kvpress {kv['kvpress']}, torch {kv['torch']}, transformers "
          f"{kv['transformers']}, Python {kv['python']}, {kv['torch_threads']} torch threads; wall "
          f"time {kp['wall_s'] / 60:.1f} min (of which the full cache {kf['seconds']:.0f} s)."
      ),
      (
          f"- Machine: {platform.machine()}, {os.cpu_count()} cores shared with other work (wall "
          "times are indicative only), the sides one after the other."
      ),
      "- Seconds per row over all windows, compiling included (kvpress / matched / press / "
      "default; the h2o_mean row's kvpress run is the h2o row's): " + "; ".join(seconds) + ".",
      "",
      "```",
      "python -m venv /tmp/kvpress-venv",
      "/tmp/kvpress-venv/bin/pip install torch==2.13.0 'transformers<5.3' kvpress gguf accelerate numpy",
      jx["command"],
      kp["command"],
      "python -m benchmarks.vs_kvpress --table" + (f" --out {args.out}" if args.out != OUT else ""),
      "```",
      "",
      (
          "Raw numbers, per window and per configuration (the kvjax specs in full): `windows.json` "
          "(the token ids), `kvjax.json`, `kvpress.json`."
      ),
      "",
  ]


def write_table(args) -> None:
  out = pathlib.Path(args.out)
  windows = json.loads((out / "windows.json").read_text())
  jx = json.loads((out / "kvjax.json").read_text())
  kp = json.loads((out / "kvpress.json").read_text())
  n_windows = min(jx["windows_done"], kp["windows_done"])
  index = results_index(jx, kp, n_windows)
  budgets = sorted({r["budget"] for side in (jx, kp) for r in side["results"]}, reverse=True)
  rows, left_out = table_rows(index, budgets)
  kept = per_row(index, budgets, fmt_kept)
  seconds = per_row(index, budgets, lambda r: "n/a" if r is None else f"{r['seconds']:.0f}")
  lines = [
      *table_intro(windows, kp, n_windows),
      *rows,
      "Share of the context's K/V entries (over layers and kv heads) cached once the context is "
      "read (kvpress / matched / press / default): " + "; ".join(kept) + ".",
      "",
      *full_cache_lines(jx, kp, windows["continuation_tokens"], n_windows),
  ]
  if left_out:
    lines += ["Left out or failed:", ""] + [f"- {x}" for x in left_out] + [""]
  lines += ["## Differences between the implementations", "", DIFFERENCES]
  lines += how_it_was_run(args, jx, kp, seconds)
  (out / "results.md").write_text("\n".join(lines))
  print("\n".join(lines))


def main(argv=None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  what = parser.add_mutually_exclusive_group(required=True)
  what.add_argument("--side", choices=("kvjax", "kvpress"))
  what.add_argument("--table", action="store_true", help="write OUT/results.md from both sides")
  parser.add_argument("--out", default=OUT, help=f"output directory (default {OUT})")
  parser.add_argument("--windows", type=int, default=8)
  parser.add_argument("--context-tokens", type=int, default=2048)
  parser.add_argument("--continuation-tokens", type=int, default=64)
  parser.add_argument(
      "--budgets",
      type=float,
      nargs="+",
      default=[0.5, 0.25],
      help="kept fractions (kvpress compression_ratio = 1 - kept)",
  )
  parser.add_argument("--pairs", nargs="+", default=list(PAIR_NAMES), choices=PAIR_NAMES)
  parser.add_argument("--threads", type=int, default=2, help="torch threads (kvpress side)")
  parser.add_argument(
      "--work",
      default="/tmp/kvpress-vs-kvjax",
      help="scratch directory of the kvpress side (its tokenizer copy)",
  )
  args = parser.parse_args(argv)
  args.argv = argv
  if args.table:
    write_table(args)
  elif args.side == "kvjax":
    run_kvjax(args)
  else:
    run_kvpress(args)


if __name__ == "__main__":
  main()
