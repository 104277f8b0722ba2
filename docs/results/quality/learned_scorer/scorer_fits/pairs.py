# Ran on kvjax at c536944, the commit that recorded its fits (results.txt); last edited at
# 754040c, which only renamed its kvjax imports to the layer folders; not re-run since. It
# imports kvjax internals, which may move again.
# Compute (features, targets) for 24 windows once; save for fitting experiments.
import numpy as np, time
from models.llama import load_llama
from kvjax.tuning import scorer_training as training
from kvjax.eval._data import text_windows, default_text
model, tok = load_llama()
ids = tok.encode(default_text())
pairs = text_windows(list(ids), 2048, 0, 24)
t = time.time()
for i, (ctx, _) in enumerate(pairs):
  x, y = training.training_pairs(model, tok, ctx)
  np.save(f"/tmp/p34/pairs/x{i}.npy", x.astype(np.float16)); np.save(f"/tmp/p34/pairs/y{i}.npy", y)
  print(i, x.shape, y.shape, round(time.time()-t), flush=True)
