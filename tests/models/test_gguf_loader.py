import dataclasses

import gguf
import numpy as np
import pytest

from models.config import ModelConfig
from models.gguf_loader import load_gguf, unpermute_qk
from models.registry import DEFAULT_MODEL, resolve_model

V, D, L, H, K, HD, F = 64, 64, 2, 4, 2, 16, 96  # rows of 64 so Q8_0 (blocks of 32) applies


def llama_cpp_permute(w, n_head, n_head_kv=None):
  """`LlamaModel.permute` from llama.cpp's convert_hf_to_gguf.py (numpy instead of torch)."""
  if n_head_kv is not None and n_head != n_head_kv:
    n_head = n_head_kv
  return (
      w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
  )


TINY = ModelConfig(
    vocab_size=V, d_model=D, n_layers=L, n_heads=H, n_kv_heads=K, head_dim=HD, ffn_dim=F
)


def random_params(rng, tied=False, bias=False, qk_norm=False):
  config = dataclasses.replace(TINY, tie_embeddings=tied, qkv_bias=bias, qk_norm=qk_norm)
  return {k: rng.standard_normal(s).astype(np.float32) for k, s in config.param_shapes().items()}


GGUF_NAMES = {
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "bq": "attn_q.bias",
    "bk": "attn_k.bias",
    "bv": "attn_v.bias",
    "mlp_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
}


def write_gguf(path, params, arch="llama", qtype=None, extra_tensors=(), drop=()):
  """Write `params` (HF layout) as llama.cpp's converter would: q/k permuted for "llama"."""
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(L)
  w.add_context_length(256)
  w.add_embedding_length(D)
  w.add_feed_forward_length(F)
  w.add_head_count(H)
  w.add_head_count_kv(K)
  w.add_rope_freq_base(10000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_rope_dimension_count(HD)
  w.add_vocab_size(V)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_chat_template("{{ messages }}")
  for key, a in params.items():
    if key in drop:
      continue
    parts = key.split(".")  # "embed" or "layers.{i}.{short}"
    short = parts[-1]
    name = f"blk.{parts[1]}.{GGUF_NAMES[short]}" if parts[0] == "layers" else GGUF_NAMES[key]
    if arch == "llama" and short in ("wq", "bq"):
      a = llama_cpp_permute(a, H, H)
    elif arch == "llama" and short in ("wk", "bk"):
      a = llama_cpp_permute(a, H, K)
    if qtype is not None and a.ndim == 2:
      w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    else:
      w.add_tensor(name, a)
  for name, a in extra_tensors:
    w.add_tensor(name, a)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def test_tiny_f32_roundtrip_undoes_permutation(tmp_path):
  params = random_params(np.random.default_rng(0))
  config, loaded, md = load_gguf(write_gguf(tmp_path / "tiny.gguf", params))
  metadata = dict(max_context=256, bos_id=1, eos_ids=(2,), chat_template="{{ messages }}")
  assert config == dataclasses.replace(TINY, rope_theta=10000.0, name="tiny", **metadata)
  assert config.chat_template == "{{ messages }}"
  assert md["general.architecture"] == "llama"
  assert loaded.keys() == params.keys()
  for k, v in params.items():
    assert loaded[k].dtype == np.float32
    np.testing.assert_array_equal(loaded[k], v, err_msg=k)


@pytest.mark.parametrize(
    "qtype, tol", [(gguf.GGMLQuantizationType.F16, 2e-3), (gguf.GGMLQuantizationType.Q8_0, 2e-2)]
)
def test_tiny_quantized_roundtrip(tmp_path, qtype, tol):
  params = random_params(np.random.default_rng(1))
  config, loaded, _ = load_gguf(write_gguf(tmp_path / "q.gguf", params, qtype=qtype))
  for k, v in params.items():
    # A wrong row order would give errors of order 1, far above the quantization error.
    err = np.abs(loaded[k] - v).max() / np.abs(v).max()
    assert loaded[k].shape == v.shape and err < tol, (k, err)


def test_tiny_qwen2_biases_not_permuted_and_tied(tmp_path):
  params = random_params(np.random.default_rng(2), tied=True, bias=True)
  config, loaded, _ = load_gguf(write_gguf(tmp_path / "qwen.gguf", params, arch="qwen2"))
  assert config.qkv_bias and config.tie_embeddings and "lm_head" not in loaded
  for k, v in params.items():
    np.testing.assert_array_equal(loaded[k], v, err_msg=k)


def test_tiny_qwen3_qk_norms_loaded_and_nothing_permuted(tmp_path):
  params = random_params(np.random.default_rng(3), tied=True, qk_norm=True)
  config, loaded, _ = load_gguf(write_gguf(tmp_path / "qwen3.gguf", params, arch="qwen3"))
  assert config.qk_norm and config.family == "llama" and not config.qkv_bias
  assert loaded.keys() == params.keys()
  for k, v in params.items():
    np.testing.assert_array_equal(loaded[k], v, err_msg=k)


def test_llama_biases_are_unpermuted(tmp_path):
  params = random_params(np.random.default_rng(3), bias=True)
  config, loaded, _ = load_gguf(write_gguf(tmp_path / "b.gguf", params))
  np.testing.assert_array_equal(loaded["layers.1.bq"], params["layers.1.bq"])
  np.testing.assert_array_equal(loaded["layers.1.bk"], params["layers.1.bk"])


def test_rope_freqs_tensor_is_kept(tmp_path):
  params = random_params(np.random.default_rng(4))
  freqs = np.linspace(1, 8, HD // 2, dtype=np.float32)
  _, loaded, _ = load_gguf(
      write_gguf(tmp_path / "r.gguf", params, extra_tensors=[("rope_freqs.weight", freqs)])
  )
  np.testing.assert_array_equal(loaded["rope_freqs"], freqs)


def _rope_interleaved(x, pos, theta=10000.0):  # llama.cpp / GPT-J style: pairs (2i, 2i+1)
  hd = x.shape[-1]
  ang = pos * theta ** (-np.arange(0, hd, 2) / hd)
  c, s = np.cos(ang), np.sin(ang)
  a, b = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
  return out


def _rope_half(x, pos, theta=10000.0):  # HF rotate_half style: pairs (i, i + hd/2)
  hd = x.shape[-1]
  ang = pos * theta ** (-np.arange(0, hd, 2) / hd)
  c, s = np.concatenate([np.cos(ang)] * 2), np.concatenate([np.sin(ang)] * 2)
  return x * c + np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1) * s


def test_unpermuted_weights_with_half_rope_match_gguf_with_interleaved_rope():
  rng = np.random.default_rng(5)
  wq, wk = rng.standard_normal((H * HD, D)), rng.standard_normal((K * HD, D))
  x = rng.standard_normal((2, D))
  gq, gk = llama_cpp_permute(wq, H, H), llama_cpp_permute(wk, H, K)
  np.testing.assert_array_equal(unpermute_qk(gq, H), wq)
  np.testing.assert_array_equal(unpermute_qk(gk, K), wk)
  heads = lambda y, n: y.reshape(n, HD)  # noqa: E731
  # Attention logits of query head 0 (kv head 0) at positions 7 (q) and 3 (k) agree.
  q_gguf, k_gguf = heads(gq @ x[0], H)[0], heads(gk @ x[1], K)[0]
  q_hf, k_hf = heads(wq @ x[0], H)[0], heads(wk @ x[1], K)[0]
  s_gguf = _rope_interleaved(q_gguf, 7) @ _rope_interleaved(k_gguf, 3)
  s_hf = _rope_half(q_hf, 7) @ _rope_half(k_hf, 3)
  np.testing.assert_allclose(s_gguf, s_hf, rtol=1e-10)


@pytest.fixture(scope="module")
def smollm2():
  return load_gguf(resolve_model(DEFAULT_MODEL).path)


def test_real_smollm2(smollm2):
  config, params, md = smollm2
  assert (
      config.n_layers,
      config.d_model,
      config.n_heads,
      config.n_kv_heads,
      config.head_dim,
      config.vocab_size,
      config.ffn_dim,
  ) == (30, 576, 9, 3, 64, 49152, 1536)
  assert config.tie_embeddings and "lm_head" not in params and not config.qkv_bias
  assert (config.rope_theta, config.rms_eps, config.max_context) == (100000.0, 1e-5, 8192)
  assert (config.bos_id, config.eos_ids) == (1, (2,))
  assert "<|im_start|>" in config.chat_template
  assert md["tokenizer.ggml.pre"] == "smollm"
  assert len(params) == 2 + 30 * 9
  assert params["embed"].shape == (49152, 576)
  assert params["layers.29.wq"].shape == (576, 576)
  assert params["layers.29.wk"].shape == (192, 576)
  assert params["layers.0.w_gate"].shape == (1536, 576)
  assert params["layers.0.w_down"].shape == (576, 1536)
  assert all(p.dtype == np.float32 and np.isfinite(p).all() for p in params.values())
  # RMSNorm weights hover around 1; a misread layout would not.
  assert 0.1 < np.abs(params["final_norm"]).mean() < 10


def test_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.gguf"):
    load_gguf(tmp_path / "nope.gguf")


def test_garbage_file(tmp_path):
  p = tmp_path / "junk.gguf"
  p.write_bytes(b"this is not a gguf file at all" * 10)
  with pytest.raises(ValueError, match="junk.gguf"):
    load_gguf(p)


def test_truncated_file(tmp_path):
  p = write_gguf(tmp_path / "t.gguf", random_params(np.random.default_rng(6)))
  p.write_bytes(p.read_bytes()[:-5000])
  with pytest.raises(ValueError, match="t.gguf"):
    load_gguf(p)


def test_unsupported_arch(tmp_path):
  p = write_gguf(tmp_path / "g.gguf", random_params(np.random.default_rng(7)), arch="gemma")
  with pytest.raises(ValueError, match="architecture 'gemma'"):
    load_gguf(p)


def test_missing_and_unexpected_tensors(tmp_path):
  params = random_params(np.random.default_rng(8))
  p = write_gguf(tmp_path / "m.gguf", params, drop=("layers.1.w_up",))
  with pytest.raises(ValueError, match=r"missing \['layers.1.w_up'\]"):
    load_gguf(p)
  p = write_gguf(
      tmp_path / "u.gguf",
      params,
      extra_tensors=[("blk.0.attn_qk_norm.weight", np.ones(D, np.float32))],
  )
  with pytest.raises(ValueError, match="unexpected tensor 'blk.0.attn_qk_norm.weight'"):
    load_gguf(p)
