"""Decoders (Llama family, Gemma 3) and their loading: config, weights (GGUF or HF safetensors),
tokenizer, registry.

Parameters are a flat ``dict[str, np.ndarray]`` of float32 arrays with canonical names, the same for
every source. Linear weights are ``[out_features, in_features]`` (HF orientation: ``y = x @ w.T``),
and q/k rows are in the HF layout for half-rotation ("rotate_half") RoPE. ``H`` = n_heads,
``K`` = n_kv_heads, ``hd`` = head_dim, ``d`` = d_model, ``f`` = ffn_dim, ``V`` = vocab_size:

    embed               [V, d]
    layers.{i}.attn_norm [d]         RMSNorm weight before attention
    layers.{i}.wq       [H*hd, d]
    layers.{i}.wk       [K*hd, d]
    layers.{i}.wv       [K*hd, d]
    layers.{i}.wo       [d, H*hd]
    layers.{i}.bq/bk/bv [H*hd] / [K*hd] / [K*hd]   only when config.qkv_bias (Qwen2)
    layers.{i}.q_norm/k_norm [hd]   only when config.qk_norm (Qwen3, Gemma 3): per-head RMSNorm
    layers.{i}.post_attn_norm/post_mlp_norm [d]   Gemma 3: RMSNorm of each block's output
    layers.{i}.mlp_norm [d]          RMSNorm weight before the MLP
    layers.{i}.w_gate   [f, d]       SwiGLU: w_down @ (silu(w_gate @ x) * (w_up @ x))
    layers.{i}.w_up     [f, d]
    layers.{i}.w_down   [d, f]
    final_norm          [d]          (norm weights are the factor they scale by: Gemma's 1 + w)
    lm_head             [V, d]       absent when config.tie_embeddings (use embed)
    rope_freqs          [hd // 2]    GGUF only, optional: llama.cpp's Llama-3 RoPE frequency
                                     divisors (inv_freq / rope_freqs)

``ModelConfig.param_shapes()`` gives the required names and shapes for a config.
"""

from .config import ModelConfig, RopeScaling, check_params
from .gemma3 import Gemma3, load_decoder
from .gguf_loader import load_gguf
from .llama import Llama, load_llama
from .registry import (
    DEFAULT_MODEL,
    ModelSource,
    known_models,
    load_model,
    model_availability,
    resolve_model,
)
from .safetensors_loader import load_hf_dir
from .tokenizer import Tokenizer

__all__ = [
    "DEFAULT_MODEL",
    "Gemma3",
    "Llama",
    "ModelConfig",
    "ModelSource",
    "RopeScaling",
    "Tokenizer",
    "check_params",
    "known_models",
    "model_availability",
    "load_gguf",
    "load_hf_dir",
    "load_decoder",
    "load_llama",
    "load_model",
    "resolve_model",
]
