"""SmolLM2 2048-token prefill in one process: `real` attention, or (argv[1] == "none") a
stand-in of the same output shape, so the time left is the linear layers, norms, RoPE,
page writes. Run each in its own process and cache directory (the steps are compiled once)."""

import sys, time
import jax, jax.numpy as jnp, numpy as np
import kvjax
from kvjax import seam
from models import load_decoder
from kvjax.eval import default_text

if sys.argv[1] == "none":

  def stand_in(q, *args, **kw):
    lse = jnp.zeros(q.shape[:3], jnp.float32)
    return (q, None, lse) if kw.get("return_lse") else (q, None)

  seam.paged_attention = stand_in
model, tok = load_decoder("smollm2-135m-instruct")
ids = tok.encode(default_text())[:2048]
times = []
for _ in range(4):
  t = time.perf_counter()
  st = kvjax.prefill(model, [ids])
  jax.block_until_ready(st.logits)
  times.append(time.perf_counter() - t)
print(sys.argv[1], "median of last 3: %.3f s" % np.median(times[1:]), ["%.2f" % x for x in times])
