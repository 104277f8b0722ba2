"""Records what a refactor must not change, to compare before and after it: greedy tokens and
peak/final KV bytes of every policy at two budgets (plus int8 pages, a per-layer head budget
and a compressed-once state decoded through the session API), and fidelity KL of the scoring
policies. Uses only kvjax's public API, so the same script runs on the code before and after.

  python -m benchmarks.behaviour_record before.json     # on the old code
  python -m benchmarks.behaviour_record after.json      # on the new code
  python -m benchmarks.behaviour_record --compare before.json after.json   # exit 1 if any differ

The results of the restructure into layer folders are in docs/results/refactor/.
"""

import json
import sys
import tempfile
import time

POLICIES = [
    "full",
    "streaming",
    "h2o",
    "h2o_mean",
    "group_history",
    "tova",
    "snapkv",
    "knorm",
    "random",
    "output_impact",
    "dropkv",
    "info_aware",
    "kvzip",
    "kvzip_plus",
    "learned",
    "expected_attention",
]
BUDGETS = [0.5, 0.25]
# Other paths through the cache: quantized pages, a shared head budget, a fixed page size.
VARIANTS = {
    "h2o/int8": dict(policy="h2o", budget=0.25, kv_dtype="int8"),
    "kvzip/int4": dict(policy="kvzip", budget=0.5, kv_dtype="int4"),
    "snapkv/layer": dict(policy="snapkv", budget=0.25, head_budget="layer"),
    "tova/page8": dict(policy="tova", budget=0.25, page_size=8, group_size=8),
}
FIDELITY = [
    "h2o",
    "snapkv",
    "kvzip",
    "learned",
    "expected_attention",
    "info_aware",
    "output_impact",
]


def _generation(kvjax, model, tok, prompt, **spec):
  r = kvjax.generate(
      model, tok, [prompt], kvjax.CompressionSpec(**spec), max_new_tokens=24, chat=True
  )
  return {
      "tokens": r.tokens[0],
      "peak_kv_bytes": r.stats["peak_kv_bytes"],
      "final_kv_bytes": r.stats["final_kv_bytes"],
  }


def record(path):
  import kvjax
  import models
  from kvjax import eval as E

  model, tok = models.load_llama()
  ids = tok.encode(E.default_text())
  out = {"generate": {}, "session": {}, "fidelity": {}}
  start = time.time()
  prompt = tok.decode(ids[5000:5600])
  for policy in POLICIES:
    for budget in [None] if policy == "full" else BUDGETS:
      out["generate"][f"{policy}/{budget}"] = r = _generation(
          kvjax, model, tok, prompt, policy=policy, budget=budget
      )
      print(policy, budget, r["tokens"][:6], f"{time.time() - start:.0f}s", flush=True)
  for name, spec in VARIANTS.items():
    out["generate"][name] = r = _generation(kvjax, model, tok, prompt, **spec)
    print(name, r["tokens"][:6], f"{time.time() - start:.0f}s", flush=True)
  # The session API: a context compressed once, extended by a question, forked, saved,
  # loaded back and decoded.
  spec = kvjax.CompressionSpec(policy="kvzip", budget=0.25)
  state = kvjax.prefill(model, [prompt], spec, tokenizer=tok)
  state = kvjax.extend(model, state, ["What is this text about?"], tokenizer=tok)
  a, _ = kvjax.fork(state, 2)
  with tempfile.TemporaryDirectory() as tmp:
    kvjax.save_state(f"{tmp}/doc.kvjax", a, model)
    info = kvjax.state_info(f"{tmp}/doc.kvjax")
    a = kvjax.load_state(f"{tmp}/doc.kvjax", model)
  _, ra = kvjax.decode(model, a, max_new_tokens=16)
  out["session"]["kvzip/0.25"] = {
      "tokens": ra.tokens[0],
      # Not the time of saving, nor the digest (it covers that time).
      "info": {
          k: v
          for k, v in info.items()
          if isinstance(v, (int, float, str)) and k not in ("kvjax_version", "saved_at", "digest")
      },
  }
  print("session", ra.tokens[0][:6], sorted(info), flush=True)
  references = {}
  for policy in FIDELITY:
    for budget in BUDGETS:
      spec = kvjax.CompressionSpec(policy=policy, budget=budget)
      r = E.windowed_fidelity(
          model,
          tok,
          ids,
          spec=spec,
          context_tokens=2048,
          continuation_tokens=32,
          windows=2,
          references=references,
      )
      out["fidelity"][f"{policy}/{budget}"] = {"kl": r["kl"], "top1": r["top1"]}
      print(policy, budget, r["kl"], r["top1"], f"{time.time() - start:.0f}s", flush=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=1)


def compare(before, after):
  a, b = (json.load(open(p)) for p in (before, after))
  for part in a:
    for key in a[part]:
      if a[part][key] != b.get(part, {}).get(key):
        print("differs:", part, key, a[part][key], b.get(part, {}).get(key))
  same = a == b
  counts = ", ".join(f"{len(a[part])} {part}" for part in a)
  print("identical" if same else "NOT identical", f"({counts})")
  return 0 if same else 1


if __name__ == "__main__":
  if len(sys.argv) == 4 and sys.argv[1] == "--compare":
    sys.exit(compare(sys.argv[2], sys.argv[3]))
  if len(sys.argv) != 2:
    sys.exit(__doc__)
  record(sys.argv[1])
