"""Prompt lengths map to a bounded set of compiled shapes (capacity buckets), and the
full cache's attention reads only live pages."""

import os

import numpy as np
import pytest

import kvjax
from kvjax.cache.sizing import BUCKET_TOKENS, capacity_bucket
from kvjax.testing import ByteTokenizer, tiny_llama


def test_capacity_buckets_are_few_and_hold_the_request():
  sizes = {capacity_bucket(n, 16, 8192) for n in range(1, 8193)}
  assert sizes == {2048, 4096, 6144, 8192}
  for n in (1, 15, 16, 17, 500, 1025, 2049, 4097, 8192):
    assert n <= capacity_bucket(n, 16, 8192) < n + BUCKET_TOKENS
  assert capacity_bucket(9000, 16, 8192) == 8192  # never past the model context
  assert capacity_bucket(100, 16, 1000) == 1008  # a page past a small model's context


def test_prompts_of_new_lengths_in_one_bucket_compile_nothing_new():
  model, tok = tiny_llama(max_context=1024), ByteTokenizer()
  rng = np.random.default_rng(0)
  counts = []
  for length in (70, 90, 100, 120):  # chunk 128, capacity bucket 1024 for all of them
    prompt = [rng.integers(3, 250, length).tolist()]
    result = kvjax.generate(model, tok, prompt, max_new_tokens=4)
    counts.append(result.stats["compiles"])
  assert counts[0] > 0 and counts[1:] == [0, 0, 0], counts


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_short_prompts_compile_their_prefill_chunk_only():
  """Prompts under 256 tokens prefill in chunks of their own power of two; the decode loop
  (which appends one token a step) is shared: each new chunk compiles one step, not two."""
  model, tok = tiny_llama(max_context=640), ByteTokenizer()  # shapes no other test compiles
  counts = [
      kvjax.generate(model, tok, [[7] * n], max_new_tokens=4).stats["compiles"]
      for n in (20, 40, 100, 30)
  ]
  assert counts == [2, 1, 1, 0], counts


@pytest.mark.parametrize(
    "spec, chunk",
    [
        (kvjax.CompressionSpec(), 512),
        (kvjax.CompressionSpec("kvzip", budget=0.25), 512),  # evicts once, after the context
        (kvjax.CompressionSpec("h2o", budget=256), 256),  # evicts after every chunk
        (kvjax.CompressionSpec(prefill_chunk=128), 128),
    ],
)
def test_prompts_past_2048_tokens_read_in_512_token_chunks_unless_evicting_while_read(spec, chunk):
  shape = kvjax.seam.ModelShape.of(tiny_llama(max_context=8192))
  assert spec.plan(shape, batch=1, longest=3000, reserve=64).chunk == chunk
  assert spec.plan(shape, batch=1, longest=1000, reserve=64).chunk == min(chunk, 256)


def test_contexts_compressed_once_share_one_pool_size_and_compile_once():
  """Every request of a plan compressed once (kvzip: kv heads and layers keep different
  counts) gets the pool its budget bounds, not an exact fit: the second and later
  prompts compile nothing; protected tokens beyond the budget take a larger pool that
  still holds them."""
  from kvjax.cache import sizing

  model, tok = tiny_llama(max_context=1024), ByteTokenizer()
  rng = np.random.default_rng(2)
  spec = kvjax.CompressionSpec(policy="kvzip", budget=32)
  counts, pools = [], set()
  for length in (100, 110, 120):
    prompt = [rng.integers(3, 250, length).tolist()]
    state = kvjax.prefill(model, prompt, spec, tokenizer=tok, reserve=4)
    pools.add(state.cache.config.num_pages)
    result = kvjax.generate(model, tok, prompt, spec, max_new_tokens=4)
    counts.append(result.stats["compiles"])
  assert counts[0] > 0 and counts[1:] == [0, 0], counts
  assert len(pools) == 1, pools
  sequences = 2 * 1 * 2  # layers x rows x kv heads
  bound = sizing.held_pages_bound(0, 32, sequences=sequences, page_size=16, once=True)
  assert pools == {1 + bound + sequences * 1}  # + a page of reserve per sequence
  assert sizing.compacted_pages(9, 10) == 10 and sizing.compacted_pages(17, 16) == 18
  assert sizing.compacted_pages(5, 0) == 5  # budget='auto': no bound, an exact fit


def test_the_request_sequence_compiles_one_set_of_steps():
  """The performance issue's six prompt lengths (480-1330 tokens, 8 new each) share one
  capacity bucket: the first compiles a prefill chunk step and a decode loop, the others
  nothing."""
  model, tok = tiny_llama(max_context=4096), ByteTokenizer()
  rng = np.random.default_rng(1)
  counts = []
  for length in (480, 650, 820, 990, 1160, 1330):
    prompt = [rng.integers(3, 250, length).tolist()]
    result = kvjax.generate(model, tok, prompt, max_new_tokens=8)
    assert result.stats["cache"]["max_tokens"] == 2048
    counts.append(result.stats["compiles"])
  assert counts == [2, 0, 0, 0, 0, 0], counts


@pytest.mark.parametrize("policy", [None, pytest.param("h2o", marks=pytest.mark.slow)])
def test_greedy_tokens_do_not_depend_on_the_capacity(policy):
  """A longer reserve (a larger bucket) changes shapes, never the answer."""
  model = tiny_llama(max_context=1024, qk_scale=20.0)
  spec = kvjax.CompressionSpec() if policy is None else kvjax.CompressionSpec(policy, budget=48)
  prompt = [list(range(3, 103))]
  short = kvjax.prefill(model, prompt, spec, reserve=8)
  long = kvjax.prefill(model, prompt, spec, reserve=600)
  _, a = kvjax.decode(model, short, 6)
  _, b = kvjax.decode(model, long, 6)
  assert a.tokens == b.tokens


_SCRIPT = """
import kvjax
from kvjax.testing import ByteTokenizer, tiny_llama
result = kvjax.generate(tiny_llama(), ByteTokenizer(), ["hello"], max_new_tokens=2)
print(result.stats["compiles"])
"""


@pytest.mark.parametrize("setting", ["dir", pytest.param("off", marks=pytest.mark.slow)])
def test_compiled_steps_persist_in_the_kvjax_cache_dir(tmp_path, setting):
  import os
  import subprocess
  import sys

  env = {**os.environ, "KVJAX_CACHE_DIR": str(tmp_path) if setting == "dir" else "off"}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  run = subprocess.run(
      [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300
  )
  assert run.returncode == 0, run.stderr
  entries = list((tmp_path / "jax").glob("*")) if (tmp_path / "jax").exists() else []
  assert bool(entries) == (setting == "dir")


@pytest.mark.slow  # heavy: run with -m slow
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="counts Linux memory maps")
def test_steps_kvjax_drops_free_their_code(monkeypatch):
  """JAX keeps every executable it compiled; on CPU each holds ~450 memory maps of JIT
  code, and a process dies at vm.max_map_count (65530) after ~140 of them. kvjax keeps
  `MAX_KEPT` steps and frees the rest, so a long run's maps stay bounded."""
  from kvjax.runtime import compilation

  monkeypatch.setattr(compilation, "MAX_KEPT", 2)
  compilation._KEPT.clear()  # start from no kept steps, whatever ran before
  model, tok = tiny_llama(), ByteTokenizer()

  def maps():
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)

  counts = [maps()]
  for i in range(8):  # 16 new steps: each budget is a new shape (sink=3: used nowhere else)
    spec = kvjax.CompressionSpec("h2o", budget=16 + 16 * i, sink=3)
    kvjax.generate(model, tok, [list(range(3, 40))], max_new_tokens=2, spec=spec)
    counts.append(maps())
  per_generate = counts[1] - counts[0]
  assert per_generate > 100, counts  # two steps take maps (else this proves nothing)
  # Kept: at most 2 steps, and 2 dropped ones before the next clear. Without freeing, the
  # 7 later generates would add ~7 x per_generate maps.
  assert max(counts[1:]) - counts[1] < 3 * per_generate, counts


def test_the_eviction_margin_grows_with_the_budget():
  from kvjax.cache.sizing import margin

  assert [margin(16, b) for b in (24, 256, 511, 512, 1024, 4096)] == [16, 16, 16, 32, 64, 256]
  assert kvjax.CacheConfig(page_size=16, max_tokens=2048, budget=1024).threshold == 1088


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_a_running_policy_evicts_once_per_margin_of_new_tokens():
  """At budget 512 (page 16) a sequence grows to 544 tokens before eviction brings it back
  to 512: one event per 33 new tokens, not per 17."""
  model = tiny_llama(max_context=1024)
  spec = kvjax.CompressionSpec("h2o", budget=512)
  prompt = np.random.default_rng(0).integers(3, 250, 600).tolist()
  state = kvjax.prefill(model, [prompt], spec, reserve=64)
  lengths = [int(np.asarray(state.cache.length).max())]
  for _ in range(80):
    state, _ = kvjax.decode(model, state, 1, donate=True)
    lengths.append(int(np.asarray(state.cache.length).max()))
  assert max(lengths) == 544 and min(lengths) == 512, lengths
  drops = [i for i in range(1, len(lengths)) if lengths[i] < lengths[i - 1]]
  assert len(drops) >= 2 and all(b - a == 33 for a, b in zip(drops, drops[1:])), lengths
