# Added with before.json and after.json in 0d5233c; not edited since. It uses kvjax's public
# API of either side of that change (kvjax.generate, kvjax.eval).
"""Records greedy tokens and fidelity KL, before and after the seam, CompressionSpec and the
session API replaced the policy/budget arguments (a before/after check):

  python docs/results/refactor/seam-and-session-api/record.py OUT.json
"""
import json, sys, time
import kvjax, models
from kvjax import eval as E

NEW = hasattr(kvjax, "CompressionSpec")
POLICIES = ["full", "h2o", "snapkv", "info_aware", "output_impact"]
BUDGETS = [0.5, 0.25]

def spec_kwargs(policy, budget):
  if NEW:
    return {"spec": kvjax.CompressionSpec(policy=policy, budget=budget)}
  return {"policy": policy, "budget": budget}

model, tok = models.load_llama()
text = E.default_text()
ids = tok.encode(text)
out = {"tokens": {}, "kl": {}}
t0 = time.time()
prompts = ["What is the capital of France?", tok.decode(ids[5000:5600])]
for policy in POLICIES:
  for budget in ([None] if policy == "full" else BUDGETS):
    for i, p in enumerate(prompts):
      if policy != "full" and i == 0:
        continue
      kw = spec_kwargs(policy, budget)
      if NEW:
        r = kvjax.generate(model, tok, [p], max_new_tokens=24, chat=True, **kw)
      else:
        r = kvjax.generate(model, tok, [p], max_new_tokens=24, chat=True, **kw)
      out["tokens"][f"{policy}/{budget}/{i}"] = r.tokens[0]
      print(policy, budget, i, r.tokens[0][:8], f"{time.time()-t0:.0f}s", flush=True)
refs = {}
for policy in POLICIES[1:]:
  for budget in BUDGETS:
    r = E.windowed_fidelity(model, tok, ids, context_tokens=2048, continuation_tokens=64,
                            windows=2, references=refs, **spec_kwargs(policy, budget))
    out["kl"][f"{policy}/{budget}"] = [r["kl"], r["top1"], r["failed"], r["errors"]]
    print(policy, budget, r["kl"], r["top1"], f"{time.time()-t0:.0f}s", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
