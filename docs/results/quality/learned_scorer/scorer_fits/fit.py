# Ran at c536944, the commit that recorded its fits (results.txt); not edited since. It
# reads the arrays pairs.py wrote (it imports no kvjax).
import numpy as np, jax, jax.numpy as jnp, optax, sys, time
N = 24; test = 6
SKIP = int(__import__("os").environ.get("SKIP", "0"))
xs = [np.load(f"/tmp/p34/pairs/x{i}.npy") for i in range(SKIP, N)]
ys = [np.load(f"/tmp/p34/pairs/y{i}.npy") for i in range(SKIP, N)]
import os
if os.environ.get("CONCAT"):
  xs = [np.concatenate([x, np.concatenate([x[1:], x[-1:]], axis=0)], axis=-1) for x in xs]
X = np.concatenate(xs[:-test], axis=1).astype(np.float32); Y = np.concatenate(ys[:-test], axis=1)
L, n, d = X.shape; H = Y.shape[-1]
print("train tokens", n, flush=True)

def predict(params, x):  # x [L, N, d]
  if "w1" in params:
    h = jax.nn.gelu(jnp.einsum("lnd,ldk->lnk", x, params["w1"]) + params["b1"][:, None])
    return jnp.einsum("lnk,lkh->lnh", h, params["w2"]) + params["b2"][:, None]
  return jnp.einsum("lnd,ldh->lnh", x, params["weight"]) + params["bias"][:, None]

def fit(kind, hidden=64, steps=1500, batch=1024, lr=3e-3, seed=0, clip=None):
  key = jax.random.PRNGKey(seed)
  y_all = Y if clip is None else np.maximum(Y, clip)
  if kind == "linear":
    params = {"weight": jnp.zeros((L, d, H)), "bias": jnp.asarray(y_all.mean(axis=1))}
  else:
    k1, k2 = jax.random.split(key)
    params = {"w1": jax.random.normal(k1, (L, d, hidden)) / np.sqrt(d), "b1": jnp.zeros((L, hidden)),
              "w2": jnp.zeros((L, hidden, H)), "b2": jnp.asarray(y_all.mean(axis=1))}
  opt = optax.adam(optax.cosine_decay_schedule(lr, steps, alpha=0.05))
  state = opt.init(params)
  order = np.random.default_rng(seed).permutation(n)
  xa, ya = jnp.asarray(X[:, order]), jnp.asarray(y_all[:, order])
  batches = max(1, n // batch)
  @jax.jit
  def step(params, state, i):
    s = (i % batches) * batch
    x = jax.lax.dynamic_slice_in_dim(xa, s, batch, axis=1); y = jax.lax.dynamic_slice_in_dim(ya, s, batch, axis=1)
    loss, g = jax.value_and_grad(lambda p: jnp.mean((predict(p, x) - y) ** 2))(params)
    u, state = opt.update(g, state, params)
    return optax.apply_updates(params, u), state, loss
  for i in range(steps):
    params, state, loss = step(params, state, jnp.int32(i))
  return params

def evaluate(params):
  r2, ov = [], {0.5: [], 0.25: [], 0.125: []}
  for x, y in zip(xs[-test:], ys[-test:]):
    p = np.asarray(jax.jit(predict)(params, jnp.asarray(x.astype(np.float32))))
    r2.append(1 - np.mean((p - y) ** 2) / np.var(y))
    for keep in ov:
      k = int(keep * y.size)
      a = set(np.argpartition(-y.ravel(), k - 1)[:k].tolist()); b = np.argpartition(-p.ravel(), k - 1)[:k]
      ov[keep].append(len(a.intersection(b.tolist())) / k)
  return round(float(np.mean(r2)), 4), {k: round(float(np.mean(v)), 4) for k, v in ov.items()}

for spec in sys.argv[1:]:
  kw = eval(f"dict({spec})")
  t = time.time(); params = fit(**kw)
  print(spec, evaluate(params), f"{time.time()-t:.0f}s", flush=True)
  if "save" in sys.argv[-1:]: pass
