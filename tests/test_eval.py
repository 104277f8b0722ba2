import numpy as np
import pytest
from flax import nnx

from kvjax import eval as E
from models import ModelConfig
from models.llama import Llama


def _tiny_model():
  config = ModelConfig(
      vocab_size=64,
      d_model=32,
      n_layers=2,
      n_heads=4,
      n_kv_heads=2,
      head_dim=8,
      ffn_dim=64,
      max_context=256,
      name="tiny",
  )
  return Llama(config, rngs=nnx.Rngs(0))


def test_full_cache_fidelity_is_exact_and_compression_is_measured():
  model = _tiny_model()
  rng = np.random.default_rng(0)
  context, continuation = rng.integers(0, 64, 96).tolist(), rng.integers(0, 64, 12).tolist()
  full = E.fidelity(model, None, context, continuation)
  assert full["kl"] == 0.0 and full["top1"] == 1.0 and full["ppl"] == full["ppl_full"]
  squeezed = E.fidelity(
      model, None, context, continuation, policy="h2o", budget=16, prefill_chunk=16, page_size=4
  )
  assert squeezed["kl"] > 0.0 and squeezed["peak_kv_bytes"] < full["peak_kv_bytes"]


def test_compare_predictions_matches_hand_computed_values():
  ref = np.log(np.array([[0.5, 0.5], [0.9, 0.1]]))
  got = np.log(np.array([[0.25, 0.75], [0.9, 0.1]]))
  r = E.compare_predictions(ref, got, np.array([0, 0]))
  kl = 0.5 * np.log(0.5 / 0.25) + 0.5 * np.log(0.5 / 0.75)
  assert r["kl"] == pytest.approx(kl / 2, rel=1e-5)
  assert r["top1"] == 0.5  # argmax of [0.5, 0.5] is 0, of [0.25, 0.75] is 1
  assert r["ppl_full"] == pytest.approx(np.exp(-(np.log(0.5) + np.log(0.9)) / 2), rel=1e-5)
  assert r["ppl"] == pytest.approx(np.exp(-(np.log(0.25) + np.log(0.9)) / 2), rel=1e-5)


def test_fidelity_rejects_empty_text():
  with pytest.raises(ValueError, match="non-empty context and continuation, got 0 and 3"):
    E.fidelity(_tiny_model(), None, [], [1, 2, 3])
