# Ran on kvjax at 7ebcab2 (full-cache variants), 30e2068 (with kvzip) and c54da88 (the `h`
# and `q` groupings), the commits that recorded its results; last edited at 754040c, which
# only renamed its kvjax imports to the layer folders; not re-run since. It imports kvjax
# internals, which may move again.
"""Feasibility probe for quantized pages (not the implementation, a measurement): K/V are
fake-quantized (quantized and read back at once) as they are appended to a full cache, and
the fidelity KL against the float cache is measured at 2048 tokens over 8 windows of the
shipped text, 64 continuation tokens each.

  python docs/results/quantized_pages/probe_fake_quant.py k8s-v8t 8
  python docs/results/quantized_pages/probe_fake_quant.py k8s-v8t 8 kvzip 0.5   # with a policy
  python docs/results/quantized_pages/probe_fake_quant.py float 8 kvzip 0.125   # nothing quantized

A variant names the keys' and the values' bits and grouping: `c` per channel over a page's
16 tokens, `t` per token over the 64 channels, `s` per token after dividing each channel by
its absolute maximum over the chunk ("smoothed"; one factor per sequence and channel), `g`
smoothed and per token in groups of 16 channels, `h` / `q` per token in groups of 16 / 32
channels, not smoothed. Decode steps (one token) are grouped per
token whatever the variant: the continuation's 64 tokens are a small share of the 2112.
"""

import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
os.environ["KVJAX_CACHE_DIR"] = "off"
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402
import models  # noqa: E402
from kvjax.cache import paged_cache as C  # noqa: E402
from pallas_kernels import page_format as pf  # noqa: E402
from kvjax import seam  # noqa: E402
from kvjax.eval import _data  # noqa: E402
from kvjax.eval._fidelity import continuation_logits, fidelity  # noqa: E402

variant = sys.argv[1]  # e.g. k8c-v8t, k4c-v4t, k4t-v4t, k8t-v8t, or float
windows = int(sys.argv[2]) if len(sys.argv) > 2 else 8
policy = sys.argv[3] if len(sys.argv) > 3 else "full"
budget = float(sys.argv[4]) if len(sys.argv) > 4 else None
if variant != "float":
  kbits, kgroup = int(variant[1]), variant[2]
  vbits, vgroup = int(variant[5]), variant[6]
QUANT = [False]
orig = C.append_layer


def fake(x, bits, group, ps=16):  # x [B, T, H, D]
  b, t, h, d = x.shape
  if group == "s":  # smoothed: per-channel absmax of the chunk divided out, then per token
    c = jnp.abs(x).max(axis=1, keepdims=True) + 1e-6
    return pf.dequantize(pf.quantize(x / c, bits, 3), 3) * c
  if group == "g":  # smoothed (keys) and per token in groups of 16 channels
    c = jnp.abs(x).max(axis=1, keepdims=True) + 1e-6
    y = (x / c).reshape(b, t, h, d // 16, 16)
    return pf.dequantize(pf.quantize(y, bits, 4), 4).reshape(b, t, h, d) * c
  if group in "hq":  # per token in groups of 16 (h) or 32 (q) channels, not smoothed
    return pf.dequantize_tokens(
        pf.quantize_tokens(x, bits, 16 if group == "h" else 32), 16 if group == "h" else 32
    )
  if group == "t":  # per token over D
    return pf.dequantize(pf.quantize(x, bits, 3), 3)
  if t % ps:  # decode steps (T=1): a page's channel group is not known here; per token
    return pf.dequantize(pf.quantize(x, bits, 3), 3)
  g = x.reshape(b, t // ps, ps, h, d)  # page-aligned chunks: per channel over a page
  return pf.dequantize(pf.quantize(g, bits, 2), 2).reshape(b, t, h, d)


def patched(cache, layer, k, v, *a, **kw):
  if QUANT[0]:
    k, v = fake(k, kbits, kgroup), fake(v, vbits, vgroup)
  return orig(cache, layer, k, v, *a, **kw)


seam.append_layer = patched
model, tok = models.load_llama()
ids = tok.encode(_data.default_text())
pairs = _data.text_windows(list(ids), 2048, 64, windows)
full = kvjax.CompressionSpec()
# Another static spec than the reference's: traced anew, with the patch on.
quant = kvjax.CompressionSpec(policy, budget=budget, kv_dtype="float32")
refs = [continuation_logits(model, c, n, full)[0] for c, n in pairs]
QUANT[0] = variant != "float"
kls, top1 = [], []
for (c, n), ref in zip(pairs, refs):
  r = fidelity(model, c, n, quant, reference_logits=ref, tokenizer=tok)
  kls.append(r["kl"])
  top1.append(r["top1"])
print(
    json.dumps(
        {
            "variant": variant,
            "policy": policy,
            "budget": budget,
            "windows": windows,
            "kl": float(np.mean(kls)),
            "top1": float(np.mean(top1)),
            "kl_max": float(np.max(kls)),
        }
    )
)
