import dataclasses

import pytest

from models.config import SIZE_FIELDS, ModelConfig, RopeScaling

TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48)

LLAMA32_1B = {  # config.json of meta-llama/Llama-3.2-1B-Instruct (trimmed)
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
MISTRAL_V01 = {
    "model_type": "mistral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
QWEN2_05B = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 32768,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
SMOLLM2_135M = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rope_theta": 100000,
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "rope_scaling": None,
}


def test_valid_config_is_hashable_and_normalised():
  c = ModelConfig(
      **TINY,
      eos_ids=[3, 4],
      rope_scaling={
          "factor": 8.0,
          "low_freq_factor": 1.0,
          "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192,
          "rope_type": "llama3",
      },
  )
  assert c.eos_ids == (3, 4)
  assert c.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
  assert hash(c) == hash(dataclasses.replace(c))
  assert (c.q_dim, c.kv_dim) == (32, 16)


@pytest.mark.parametrize("field", SIZE_FIELDS)
@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_sizes_must_be_positive_ints(field, value):
  with pytest.raises(ValueError, match=field):
    ModelConfig(**{**TINY, field: value})


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(n_heads=4, n_kv_heads=3), "multiple of n_kv_heads"),
        (dict(head_dim=7), "head_dim must be even"),
        (dict(rope_theta=0.0), "rope_theta"),
        (dict(rms_eps=-1e-6), "rms_eps"),
        (dict(bos_id=64), "bos_id"),
        (dict(eos_ids=(1, 99)), "eos_ids"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "llama3"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 4.0}), "missing key"),
        (
            dict(
                rope_scaling={
                    "factor": 8.0,
                    "low_freq_factor": 4.0,
                    "high_freq_factor": 1.0,
                    "original_max_position_embeddings": 8192,
                }
            ),
            "high_freq_factor",
        ),
        (dict(rope_scaling=3.0), "rope_scaling"),
    ],
)
def test_invalid_values(change, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig(**{**TINY, **change})


def test_param_shapes():
  c = ModelConfig(**TINY)
  s = c.param_shapes()
  assert s["embed"] == (64, 32) and s["lm_head"] == (64, 32)
  assert s["layers.1.wq"] == (32, 32) and s["layers.1.wk"] == (16, 32)
  assert s["layers.0.wo"] == (32, 32) and s["layers.0.w_down"] == (32, 48)
  assert len(s) == 3 + 2 * 9
  tied_bias = ModelConfig(**TINY, tie_embeddings=True, qkv_bias=True).param_shapes()
  assert "lm_head" not in tied_bias and tied_bias["layers.0.bk"] == (16,)


def test_from_hf_llama3_with_rope_scaling():
  c = ModelConfig.from_hf_config(LLAMA32_1B)
  assert (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.d_model) == (16, 32, 8, 64, 2048)
  assert c.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
  assert c.tie_embeddings and not c.qkv_bias
  assert c.eos_ids == (128001, 128008, 128009) and c.bos_id == 128000
  assert c.max_context == 131072 and c.rope_theta == 500000.0


def test_from_hf_mistral_windows_every_layer():
  c = ModelConfig.from_hf_config(MISTRAL_V01, name="mistral")
  assert c.max_context == 32768 and c.head_dim == 128 and not c.tie_embeddings
  assert c.layer_windows == (4096,) * c.n_layers and c.layer_types == ("sliding",) * c.n_layers
  assert c.eos_ids == (2,) and c.name == "mistral"


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(layer_types=("full",)), "one of .* for each of the 2 layers"),
        (dict(layer_types=("full", "local")), "one of .* for each of the 2 layers"),
        (dict(layer_types=("sliding", "full")), "sliding layers need sliding_window >= 1"),
        (dict(sliding_window=2.5), "sliding_window must be None or an int >= 1"),
        (dict(family="gemma"), "family must be one of"),
        (dict(rope_local_theta=0.0), "rope_local_theta must be None or > 0"),
    ],
)
def test_bad_layer_settings_are_refused(change, match):
  base = dict(vocab_size=8, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, ffn_dim=8)
  with pytest.raises(ValueError, match=match):
    ModelConfig(**base, **change)


def test_from_hf_gemma3_text_reads_the_layer_pattern_and_both_rope_bases():
  hf = {
      "model_type": "gemma3_text",
      "vocab_size": 262144,
      "hidden_size": 640,
      "intermediate_size": 2048,
      "num_hidden_layers": 18,
      "num_attention_heads": 4,
      "num_key_value_heads": 1,
      "head_dim": 256,
      "query_pre_attn_scalar": 256,
      "sliding_window": 512,
      "rope_parameters": {
          "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
      },
      "max_position_embeddings": 32768,
      "rms_norm_eps": 1e-6,
      "bos_token_id": 2,
      "eos_token_id": 1,
  }
  c = ModelConfig.from_hf_config(hf)
  assert c.family == "gemma3" and c.qk_norm and c.tie_embeddings
  assert c.layer_windows == tuple(0 if i % 6 == 5 else 512 for i in range(18))
  assert (c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar) == (1e6, 1e4, 256.0)
  with pytest.raises(ValueError, match="final_logit_softcapping=30.0 is not supported"):
    ModelConfig.from_hf_config({**hf, "final_logit_softcapping": 30.0})


def test_from_hf_qwen2():
  c = ModelConfig.from_hf_config(QWEN2_05B)
  assert c.qkv_bias and c.tie_embeddings and c.head_dim == 64
  assert c.max_context == 32768  # use_sliding_window is false
  assert c.rms_eps == 1e-6


def test_from_hf_smollm2():
  c = ModelConfig.from_hf_config(SMOLLM2_135M, chat_template="t")
  assert (c.vocab_size, c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == (
      49152,
      576,
      30,
      9,
      3,
      64,
  )
  assert c.tie_embeddings and c.rope_scaling is None and c.chat_template == "t"


def test_from_hf_transformers5_rope_parameters():
  cfg = {k: v for k, v in LLAMA32_1B.items() if k not in ("rope_theta", "rope_scaling")}
  cfg["rope_parameters"] = {**LLAMA32_1B["rope_scaling"], "rope_theta": 500000.0}
  c = ModelConfig.from_hf_config(cfg)
  assert c.rope_theta == 500000.0 and c.rope_scaling.factor == 32.0
  cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
  assert ModelConfig.from_hf_config(cfg).rope_scaling is None


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
        ({"hidden_size": None}, "hidden_size"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "llama3"),
    ],
)
def test_from_hf_errors(change, match):
  cfg = {k: v for k, v in {**SMOLLM2_135M, **change}.items() if v is not None}
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_hf_config(cfg)
