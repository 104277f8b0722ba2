# Recorded before.json at 2d3e18e and after.json at e96391a (70f3f10's message); not edited
# since. It uses kvjax's public API (kvjax.generate, kvjax.eval).
"""Records what the restructuring (the page table in one module, policies as a package, the
session split into modules, one sizing module) must not change: greedy tokens, peak and final
KV bytes of every policy at two budgets, and fidelity KL for the scoring policies.

  D=docs/results/refactor/pages-policies-session-split
  python $D/record.py $D/before.json   # on the old code
  python $D/record.py $D/after.json
  python $D/record.py --compare $D/before.json $D/after.json
"""

import json
import sys
import time

POLICIES = [
    "full", "streaming", "h2o", "h2o_mean", "group_history", "tova", "snapkv", "knorm",
    "random", "output_impact", "dropkv", "info_aware", "kvzip", "learned", "expected_attention",
]
BUDGETS = [0.5, 0.25]
FIDELITY = ["h2o", "snapkv", "kvzip", "learned", "expected_attention", "info_aware", "output_impact"]


def record(path):
  import kvjax
  import models
  from kvjax import eval as E

  model, tok = models.load_llama()
  ids = tok.encode(E.default_text())
  out = {"generate": {}, "fidelity": {}}
  start = time.time()
  prompt = tok.decode(ids[5000:5600])
  for policy in POLICIES:
    for budget in [None] if policy == "full" else BUDGETS:
      spec = kvjax.CompressionSpec(policy=policy, budget=budget)
      r = kvjax.generate(model, tok, [prompt], spec, max_new_tokens=24, chat=True)
      out["generate"][f"{policy}/{budget}"] = {
          "tokens": r.tokens[0],
          "peak_kv_bytes": r.stats["peak_kv_bytes"],
          "final_kv_bytes": r.stats["final_kv_bytes"],
      }
      print(policy, budget, r.tokens[0][:6], f"{time.time() - start:.0f}s", flush=True)
  references = {}
  for policy in FIDELITY:
    for budget in BUDGETS:
      spec = kvjax.CompressionSpec(policy=policy, budget=budget)
      r = E.windowed_fidelity(
          model, tok, ids, spec=spec, context_tokens=2048, continuation_tokens=32, windows=2,
          references=references,
      )
      out["fidelity"][f"{policy}/{budget}"] = {"kl": r["kl"], "top1": r["top1"]}
      print(policy, budget, r["kl"], r["top1"], f"{time.time() - start:.0f}s", flush=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=1)


def compare(before, after):
  a, b = (json.load(open(p)) for p in (before, after))
  same = a == b
  for part in ("generate", "fidelity"):
    for key in a[part]:
      if a[part][key] != b[part].get(key):
        print("differs:", part, key, a[part][key], b[part].get(key))
  print("identical" if same else "NOT identical", f"({len(a['generate'])} generations, "
        f"{len(a['fidelity'])} fidelity cells)")
  return 0 if same else 1


if __name__ == "__main__":
  if sys.argv[1] == "--compare":
    sys.exit(compare(sys.argv[2], sys.argv[3]))
  record(sys.argv[1])
