"""Host-side invariant checks for caches (used by the tests; handy when debugging a policy)."""

from __future__ import annotations

import contextlib

import jax
import numpy as np

from kvjax.cache.paged_cache import PagedKVCache, to_host
from kvjax.cache.pages import NULL_PAGE, pages_for

__all__ = [
    "ByteTokenizer",
    "assert_cache_invariants",
    "assert_compressed_once",
    "counting_traces",
    "idle_metrics",
    "start_server",
    "tiny_gemma3",
    "tiny_hf_checkpoint",
    "tiny_llama",
]


def assert_cache_invariants(cache: PagedKVCache) -> None:
  """Raises AssertionError unless the allocator and page tables are consistent.

  - every sequence owns exactly its first ceil(length / page_size) table entries,
    each a real page, and the rest of its table points at the null page;
  - no physical page is owned twice, and owned + free = every page but the null page;
  - free pages carry no per-slot state (every declared slot is at its empty value).

  A cache sharded over a mesh is checked shard by shard (each pool with its table block).
  """
  if cache.mesh is not None:
    from kvjax import sharding

    table = sharding.blocks(cache, to_host(cache.page_table))
    length = sharding.blocks(cache, to_host(cache.length))
    for g in range(len(table)):
      pool = lambda x: to_host(x)[g]  # noqa: E731
      assert_cache_invariants(
          cache.replace(
              k_pages=jax.tree.map(pool, cache.k_pages),
              v_pages=jax.tree.map(pool, cache.v_pages),
              slots={name: pool(x) for name, x in cache.slots.items()},
              pages=cache.pages.replace(
                  table=table[g],
                  length=length[g],
                  free_pages=pool(cache.pages.free_pages),
                  num_free=pool(cache.pages.num_free),
                  status=pool(cache.pages.status),
              ),
              mesh=None,
          )
      )
    return
  cfg = cache.config
  table = np.asarray(cache.page_table)
  length = np.asarray(cache.length)
  num_free = int(cache.pages.num_free)
  assert (0 <= length).all() and (length <= cfg.max_tokens).all(), "length out of range"
  held = pages_for(length, cfg.page_size)
  owned_mask = np.arange(cfg.max_pages) < held[..., None]
  owned = table[owned_mask]
  assert (table[~owned_mask] == NULL_PAGE).all(), "unowned table entries must be null"
  assert (owned != NULL_PAGE).all() and (owned < cache.num_pages).all(), "bad owned page id"
  assert len(np.unique(owned)) == len(owned), "a physical page is owned twice"
  free = np.asarray(cache.pages.free_pages)[:num_free]
  assert len(np.unique(free)) == len(free), "a page is on the free stack twice"
  everything = np.sort(np.concatenate([owned, free]))
  assert np.array_equal(everything, np.arange(1, cache.num_pages)), (
      f"owned ({len(owned)}) + free ({len(free)}) pages must be the pool minus the null "
      f"page ({cache.num_pages - 1})"
  )
  for spec in cache.slot_specs:
    values = np.asarray(cache.slots[spec.name])[free]
    assert (values == spec.empty).all(), f"a free page keeps {spec.name!r} state"


class ByteTokenizer:
  """Ids are bytes + 3: enough tokenizer for a random model."""

  eos_ids = (2,)
  chat_template = None

  def encode(self, text):
    return [b + 3 for b in text.encode()]

  def decode(self, ids, skip_special_tokens=False):
    return bytes(max(i - 3, 0) for i in ids).decode(errors="replace")


def tiny_llama(vocab_size=259, n_layers=2, max_context=128, seed=0, qk_scale=1.0, dtype="float32"):
  """A random GQA Llama (d_model 32, 4 query / 2 kv heads, head_dim 8) for tests; weights
  from numpy, so building one compiles nothing. Its attention is near uniform (logits near
  0); `qk_scale` (e.g. 20) scales the q and k weights so that it is not. `dtype`: the
  parameters' dtype."""
  from models import ModelConfig
  from models.llama import Llama

  config = ModelConfig(
      vocab_size=vocab_size,
      d_model=32,
      n_layers=n_layers,
      n_heads=4,
      n_kv_heads=2,
      head_dim=8,
      ffn_dim=64,
      max_context=max_context,
      name="tiny",
  )
  return Llama.from_params(config, _random_params(config, seed, 0.02, qk_scale), dtype=dtype)


def _random_params(config, seed: int, std: float, qk_scale: float) -> dict:
  """Canonical params from numpy: norms 1, the rest normal(0, std), q and k x `qk_scale`."""
  rng = np.random.default_rng(seed)
  params = {
      name: np.ones(shape, np.float32) if "norm" in name else rng.normal(0, std, shape)
      for name, shape in config.param_shapes().items()
  }
  for name in params:
    if name.endswith((".wq", ".wk")):
      params[name] = params[name] * qk_scale
  return params


def tiny_gemma3(
    vocab_size=259, window=8, n_layers=3, max_context=256, seed=0, qk_scale=1.0, dtype="float32"
):
  """A random Gemma 3 (d_model 32, 4 query / 2 kv heads, head_dim 8) whose layers slide a
  `window` except every third (a full one), as Gemma 3's five of six do; weights as
  `tiny_llama`'s."""
  from models import ModelConfig
  from models.gemma3 import Gemma3

  config = ModelConfig(
      vocab_size=vocab_size,
      d_model=32,
      n_layers=n_layers,
      n_heads=4,
      n_kv_heads=2,
      head_dim=8,
      ffn_dim=64,
      max_context=max_context,
      tie_embeddings=True,
      name="tiny-gemma3",
      family="gemma3",
      qk_norm=True,
      sliding_window=window,
      layer_types=tuple("full" if i % 3 == 2 else "sliding" for i in range(n_layers)),
      rope_theta=1e6,
      rope_local_theta=1e4,
  )
  return Gemma3.from_params(config, _random_params(config, seed, 0.3, qk_scale), dtype=dtype)


def tiny_hf_checkpoint(path, seed: int = 0, nan: bool = False):
  """A Hugging Face Llama checkpoint directory of one layer with random weights and an
  8-token BPE tokenizer ("<>abcdef"), for tests of the loaders and the CLI; `nan` puts NaN
  in the final norm (every logit NaN). Returns the directory."""
  import json
  import pathlib

  import tokenizers
  from safetensors.numpy import save_file

  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  v, d, f = 8, 4, 6
  config = {
      "model_type": "llama",
      "vocab_size": v,
      "hidden_size": d,
      "intermediate_size": f,
      "num_hidden_layers": 1,
      "num_attention_heads": 2,
      "tie_word_embeddings": True,
      "bos_token_id": 0,
      "eos_token_id": 1,
  }
  (path / "config.json").write_text(json.dumps(config))
  names = {
      "model.embed_tokens.weight": (v, d),
      "model.norm.weight": (d,),
      "model.layers.0.input_layernorm.weight": (d,),
      "model.layers.0.post_attention_layernorm.weight": (d,),
      **{f"model.layers.0.self_attn.{p}_proj.weight": (d, d) for p in "qkvo"},
      "model.layers.0.mlp.gate_proj.weight": (f, d),
      "model.layers.0.mlp.up_proj.weight": (f, d),
      "model.layers.0.mlp.down_proj.weight": (d, f),
  }
  rng = np.random.default_rng(seed)
  tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in names.items()}
  if nan:
    tensors["model.norm.weight"][0] = np.nan
  save_file(tensors, path / "model.safetensors")
  vocab = {c: i for i, c in enumerate("<>abcdef")}
  tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[])).save(
      str(path / "tokenizer.json")
  )
  return path


def assert_compressed_once(state, context_length: int, *, row: int = 0) -> None:
  """A context compressed once under a shared budget: the row holds exactly its L x H x
  budget tokens (ties go to the earlier token), its sequences keep different amounts, the
  sink and recent tokens of every sequence survive, and later tokens are not evicted."""
  from kvjax.cache.paged_cache import read_sequence

  spec, cache = state.spec, state.cache
  assert_cache_invariants(cache)
  lengths = np.asarray(cache.length)[:, row]  # [L, H]
  budget = spec.budget_tokens(context_length)
  assert lengths.sum() == budget * lengths.size, (lengths.sum(), budget * lengths.size)
  assert len(set(lengths.ravel().tolist())) > 1, "a shared ranking: uneven sequences"
  recent = spec.recent_tokens(budget)
  must_keep = {*range(spec.sink), *range(context_length - recent, context_length)}
  for layer in range(lengths.shape[0]):
    for head in range(lengths.shape[1]):
      kept = set(read_sequence(cache, layer, row, head)[2].tolist())
      assert must_keep <= kept, (layer, head, sorted(must_keep - kept))
  assert state.plan.eviction is None  # compressed once: later tokens are kept


@contextlib.contextmanager
def counting_traces(model_class=None):
  """Inside the block, `model_class.run` (default `models.Llama`) records the token shape
  of each call into the yielded list: one entry per trace of a jitted step."""
  if model_class is None:
    from models.llama import Llama as model_class
  traces, original = [], model_class.run

  def counting_run(self, tokens, *args, **kwargs):
    traces.append(tokens.shape)
    return original(self, tokens, *args, **kwargs)

  model_class.run = counting_run
  try:
    yield traces
  finally:
    model_class.run = original


def start_server(flags, log_path, timeout: float = 300.0):
  """`kvjax serve --port 0 FLAGS...` in a process of its own, its output in `log_path`;
  returns (the process, its base URL on 127.0.0.1) once it listens. RuntimeError (with the
  log's end) when it exits or does not listen within `timeout` seconds. For tests and
  benchmarks: stop it with SIGTERM (it drains what runs, then exits 0)."""
  import os
  import subprocess
  import sys
  import time

  log = open(log_path, "w+")  # noqa: SIM115 - the process writes to it
  proc = subprocess.Popen(
      [sys.executable, "-m", "kvjax.cli", "serve", "--port", "0", *flags],
      stdout=log,
      stderr=subprocess.STDOUT,
      env={**os.environ, "PYTHONUNBUFFERED": "1"},
  )
  marker = "on http://127.0.0.1:"
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    log.seek(0)
    text = log.read()
    if marker in text:
      return proc, "http://127.0.0.1:" + text.split(marker)[1].split("/")[0]
    if proc.poll() is not None:
      raise RuntimeError(f"kvjax serve exited: {text[-2000:]}")
    time.sleep(0.2)
  proc.kill()
  raise RuntimeError(f"kvjax serve did not listen within {timeout:g} s")


def idle_metrics(url: str, seconds: float = 60.0, key: str | None = None) -> str:
  """A server's /metrics text once no row is in use and no request waits, or after
  `seconds` (bounded: the caller asserts on what it reads); `key`: an API key of a server
  that has keys (its /metrics takes one)."""
  import time

  import httpx

  headers = {} if key is None else {"Authorization": f"Bearer {key}"}
  deadline = time.monotonic() + seconds
  while True:
    metrics = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    idle = "kvjax_rows_in_use 0" in metrics and "kvjax_queue_depth 0" in metrics
    if idle or time.monotonic() > deadline:
      return metrics
    time.sleep(0.2)
