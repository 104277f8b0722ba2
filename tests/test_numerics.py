"""Non-finite logits are an error naming the step and the rows, never a token."""

import numpy as np
import pytest

import kvjax
from kvjax import cli
from kvjax.testing import ByteTokenizer, tiny_hf_checkpoint, tiny_llama
from models.llama import Llama

BAD = 7  # a token whose embedding is NaN in the models below


def _model_with_a_nan_token(**kwargs):
  """tiny_llama whose embedding of token BAD is NaN: a row that reads it gets NaN logits."""
  model = tiny_llama(**kwargs)
  embed = np.array(model.embed[...])
  embed[BAD] = np.nan
  model.embed[...] = embed
  return model


@pytest.fixture(scope="module")
def model():
  return _model_with_a_nan_token()


@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_prefill_names_the_rows_whose_logits_are_not_finite(model, policy):
  spec = kvjax.CompressionSpec() if policy == "full" else kvjax.CompressionSpec("h2o", budget=16)
  prompts = [[5, 6, 8, 9], [5, BAD, 8, 9], [10, 11]]
  with pytest.raises(kvjax.NumericsError, match=r"prefill: .*non-finite logits .*rows \[1\]"):
    kvjax.prefill(model, prompts, spec)


def test_decode_stops_at_non_finite_logits_and_names_the_rows(model):
  state = kvjax.prefill(model, [[5, 6, 8], [5, 6, 8]])
  forced = np.array([[9, 10, 11, 12], [9, BAD, 11, 12]], np.int32)
  with pytest.raises(kvjax.NumericsError, match=r"decode: .*rows \[1\]"):
    kvjax.decode(model, state, 4, forced=forced)
  _, fine = kvjax.decode(model, state, 4, forced=forced[[0, 0]])  # the same state, no NaN
  assert fine.tokens == [[9, 10, 11, 12]] * 2


def test_extend_names_itself(model):
  state = kvjax.prefill(model, [[5, 6, 8]])
  with pytest.raises(kvjax.NumericsError, match=r"extend: .*rows \[0\]"):
    kvjax.extend(model, state, [[9, BAD]])


def test_generate_raises_instead_of_emitting_token_zero(model):
  with pytest.raises(kvjax.NumericsError, match=r"rows \[0\]"):
    kvjax.generate(model, ByteTokenizer(), [bytes([BAD - 3]).decode() + "x"], max_new_tokens=3)


def test_a_bfloat16_overflow_is_caught_too():
  """Logits that overflow to inf (not NaN) in a low-precision dtype are refused as well."""
  model = tiny_llama(dtype="bfloat16")
  head = np.array(model.lm_head[...], np.float32)  # [d, V]
  head[:, 12] = 3e38  # token 12's logit: 3e38 x a sum of 32 normalised values
  model.lm_head[...] = head.astype(model.lm_head[...].dtype)
  with pytest.raises(kvjax.NumericsError, match=r"rows \[0\]"):
    kvjax.prefill(model, [[5, 6, 8, 9]])


def test_the_cli_says_it_in_one_line_and_exits_1(tmp_path, capsys):
  checkpoint = tiny_hf_checkpoint(tmp_path / "nan", nan=True)
  argv = ["generate", "--model", str(checkpoint), "--no-chat", "--max-new-tokens", "3", "abc"]
  assert cli.main(argv) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert "NumericsError" in err[-1] and "prefill" in err[-1] and "rows [0]" in err[-1]
  assert not any("Traceback" in line for line in err)


def test_models_built_here_are_llamas():
  assert isinstance(_model_with_a_nan_token(), Llama)
