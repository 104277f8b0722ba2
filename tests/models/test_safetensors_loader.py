import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from models.config import ModelConfig
from models.safetensors_loader import load_hf_dir

V, D, L, H, K, HD, F = 50, 32, 2, 4, 2, 8, 48

HF_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}


def hf_config(model_type="llama", tied=False, **kw):
  return {
      "model_type": model_type,
      "vocab_size": V,
      "hidden_size": D,
      "intermediate_size": F,
      "num_hidden_layers": L,
      "num_attention_heads": H,
      "num_key_value_heads": K,
      "rms_norm_eps": 1e-5,
      "rope_theta": 10000.0,
      "max_position_embeddings": 128,
      "tie_word_embeddings": tied,
      "bos_token_id": 1,
      "eos_token_id": 2,
      **kw,
  }


def random_checkpoint(rng, tied=False, bias=False, save_lm_head=None):
  """HF-named random tensors and the canonical params they must load as."""
  hf = {
      "model.embed_tokens.weight": rng.standard_normal((V, D)),
      "model.norm.weight": rng.standard_normal(D),
  }
  canon = {"embed": hf["model.embed_tokens.weight"], "final_norm": hf["model.norm.weight"]}
  if not tied or save_lm_head:
    hf["lm_head.weight"] = rng.standard_normal((V, D))
    if not tied:
      canon["lm_head"] = hf["lm_head.weight"]
  config = ModelConfig(
      vocab_size=V, d_model=D, n_layers=L, n_heads=H, n_kv_heads=K, head_dim=HD, ffn_dim=F
  )
  shapes = dataclasses.replace(config, qkv_bias=bias).param_shapes()
  for key, s in shapes.items():
    if key.startswith("layers."):
      _, i, k = key.split(".")
      a = rng.standard_normal(s)
      hf[f"model.layers.{i}.{HF_NAMES[k]}"] = a
      canon[key] = a
  return hf, canon


def write_dir(d, cfg, tensors, dtype=np.float32, shards=1):
  d.mkdir(parents=True, exist_ok=True)
  (d / "config.json").write_text(json.dumps(cfg))
  tensors = {k: np.asarray(v).astype(dtype) for k, v in tensors.items()}
  names = sorted(tensors)
  if shards == 1:
    save_file(tensors, d / "model.safetensors")
    return d
  weight_map = {}
  for s in range(shards):
    fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    part = names[s::shards]
    save_file({k: tensors[k] for k in part}, d / fname)
    weight_map.update({k: fname for k in part})
  (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  return d


def assert_params(loaded, canon, dtype=np.float32):
  assert loaded.keys() == canon.keys()
  for k, v in canon.items():
    assert loaded[k].dtype == np.float32, k
    np.testing.assert_array_equal(loaded[k], v.astype(dtype).astype(np.float32), err_msg=k)


def test_unsharded_f32(tmp_path):
  hf, canon = random_checkpoint(np.random.default_rng(0))
  config, params = load_hf_dir(write_dir(tmp_path / "tiny", hf_config(), hf))
  assert (config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim) == (L, H, K, HD)
  assert config.name == "tiny" and not config.tie_embeddings
  assert_params(params, canon)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_sharded_half_precision(tmp_path, dtype):
  hf, canon = random_checkpoint(np.random.default_rng(1))
  _, params = load_hf_dir(write_dir(tmp_path / "m", hf_config(), hf, dtype=dtype, shards=3))
  assert_params(params, canon, dtype)


def test_qwen2_bias_tied_and_duplicate_head_dropped(tmp_path):
  hf, canon = random_checkpoint(np.random.default_rng(2), tied=True, bias=True, save_lm_head=True)
  config, params = load_hf_dir(write_dir(tmp_path / "q", hf_config("qwen2", tied=True), hf))
  assert config.qkv_bias and config.tie_embeddings
  assert_params(params, canon)


def test_side_files(tmp_path):
  hf, _ = random_checkpoint(np.random.default_rng(3))
  d = write_dir(tmp_path / "s", hf_config(), hf)
  hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(HD // 2)  # old checkpoints
  save_file({k: v.astype(np.float32) for k, v in hf.items()}, d / "model.safetensors")
  (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
  (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
  config, params = load_hf_dir(d)
  assert config.eos_ids == (2, 7) and config.chat_template == "{{ x }}"
  assert "rotary_emb" not in " ".join(params)
  (d / "chat_template.jinja").write_text("jinja!")
  assert load_hf_dir(d)[0].chat_template == "jinja!"


def test_missing_dir_and_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="nothere"):
    load_hf_dir(tmp_path / "nothere")
  (tmp_path / "f.txt").write_text("x")
  with pytest.raises(ValueError, match="f.txt.*not a directory"):
    load_hf_dir(tmp_path / "f.txt")
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="no config.json"):
    load_hf_dir(tmp_path / "empty")
  (tmp_path / "empty" / "config.json").write_text(json.dumps(hf_config()))
  with pytest.raises(FileNotFoundError, match=r"no \*.safetensors"):
    load_hf_dir(tmp_path / "empty")


def test_missing_shard(tmp_path):
  hf, _ = random_checkpoint(np.random.default_rng(4))
  d = write_dir(tmp_path / "m", hf_config(), hf, shards=2)
  (d / "model-00002-of-00002.safetensors").unlink()
  with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
    load_hf_dir(d)


def test_corrupt_files(tmp_path):
  hf, _ = random_checkpoint(np.random.default_rng(5))
  d = write_dir(tmp_path / "c", hf_config(), hf)
  (d / "model.safetensors").write_bytes(b"\x00garbage" * 20)
  with pytest.raises(ValueError, match="model.safetensors"):
    load_hf_dir(d)
  (d / "config.json").write_text("{not json")
  with pytest.raises(ValueError, match="config.json"):
    load_hf_dir(d)


def test_tensor_mismatches(tmp_path):
  hf, _ = random_checkpoint(np.random.default_rng(6))
  d = write_dir(tmp_path / "a", hf_config(), {k: v for k, v in hf.items() if "0.mlp.up" not in k})
  with pytest.raises(ValueError, match=r"missing \['layers.0.w_up'\]"):
    load_hf_dir(d)
  extra = {**hf, "model.layers.0.mlp.extra.weight": np.ones(3)}
  d = write_dir(tmp_path / "b", hf_config(), extra)
  with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.mlp.extra.weight'"):
    load_hf_dir(d)
  d = write_dir(tmp_path / "c", hf_config(num_key_value_heads=4), hf)
  with pytest.raises(ValueError, match="'layers.0.wk' has shape"):
    load_hf_dir(d)
