"""Sharded generation vs one device, run in a process of its own (the device count is fixed
when jax starts): `python tests/sharding_check.py DEVICES CASE...` prints one JSON line per
case. A CASE is [gemma3/]POLICY@MESH, e.g. h2o@data=2,model=2 (the tiny Llama) or
gemma3/kvzip@data=2,model=2 (a tiny Gemma 3: sliding-window layers beside full ones).
tests/test_sharding.py runs it."""

import json
import os
import pathlib
import sys

# The repository root, not tests/ (whose models/ would shadow the package).
sys.path[0] = str(pathlib.Path(__file__).resolve().parent.parent)

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={sys.argv[1]}"
)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402
from kvjax import policies  # noqa: E402
from kvjax.policies.learned import Scorer  # noqa: E402
from kvjax.fingerprint import model_fingerprint  # noqa: E402
from kvjax import sharding  # noqa: E402
from kvjax.testing import (  # noqa: E402
    ByteTokenizer,
    assert_cache_invariants,
    tiny_gemma3,
    tiny_llama,
)

PROMPTS = [
    "the quick brown fox jumps over the lazy dog, twice over",
    "hello world, this is a test of sharding",
    "abc " * 16,
    "zz top " * 8,
]
NEW_TOKENS = 8


def spec_for(policy: str) -> kvjax.CompressionSpec:
  """POLICY, or POLICY+SHARING (e.g. h2o+layer: AdaKV's budget shared across kv heads),
  either with :KV_DTYPE (e.g. h2o:int8, quantized pages). 16-token prefill chunks: a prompt
  takes several chunks, evicting between them."""
  policy, _, kv_dtype = policy.partition(":")
  kv_dtype = kv_dtype or None
  if policy == "full":
    return kvjax.CompressionSpec(prefill_chunk=16, kv_dtype=kv_dtype)
  name, _, sharing = policy.partition("+")
  if name == "learned":  # a random scorer made for the tiny model
    rng = np.random.default_rng(0)
    model = tiny_llama(max_context=256, qk_scale=20)
    scorer = Scorer(
        rng.normal(size=(2, 32, 2)), rng.normal(size=(2, 2)), "tiny", model_fingerprint(model)
    )
    name = policies.Learned(scorer=scorer)
  return kvjax.CompressionSpec(
      policy=name,
      budget=24,
      page_size=8,
      head_budget=sharing or None,
      prefill_chunk=16,
      kv_dtype=kv_dtype,
  )


def model_for(case_policy: str):
  """The tiny model a case names ("gemma3/..." or the Llama) and the policy's part."""
  family, _, policy = case_policy.rpartition("/")
  if family == "gemma3":  # windows of 8 tokens: the prompts pass them
    return tiny_gemma3(window=8, max_context=256, qk_scale=3.0), policy
  return tiny_llama(max_context=256, qk_scale=20), policy


def run(case_policy: str, mesh):
  """Prefill, then two decodes (the second must compile nothing): tokens, logits, cache."""
  model, policy = model_for(case_policy)
  before = kvjax.compile_stats()["compiles"]
  state = kvjax.prefill(model, PROMPTS, spec_for(policy), tokenizer=ByteTokenizer(), mesh=mesh)
  state, first = kvjax.decode(model, state, NEW_TOKENS, return_logits=True)
  compiles = kvjax.compile_stats()["compiles"] - before
  state, second = kvjax.decode(model, state, NEW_TOKENS, return_logits=True)
  logits = np.concatenate([np.asarray(first.logits), np.asarray(second.logits)], axis=1)
  counts = {"first": compiles, "first_decode": first.stats["compiles"]}
  counts["second_decode"] = second.stats["compiles"]
  return state, first.tokens + second.tokens, logits, counts


def main():
  references = {}
  for case in sys.argv[2:]:
    policy, mesh = case.split("@")
    if policy not in references:
      references[policy] = run(policy, None)
    ref_state, ref_tokens, ref_logits, ref_counts = references[policy]
    state, tokens, logits, counts = run(policy, mesh)
    assert_cache_invariants(state.cache)  # every shard's pool and table block
    per_device = sharding.shard_bytes(state.cache)
    unsharded = sum(x.nbytes for x in jax.tree.leaves(ref_state.cache))
    print(
        json.dumps(
            {
                "case": case,
                "same_tokens": tokens == ref_tokens,
                "max_logit_diff": float(np.abs(logits - ref_logits).max()),
                # kvjax's compiled steps: prefill (several chunks) + first decode, the
                # decode loop alone, and a second decode of the same length.
                "compiles": counts,
                "one_device_compiles": ref_counts,
                "kv_bytes": [state.kv_bytes(), ref_state.kv_bytes()],
                "devices": len(per_device),
                "bytes_per_device": sorted(per_device.values()),
                "unsharded_bytes": unsharded,
                "pool_pages": [state.cache.num_pages, ref_state.cache.num_pages],
                # One page of every pool array (K, V, slots): each shard has a null page.
                "one_page_bytes": sum(
                    x.nbytes // x.shape[0]
                    for x in jax.tree.leaves(
                        [ref_state.cache.k_pages, ref_state.cache.v_pages, ref_state.cache.slots]
                    )
                ),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
  main()
