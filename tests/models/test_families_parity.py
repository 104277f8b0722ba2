"""Parity of the other model families (Gemma 3, Qwen3, Mistral) with transformers on tiny
random checkpoints that transformers writes and `load_hf_dir` reads back (no download);
float32 on CPU, our side through the paged cache (prefill, then one token per step)."""

import numpy as np
import pytest

import kvjax
from models import Gemma3, Llama, load_hf_dir
from kvjax.cache.sizing import window_peak
from models.gemma3 import build
from test_llama_parity import TINY, jax_greedy, make_forward, max_diff, torch_teacher_forced

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4  # max abs logit difference (the bound for tiny checkpoints)
PROMPT, STEPS, BATCH = 24, 16, 2
WINDOW = 10  # well inside PROMPT + STEPS: the sliding layers drop pages as they go

FAMILIES = {
    # Two sliding layers around a full one; local and global RoPE bases differ, and the
    # attention scale is not head_dim's.
    "gemma3": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=3,
            head_dim=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=WINDOW,
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            query_pre_attn_scalar=24,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3": (
        "Qwen3ForCausalLM",
        "Qwen3Config",
        dict(head_dim=16, rope_theta=1e6, tie_word_embeddings=True),
    ),
    "mistral": (
        "MistralForCausalLM",
        "MistralConfig",
        dict(sliding_window=WINDOW, rope_theta=1e4, tie_word_embeddings=False),
    ),
}


def build_tiny(family: str, seed: int):
  """transformers' model of `family` with unit-scale random weights (HF's init gives
  near-uniform attention and hides bugs in norms and RoPE)."""
  model_cls, config_cls, overrides = FAMILIES[family]
  torch.manual_seed(seed)
  config = getattr(transformers, config_cls)(**{**TINY, **overrides})
  config._attn_implementation = "eager"
  model = getattr(transformers, model_cls)(config)
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g)
      if name.endswith("norm.weight"):
        # Gemma scales by (1 + w): w near 0.3 * noise; the others by w near 1.
        p.copy_((0.0 if family == "gemma3" else 1.0) + 0.3 * noise)
      elif "embed_tokens" in name:
        p.copy_(noise)
      else:
        p.copy_(noise / p.shape[1] ** 0.5)
  return model.eval()


@pytest.fixture(scope="module", autouse=True)
def _torch_threads():
  torch.set_num_threads(2)


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_checkpoint_matches_transformers(tmp_path, family):
  ref = build_tiny(family, seed=len(family))
  ref.save_pretrained(tmp_path)
  config, params = load_hf_dir(tmp_path)
  model = build(config, params)
  assert isinstance(model, Gemma3) == (family == "gemma3") and isinstance(model, Llama)
  assert config.qk_norm == (family != "mistral")
  if family == "gemma3":
    assert config.layer_windows == (WINDOW, 0, WINDOW)
    assert (config.rope_theta, config.rope_local_theta) == (1e6, 1e4)
  if family == "mistral":
    assert config.layer_windows == (WINDOW,) * TINY["num_hidden_layers"]
  assert kvjax.ModelShape.of(model).max_context == 512

  rng = np.random.default_rng(len(family))
  prompt = rng.integers(0, TINY["vocab_size"], (BATCH, PROMPT), dtype=np.int32)
  windows = kvjax.ModelShape.of(model).windows
  cache = kvjax.init_cache(
      kvjax.CacheConfig(page_size=4, max_tokens=64, windows=windows),
      config.n_layers,
      BATCH,
      config.n_kv_heads,
      config.head_dim,
      chunk=PROMPT,
  )
  ours = jax_greedy(make_forward(model, slide=True), cache, prompt, STEPS)
  kvjax.check_status(ours[3])
  length = np.asarray(ours[3].length)  # [L, B, H] after the last step
  for layer, window in enumerate(windows or (0,) * config.n_layers):
    held = PROMPT + STEPS - 1 if not window else window_peak(window, 4, 0)
    assert length[layer].max() <= held, (layer, length[layer])
  theirs = torch_teacher_forced(ref, prompt, ours[2])
  prefill_diff = max_diff(ours[0], theirs[:, :PROMPT])
  step_diff = max_diff(ours[1], theirs[:, PROMPT - 1 :])
  msg = f"{family}: max abs diff prefill {prefill_diff:.3e}, decode steps {step_diff:.3e}"
  print(msg)
  np.testing.assert_array_equal(ours[2], theirs[:, PROMPT - 1 :].argmax(-1), err_msg=msg)
  assert prefill_diff <= TOL and step_diff <= TOL, msg


@pytest.mark.slow  # -m slow; generate on Gemma 3 runs in test_hybrid_cache
def test_a_gemma3_checkpoint_generates_through_the_api(tmp_path):
  """`kvjax.generate` on a Gemma 3 checkpoint: with the full cache, the greedy tokens
  transformers would choose; under a policy, it runs; past the window, a clear error."""
  from kvjax.testing import ByteTokenizer

  ref = build_tiny("gemma3", seed=3)
  ref.save_pretrained(tmp_path)
  model = build(*load_hf_dir(tmp_path))
  tok = ByteTokenizer()
  prompt = "hello gemma"
  tokens = kvjax.generate(model, tok, [prompt], max_new_tokens=8).tokens[0]
  ids = np.asarray([tok.encode(prompt)], np.int64)
  assert 1 <= len(tokens) <= 8 and max(ids[0]) < TINY["vocab_size"]
  want = torch_teacher_forced(ref, ids, np.asarray([tokens]))[0, ids.shape[1] - 1 :].argmax(-1)
  assert tokens == want.tolist()
  spec = kvjax.CompressionSpec(policy="h2o", budget=8)
  assert kvjax.generate(model, tok, [prompt], spec, max_new_tokens=8).tokens[0]
