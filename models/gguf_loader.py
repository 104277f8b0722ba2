"""Load Llama/Qwen2/Gemma 3 GGUF files (llama.cpp format) into float32 numpy params with
canonical names."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from .config import ModelConfig, TensorNames, check_params

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

_GLOBAL_NAMES = {
    "token_embd.weight": "embed",
    "output_norm.weight": "final_norm",
    "output.weight": "lm_head",
    # llama.cpp's precomputed Llama-3 RoPE frequency divisors [head_dim // 2].
    "rope_freqs.weight": "rope_freqs",
}
_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "attn_q.bias": "bq",
    "attn_k.bias": "bk",
    "attn_v.bias": "bv",
    "ffn_norm.weight": "mlp_norm",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
_QK_NORM_NAMES = {"attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm"}
# Qwen3: q and k normalised per head before RoPE (plain RMSNorm weights).
_NAMES = TensorNames(_GLOBAL_NAMES, _BLOCK_RE, {**_LAYER_NAMES, **_QK_NORM_NAMES})
# Gemma 3: norms on both sides of each block and per head on q and k. llama.cpp stores the
# norms as the factor they scale by (Gemma's 1 + w), which is the canonical form.
_GEMMA3_NAMES = TensorNames(
    _GLOBAL_NAMES,
    _BLOCK_RE,
    {
        **_LAYER_NAMES,
        **_QK_NORM_NAMES,
        "post_attention_norm.weight": "post_attn_norm",
        "post_ffw_norm.weight": "post_mlp_norm",
    },
)
# llama.cpp's Gemma 3: five sliding layers then a full one, local RoPE base 1e4 (its loader
# fixes both; the files record neither).
GEMMA3_PATTERN, GEMMA3_LOCAL_ROPE_BASE = 6, 10000.0


def _gemma3_turns(md: dict[str, Any]) -> dict[str, Any]:
  """A Gemma 3 file's metadata with what llama.cpp supplies where it is missing: the end of
  a turn (`<end_of_turn>`, found by name as llama.cpp finds it). The chat template is the
  file's: instruction-tuned files carry Gemma's; a base model's (the 270M's) carries none,
  and it completes text."""
  md = dict(md)
  tokens = md.get("tokenizer.ggml.tokens") or []
  if "tokenizer.ggml.eot_token_id" not in md and "<end_of_turn>" in tokens:
    md["tokenizer.ggml.eot_token_id"] = list(tokens).index("<end_of_turn>")
  return md


def open_gguf(path: str | os.PathLike):
  """Open `path` with `gguf.GGUFReader`, turning failures into errors that name the file."""
  import gguf

  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"GGUF file not found: {str(path)!r}")
  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # the reader raises assorted errors on truncated or foreign files
    raise ValueError(f"{str(path)!r} is not a valid GGUF file: {e}") from e


def read_metadata(reader) -> dict[str, Any]:
  """All GGUF key/value fields as plain Python values (str, int, float, bool, lists); for
  Gemma 3, with what llama.cpp supplies where the file lacks it (`_gemma3_turns`)."""
  md = {k: f.contents() for k, f in reader.fields.items()}
  return _gemma3_turns(md) if md.get("general.architecture") == "gemma3" else md


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undo llama.cpp's q/k row permutation (interleaved -> half-rotation RoPE layout).

  `w` is `[n_head * head_dim, d_in]` (or a bias `[n_head * head_dim]`). llama.cpp reorders the
  rows of each head from (half, pair) to (pair, half) order for its interleaved RoPE.
  """
  hd = w.shape[0] // n_head
  return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f32(v) -> float:
  """GGUF stores floats as float32: give back the shortest decimal (1e-05, not 9.99999974e-06)."""
  return float(str(np.float32(v)))


_EOS_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)


def gguf_eos_ids(md: dict[str, Any]) -> tuple[int, ...]:
  """The ids that end a turn in GGUF metadata (end of sequence, of turn, of message), in
  order, each once."""
  return tuple(dict.fromkeys(md[k] for k in _EOS_KEYS if k in md))


def _config_from_metadata(
    md: dict[str, Any], path: Path, vocab_rows: int, tied: bool, qkv_bias: bool
) -> ModelConfig:
  arch = md.get("general.architecture")
  if arch not in SUPPORTED_ARCHS:
    raise ValueError(
        f"{str(path)!r}: general.architecture {arch!r} is not supported "
        f"(supported: {', '.join(SUPPORTED_ARCHS)})"
    )

  def get(key, default=None):
    v = md.get(f"{arch}.{key}", default)
    if v is None:
      raise ValueError(f"{str(path)!r}: missing metadata key '{arch}.{key}'")
    return v

  scaling = md.get(f"{arch}.rope.scaling.type", "none")
  if scaling not in ("none", None):
    raise ValueError(f"{str(path)!r}: {arch}.rope.scaling.type={scaling!r} is not supported")
  d, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
  head_dim = int(get("attention.key_length", d // n_heads))
  rot = int(get("rope.dimension_count", head_dim))
  if rot != head_dim:
    raise ValueError(
        f"{str(path)!r}: partial RoPE ({arch}.rope.dimension_count={rot} != "
        f"head_dim={head_dim}) is not supported"
    )
  eos_ids = gguf_eos_ids(md)
  n_layers = int(get("block_count"))
  gemma = {"qk_norm": True} if arch == "qwen3" else {}
  if arch == "gemma3":
    if md.get("gemma3.final_logit_softcapping") is not None:
      raise ValueError(f"{str(path)!r}: gemma3.final_logit_softcapping is not supported")
    gemma = dict(
        family="gemma3",
        qk_norm=True,
        sliding_window=int(get("attention.sliding_window")),
        layer_types=tuple(
            "full" if (i + 1) % GEMMA3_PATTERN == 0 else "sliding" for i in range(n_layers)
        ),
        rope_local_theta=GEMMA3_LOCAL_ROPE_BASE,
    )
  return ModelConfig(
      vocab_size=int(get("vocab_size", vocab_rows)),
      d_model=d,
      n_layers=n_layers,
      n_heads=n_heads,
      n_kv_heads=int(get("attention.head_count_kv", n_heads)),
      head_dim=head_dim,
      ffn_dim=int(get("feed_forward_length")),
      rope_theta=_f32(get("rope.freq_base", 10000.0)),
      rms_eps=_f32(get("attention.layer_norm_rms_epsilon")),
      max_context=int(get("context_length")),
      tie_embeddings=tied,
      qkv_bias=qkv_bias,
      bos_id=md.get("tokenizer.ggml.bos_token_id"),
      eos_ids=eos_ids,
      chat_template=md.get("tokenizer.chat_template"),
      name=path.name.removesuffix(".gguf"),
      **gemma,
  )


def _dequantize(t, path: Path) -> np.ndarray:
  from gguf.quants import dequantize

  # gguf lists dims fastest-first (ggml `ne`); numpy/HF order is the reverse.
  shape = tuple(int(n) for n in reversed(t.shape.tolist()))
  try:
    w = dequantize(t.data, t.tensor_type)
  except NotImplementedError as e:
    raise ValueError(
        f"{str(path)!r}: tensor {t.name!r} has unsupported type " f"{t.tensor_type.name}: {e}"
    ) from e
  # Copy: F32/F16 tensors come back as views of the read-only memmap.
  return np.array(w, dtype=np.float32).reshape(shape)


def load_gguf(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray], dict[str, Any]]:
  """Load a GGUF file: (config, params in canonical names as float32, raw GGUF metadata).

  q/k weights are returned in the HF layout (half-rotation RoPE), linear weights as
  `[out_features, in_features]`.
  """
  path = Path(path)
  reader = open_gguf(path)
  md = read_metadata(reader)
  tensors = {t.name: t for t in reader.tensors}
  if "token_embd.weight" not in tensors:
    raise ValueError(f"{str(path)!r}: no 'token_embd.weight' tensor; not a Llama-style model")
  vocab_rows = int(tensors["token_embd.weight"].shape[-1])
  config = _config_from_metadata(
      md,
      path,
      vocab_rows,
      tied="output.weight" not in tensors,
      qkv_bias="blk.0.attn_q.bias" in tensors,
  )

  names = _GEMMA3_NAMES if config.family == "gemma3" else _NAMES
  params: dict[str, np.ndarray] = {}
  for name, t in tensors.items():
    key = names.canonical(name, str(path))
    w = _dequantize(t, path)
    # llama.cpp permutes q/k only for the "llama" arch (qwen2 already uses NEOX-style RoPE).
    kind = key.rsplit(".", 1)[-1]
    if md["general.architecture"] == "llama" and kind in ("wq", "bq", "wk", "bk"):
      w = unpermute_qk(w, config.n_heads if kind in ("wq", "bq") else config.n_kv_heads)
    params[key] = w
  check_params(config, params, str(path), optional=("rope_freqs",))
  return config, params, md
