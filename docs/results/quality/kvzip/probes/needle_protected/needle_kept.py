# Ran on kvjax at c536944, the commit that recorded its output (needle_kept.txt,
# digits_kept.txt); last edited at 754040c, which only renamed its kvjax imports to the layer
# folders; not re-run since. It imports kvjax internals, which may move again.
"""How much of the passkey needle kvzip keeps at 12.5 % (256 of 2048 tokens per sequence, one
ranking over all layers and kv heads, approximated here from the scores), per layer.

  PYTHONPATH=. python docs/results/quality/kvzip/probes/needle_protected/needle_kept.py [--digits] [--every N]

--digits: only the key's digit tokens (each digit is its own token); --every N: every Nth
case of the 24 (needle_kept.txt: all of the needle, N=3; digits_kept.txt: --digits, N=6).
"""

import argparse
import json

import numpy as np

import kvjax
from kvjax.eval import _data, _tasks
from models.llama import load_llama

parser = argparse.ArgumentParser()
parser.add_argument("--digits", action="store_true")
parser.add_argument("--every", type=int, default=3)
parser.add_argument("--policies", nargs="+", default=["kvzip", "kvzip:attend_to=context"])
args = parser.parse_args()

model, tok = load_llama()
depths = (0.1, 0.25, 0.4, 0.55, 0.7, 0.85)
cases = _tasks.passkey_cases(tok, 2048, depths=depths, trials=4, fillers=("text",))
res = json.load(open("docs/results/quality/kvzip/passkey/results.json"))
rows = {(r["policy"], r["budget"]): r for r in res["rows"]}
answered = [a["expected"] in a["answer"] for a in rows[("kvzip", 0.125)]["answers"]]
for i, case in enumerate(cases):
  if i % args.every:
    continue
  ids = case["ids"]
  needle = tok.encode(_data.PASSKEY_NEEDLE.format(key=case["answer"]))
  start = next(j for j in range(len(ids)) if ids[j : j + len(needle)] == needle)
  where = range(len(needle))
  if args.digits:
    where = [j for j, t in enumerate(needle) if any(ch.isdigit() for ch in tok.decode([t]))]
  print(f"case {i} depth {case['depth']} ok125={answered[i]}")
  for policy in args.policies:
    prompt = _tasks.context_prompt(tok, ids, True)
    spec = kvjax.CompressionSpec(policy=policy, budget=256)
    scored = kvjax.runtime.session.scored_context(model, [prompt], spec, tokenizer=tok)
    s, valid, marked = scored.scores[:, 0], scored.valid[:, 0], scored.marked[:, 0]  # [L, H, N]
    layers, heads, _ = s.shape
    candidates = np.where(valid & ~marked, s, -np.inf)
    threshold = np.sort(candidates.ravel())[::-1][256 * layers * heads - 1]
    kept = candidates >= threshold  # [L, H, N]
    needle_kept = kept[:, :, len(prompt[0].text) + start + np.asarray(list(where))]
    per_layer = needle_kept.mean(axis=(1, 2))
    print(f"  {policy:28s} needle kept {needle_kept.mean():.2f}; per layer "
          + " ".join(f"{x:.1f}" for x in per_layer))
    print(f"  {'':28s} tokens/head per layer "
          + " ".join(f"{int(x)}" for x in kept.sum(axis=(1, 2)) / heads))
