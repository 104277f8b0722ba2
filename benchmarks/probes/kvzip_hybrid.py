"""What a context compressed once keeps on a hybrid (sliding-window + full layers) model,
and whether the pass key survives it: real-text pass keys (the question after compression,
as `kvjax eval passkey --fillers text` builds them), each spec prefilled and compressed, then
per full-attention layer

- the tokens kept (the one global ranking of `head_budget='global'` shares the budget
  across the full layers and kv heads, so a layer may keep far more or less than its share);
- the needle's tokens kept (all of them, and the key's digits), and their best rank among
  the layer's scored tokens (0 = the top score; kept when below the layer's kept count);
- for a policy with repeat passes (kvzip), the mean score of each pass's span, and whether
  a pass repeats the protected prefix (`<bos>`, the chat template's opening).

    python -m benchmarks.probes.kvzip_hybrid [--model gemma3-270m] [--context-tokens 2048] \
        [--policy full kvzip kvzip:chunk=2048 kvzip:attend_to=context] [--budget 0.25] \
        [--head-budget global uniform layer] [--depths ...] [--trials 1] [--out FILE.json]

Every policy runs with every --head-budget (`full` once). Prints one Markdown table per
measure; --out writes every case's numbers.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import kvjax
import models
from benchmarks._common import print_table
from kvjax.cache.paged_cache import logical_view, valid_mask
from kvjax.eval import _data, _tasks
from kvjax.eval._answers import ANSWER_TOKENS, ask, at_budget, request_tokens
from kvjax.eviction.sliding import full_layers
from kvjax.runtime import pool, session, steps
from kvjax.runtime.prompts import Segment, context_prompt, encode_question
from kvjax.runtime.session import _in_position_order


def _find(ids: list[int], part: list[int]) -> int:
  """The first index of `part` in `ids` (ValueError when it is not there)."""
  for i in range(len(ids) - len(part) + 1):
    if ids[i : i + len(part)] == part:
      return i
  raise ValueError("the needle's tokens are not in the context")


def _needle(tokenizer, ids: list[int], key: str) -> tuple[np.ndarray, np.ndarray]:
  """Positions of the needle's tokens and of its key's digits in the prompt `ids`."""
  needle = tokenizer.encode(_data.PASSKEY_NEEDLE.format(key=key))
  start = _find(ids, needle)
  positions = np.arange(start, start + len(needle))
  digits = [p for p in positions if tokenizer.decode([ids[p]]).strip().isdigit()]
  return positions, np.asarray(digits)


def _kept_positions(cache) -> list[np.ndarray]:
  """Per layer, the positions row 0's first kv head holds."""
  position = np.asarray(logical_view(cache, cache.slot("position")))[:, 0, 0]
  valid = np.asarray(valid_mask(cache))[:, 0, 0]
  return [np.sort(position[layer][valid[layer]]) for layer in range(position.shape[0])]


read_rows: list[list[list[int]]] = []  # the rows of every `prefill_chunks` call


def _spy(real):
  def reading(model, state, encoded, key, progress=None, **kwargs):
    read_rows.append([list(row) for row in encoded.ids])
    return real(model, state, encoded, key, progress, **kwargs)

  return reading


def _count(row: list[int], part: list[int]) -> int:
  return sum(row[i : i + len(part)] == part for i in range(len(row) - len(part) + 1))


def run_case(model, tokenizer, case, spec, protect_needle: bool = False) -> dict:
  """One case prefilled (and compressed) as `kvjax eval passkey` does, probed, answered."""
  question = encode_question(tokenizer, case["question"], True, case.get("cue", ""))
  request = request_tokens(tokenizer, case["ids"], [question], True)
  spec = at_budget(spec, request)
  reserve = len(question) + ANSWER_TOKENS["passkey"]
  prompt = context_prompt(tokenizer, case["ids"], True)
  if protect_needle:  # an oracle: the needle kept on every layer whatever its scores
    at = _find(case["ids"], tokenizer.encode(_data.PASSKEY_NEEDLE.format(key=case["answer"])))
    end = at + len(tokenizer.encode(_data.PASSKEY_NEEDLE.format(key=case["answer"])))
    ids = case["ids"]
    prompt = [
        prompt[0],
        Segment(ids[:at]),
        Segment(ids[at:end], protected=True),
        Segment(ids[end:]),
    ]
  begun = session.begin(model, [prompt], spec, tokenizer, False, reserve, 0, None)
  ids = begun.encoded.ids[0]
  positions, digits = _needle(tokenizer, ids, case["answer"])
  out = {"depth": case["depth"], "needle": positions.tolist(), "key": digits.tolist()}
  state = begun.state
  full = np.asarray(full_layers(state.cache))
  if state.plan.compresses_after_prefill:
    shape = begun.shape
    read_rows.clear()
    state = session._read_and_score(model, state, begun.encoded, tokenizer, shape)
    cache = state.cache
    valid = np.asarray(valid_mask(cache))
    index = np.where(valid, np.asarray(logical_view(cache, cache.slot("position"))), -1)
    scores = _in_position_order(np.asarray(logical_view(cache, cache.slot("score"))), index)
    live = _in_position_order(valid, index)
    ranks, spans = {}, {}
    chunk = getattr(spec.policy, "chunk", None)
    for layer in np.flatnonzero(full):
      s, v = scores[layer, 0, 0], live[layer, 0, 0]
      order = np.argsort(-np.where(v, s, -np.inf), kind="stable")
      rank = np.empty_like(order)
      rank[order] = np.arange(len(order))
      ranks[int(layer)] = {
          "needle_best": int(rank[positions].min()),
          "key_best": int(rank[digits].min()),
          "key_median": float(np.median(rank[digits])),
      }
      if chunk:
        n = len(ids)
        spans[int(layer)] = [float(s[a : min(a + chunk, n)].mean()) for a in range(0, n, chunk)]
    out["ranks"], out["span_means"] = ranks, spans
    # What the passes read after the context (each `prefill_chunks` call after the first):
    # how many of their tokens are the protected prefix's (`<bos>`, a chat opening).
    prefix = ids[: int(np.argmin(begun.encoded.protected[0]))]
    out["passes"] = len(read_rows) - 1
    out["prefix_repeated"] = sum(
        _count(row, prefix) for rows in read_rows[1:] for row in rows if prefix
    )
    state = pool.compress(state, begun.reserve)
  else:
    state = session.read(model, begun, tokenizer)
  kept = _kept_positions(state.cache)
  out["kept"] = {int(l): len(kept[l]) for l in np.flatnonzero(full)}
  out["needle_kept"] = {
      int(l): float(np.isin(positions, kept[l]).mean()) for l in np.flatnonzero(full)
  }
  out["key_kept"] = {int(l): float(np.isin(digits, kept[l]).mean()) for l in np.flatnonzero(full)}
  text, _, _ = ask(
      model, tokenizer, state, question, max_new_tokens=ANSWER_TOKENS["passkey"], donate=True
  )
  out["answer"] = text
  out["correct"] = _tasks._first_number(text) == case["answer"]
  return out


def _mean(rows, key, layer):
  values = [r[key][layer] for r in rows if layer in r.get(key, {})]
  return float(np.mean(values)) if values else float("nan")


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--model", default="gemma3-270m")
  p.add_argument("--context-tokens", type=int, default=2048)
  p.add_argument("--policy", nargs="+", default=["full", "kvzip"], help="policy specs")
  p.add_argument("--budget", type=float, default=0.25, help="share of the request kept")
  p.add_argument(
      "--head-budget", nargs="+", default=["global"], choices=["global", "uniform", "layer"]
  )
  p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.25, 0.4, 0.55, 0.7, 0.85])
  p.add_argument("--trials", type=int, default=1)
  p.add_argument(
      "--protect-needle",
      action="store_true",
      help="an oracle: the needle's tokens protected (kept on every layer)",
  )
  p.add_argument("--out", help="JSON file for every case's numbers")
  args = p.parse_args(argv)

  model, tokenizer = models.load_decoder(args.model)
  steps.prefill_chunks = _spy(steps.prefill_chunks)
  cases = _tasks.passkey_cases(
      tokenizer, args.context_tokens, depths=args.depths, trials=args.trials, fillers=("text",)
  )
  runs = []
  for name in args.policy:
    for sharing in ["-"] if name == "full" else args.head_budget:
      if name == "full":
        spec = kvjax.CompressionSpec()
      else:
        spec = kvjax.CompressionSpec(policy=name, budget=args.budget, head_budget=sharing)
      start = time.perf_counter()
      rows = [run_case(model, tokenizer, c, spec, args.protect_needle) for c in cases]
      seconds = time.perf_counter() - start
      runs.append({"policy": name, "head_budget": sharing, "seconds": seconds, "cases": rows})
      correct = sum(r["correct"] for r in rows)
      print(f"{name} head_budget={sharing}: {correct}/{len(rows)} in {seconds:.0f} s", flush=True)
      if args.out:  # after every spec, so a long run's finished specs are on disk
        with open(args.out, "w") as f:
          json.dump({"args": vars(args), "runs": runs}, f, indent=1)

  layers = sorted({l for run in runs for l in run["cases"][0]["kept"]})
  print(f"\n{args.model}, {len(cases)} real-text cases at {args.context_tokens} tokens\n")
  print("Tokens kept per full layer (mean over cases), needle tokens kept, key digits kept:\n")
  columns = ["policy", "head_budget", "correct"]
  columns += [f"L{l} kept / needle / key" for l in layers]
  table = []
  for run in runs:
    rows = run["cases"]
    cells = [run["policy"], run["head_budget"], f"{sum(r['correct'] for r in rows)}/{len(rows)}"]
    for l in layers:
      cells.append(
          f"{_mean(rows, 'kept', l):.0f} / {_mean(rows, 'needle_kept', l):.2f} / "
          f"{_mean(rows, 'key_kept', l):.2f}"
      )
    table.append(cells)
  print_table(columns, table, numeric_from=2)

  scored = [run for run in runs if run["cases"][0].get("ranks")]
  if scored:
    print("\nThe key digits' best rank per full layer (median over cases; kept if < kept):\n")
    columns = ["policy", "head_budget"] + [f"L{l} key best rank / kept" for l in layers]
    table = []
    for run in scored:
      rows = run["cases"]
      cells = [run["policy"], run["head_budget"]]
      for l in layers:
        best = np.median([r["ranks"][l]["key_best"] for r in rows])
        cells.append(f"{best:.0f} / {_mean(rows, 'kept', l):.0f}")
      table.append(cells)
    print_table(columns, table, numeric_from=2)
  spans = [run for run in scored if run["cases"][0].get("span_means")]
  if spans:
    print("\nMean score of each pass's span per full layer (case 0), and how often the")
    print("passes repeat the protected prefix:\n")
    for run in spans:
      first = run["cases"][0]
      for l in layers:
        means = " ".join(f"{m:.4f}" for m in first["span_means"][l])
        print(f"- {run['policy']} ({run['head_budget']}) L{l}: {means}")
      print(f"  {first['passes']} passes; the prefix repeated {first['prefix_repeated']} time(s)")


if __name__ == "__main__":
  main()
