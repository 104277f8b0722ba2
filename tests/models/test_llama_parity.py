"""Parity of `models.llama.Llama` with transformers' PyTorch models, float32 on CPU.

The oracle is independent of our loaders: transformers reads the default GGUF itself, and
the tiny checkpoints are written by transformers and read back by `load_hf_dir`. Our side
always runs through the paged cache (prefill, then one token per step).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
import kvjax.seam
from models import load_hf_dir, load_model, resolve_model
from models.llama import Llama

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-3  # max abs logit difference; float32 agreement is typically 1e-6..1e-4

# Plain English, written for this test; tokenizes to well over 64 tokens.
PROMPT_TEXT = (
    "The old lighthouse keeper climbed the narrow stairs every evening at dusk. He trimmed "
    "the wick, polished the great lens, and wrote the state of the weather in a small "
    "leather book. Ships passed far out on the water, and none of the sailors ever knew "
    "his name, but each of them trusted the light he kept burning through the long night "
    "until the morning came."
)
PROMPT_LEN = 64
GREEDY_STEPS = 32


@pytest.fixture(scope="module", autouse=True)
def _torch_threads():
  # CI has 2 cores; more threads only contend with XLA.
  torch.set_num_threads(2)


def make_forward(model, slide: bool = False):
  """A jitted `(state, tokens, positions, cache) -> (logits, cache)` for one model; `slide`:
  then its sliding layers free the pages their windows passed, as kvjax's steps do."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def forward(state, tokens, positions, cache):
    num_new = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    logits, cache = kvjax.seam.forward(
        nnx.merge(graphdef, state), tokens, positions, cache, num_new
    )
    return logits, (kvjax.eviction.slide(cache) if slide else cache)

  return lambda tokens, positions, cache: forward(state, tokens, positions, cache)


def jax_greedy(forward, cache, prompt, steps):
  """Prefill `prompt` [B, T], then decode `steps` greedy tokens one at a time.

  Returns (prefill logits [B, T, V], per-step logits [B, steps, V], tokens [B, steps], cache);
  step i's logits are those that chose token i (step 0 is the prefill's last position).
  """
  b, t = prompt.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  logits, cache = forward(jnp.asarray(prompt, jnp.int32), positions, cache)
  prefill = np.asarray(logits)
  step_logits, tokens = [prefill[:, -1]], [prefill[:, -1].argmax(-1)]
  for i in range(steps - 1):
    pos = jnp.full((b, 1), t + i, jnp.int32)
    logits, cache = forward(jnp.asarray(tokens[-1][:, None], jnp.int32), pos, cache)
    step_logits.append(np.asarray(logits)[:, 0])
    tokens.append(step_logits[-1].argmax(-1))
  return prefill, np.stack(step_logits, 1), np.stack(tokens, 1), cache


@torch.no_grad()
def torch_teacher_forced(model, prompt, tokens):
  """transformers' logits [B, T + steps - 1, V] over `prompt` followed by `tokens[:, :-1]`.

  If the argmax at positions T-1.. equals `tokens`, transformers' own greedy loop would
  emit exactly `tokens` (by induction over the steps), so one full forward replaces it.
  """
  seq = np.concatenate([prompt, tokens[:, :-1]], axis=1)
  return model(torch.as_tensor(seq, dtype=torch.long)).logits.numpy()


def max_diff(a, b):
  return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


# ---------------------------------------------------------------- default model (real GGUF)


@pytest.fixture(scope="module")
def smollm2():
  """(config, tokenizer, our forward, transformers model), loaded once per module."""
  try:
    path = resolve_model().path
  except FileNotFoundError as e:
    pytest.skip(str(e))
  config, params, tok = load_model(path)
  forward = make_forward(Llama.from_params(config, params))
  del params
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32
  ).eval()
  return config, tok, forward, ref


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
  _, tok, _, _ = smollm2
  ids = tok.encode(PROMPT_TEXT)
  assert len(ids) >= PROMPT_LEN, len(ids)
  return np.asarray(ids[:PROMPT_LEN], np.int32)[None]


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_smollm2_prefill_logits_match_transformers(smollm2, prompt_ids):
  config, _, forward, ref = smollm2
  cache = kvjax.init_cache(
      kvjax.CacheConfig(page_size=16, max_tokens=PROMPT_LEN),
      config.n_layers,
      1,
      config.n_kv_heads,
      config.head_dim,
  )
  positions = jnp.arange(PROMPT_LEN, dtype=jnp.int32)[None]
  ours, cache = forward(jnp.asarray(prompt_ids), positions, cache)
  kvjax.check_status(cache)
  with torch.no_grad():
    theirs = ref(torch.as_tensor(prompt_ids, dtype=torch.long)).logits.numpy()
  assert ours.shape == theirs.shape == (1, PROMPT_LEN, config.vocab_size)
  diff = max_diff(ours, theirs)
  msg = f"SmolLM2 prefill logits: max abs diff {diff:.3e}"
  print(msg)
  assert diff <= TOL, msg


@pytest.mark.slow  # ~14 s: -m slow; the prefill logits run by default
def test_smollm2_greedy_decode_matches_transformers(smollm2, prompt_ids):
  config, _, forward, ref = smollm2
  # Pages of 24: the 64-token prompt ends mid-page and decoding crosses pages at 72 and 96.
  cache_config = kvjax.CacheConfig(page_size=24, max_tokens=120)
  cache = kvjax.init_cache(cache_config, config.n_layers, 1, config.n_kv_heads, config.head_dim)
  _, ours_steps, ours_tokens, cache = jax_greedy(forward, cache, prompt_ids, GREEDY_STEPS)
  kvjax.check_status(cache)
  assert int(cache.length.max()) == PROMPT_LEN + GREEDY_STEPS - 1
  theirs_steps = torch_teacher_forced(ref, prompt_ids, ours_tokens)[:, PROMPT_LEN - 1 :]
  diff = max_diff(ours_steps, theirs_steps)
  msg = f"SmolLM2 decode-step logits: max abs diff {diff:.3e}"
  print(msg)
  np.testing.assert_array_equal(ours_tokens, theirs_steps.argmax(-1), err_msg=msg)
  assert diff <= TOL, msg


# ------------------------------------------------- tiny random checkpoints written by transformers

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA, 2 query heads per kv head
    max_position_embeddings=512,
)
# Llama-3 scaling with wavelengths (head_dim 16, theta 1e4) in all three bands: kept (< 64),
# smoothly blended (64..256) and divided by `factor` (> 256).
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
TINY_CASES = {
    "llama": ("llama", dict(rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama3_rope": (
        "llama",
        dict(rope_theta=10000.0, rope_scaling=LLAMA3_SCALING, tie_word_embeddings=False),
    ),
    "qwen2": ("qwen2", dict(rope_theta=10000.0, tie_word_embeddings=True)),
}
TINY_PROMPT, TINY_STEPS, TINY_BATCH = 24, 16, 2
TINY_TOL = 1e-4  # a float32 checkpoint against transformers (measured 2e-6 to 1.5e-5)


def build_tiny(kind, overrides, seed):
  """A transformers model with weights large enough that every part moves the logits."""
  torch.manual_seed(seed)
  if kind == "llama":
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, **overrides))
  else:
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY, **overrides))
  # HF's init (std 0.02, unit norms, zero biases) gives near-uniform attention and hides
  # bugs in norms, biases and RoPE; redraw everything at unit scale.
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g)
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.3 * noise)
      elif name.endswith(".bias"):
        p.copy_(0.5 * noise)
      elif "embed_tokens" in name:
        p.copy_(noise)
      else:  # [out, in] linear: unit-variance outputs
        p.copy_(noise / p.shape[1] ** 0.5)
  return model.eval()


@pytest.mark.parametrize(
    "case, page_size, shard",
    [("llama", 8, False), ("llama3_rope", 5, True), ("qwen2", 16, False)],
)
def test_tiny_checkpoint_matches_transformers(tmp_path, case, page_size, shard):
  kind, overrides = TINY_CASES[case]
  ref = build_tiny(kind, overrides, seed=len(case))
  # Small shards force model.safetensors.index.json and several files.
  ref.save_pretrained(tmp_path, max_shard_size="40KB" if shard else "50GB")
  assert (tmp_path / "model.safetensors.index.json").is_file() == shard

  config, params = load_hf_dir(tmp_path)
  assert config.qkv_bias == (kind == "qwen2")
  assert config.tie_embeddings == overrides["tie_word_embeddings"]
  assert (config.rope_scaling is not None) == ("rope_scaling" in overrides)
  model = Llama.from_params(config, params)

  rng = np.random.default_rng(len(case))
  prompt = rng.integers(0, TINY["vocab_size"], (TINY_BATCH, TINY_PROMPT), dtype=np.int32)
  cache = kvjax.init_cache(
      kvjax.CacheConfig(page_size=page_size, max_tokens=8 * page_size),
      config.n_layers,
      TINY_BATCH,
      config.n_kv_heads,
      config.head_dim,
  )
  ours = jax_greedy(make_forward(model), cache, prompt, TINY_STEPS)
  kvjax.check_status(ours[3])
  theirs = torch_teacher_forced(ref, prompt, ours[2])
  theirs_prefill, theirs_steps = theirs[:, :TINY_PROMPT], theirs[:, TINY_PROMPT - 1 :]

  prefill_diff, step_diff = max_diff(ours[0], theirs_prefill), max_diff(ours[1], theirs_steps)
  msg = f"{case}: max abs diff prefill {prefill_diff:.3e}, decode steps {step_diff:.3e}"
  print(msg)
  assert prefill_diff <= TINY_TOL and step_diff <= TINY_TOL, msg
  np.testing.assert_array_equal(ours[2], theirs_steps.argmax(-1), err_msg=msg)

  if case == "llama3_rope":
    # The scaling must matter on this prompt, or the case above proves nothing about it.
    plain = make_forward(Llama.from_params(dataclasses.replace(config, rope_scaling=None), params))
    unscaled = jax_greedy(plain, cache, prompt, 1)[0]
    assert max_diff(unscaled, theirs_prefill) > 100 * TOL


@pytest.mark.parametrize("shape", [(5,), (1, 5), (1, 1, 5), (2, 1, 5), (3, 4, 5)])
def test_linear_equals_the_matmul_for_any_rows(shape):
  """`linear` pads a one-row product to two rows (a compile-time saving on XLA:CPU): the
  result is the plain product's, in the input's shape."""
  from models.llama import linear

  rng = np.random.default_rng(len(shape))
  x = rng.normal(size=shape).astype(np.float32)
  w = rng.normal(size=(5, 7)).astype(np.float32)
  got = jax.jit(linear)(x, w)
  assert got.shape == shape[:-1] + (7,)
  np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)
