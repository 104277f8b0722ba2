"""Model hyper-parameters for Llama-family decoders (Llama 2/3, Mistral, Qwen2, SmolLM2)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 ("llama3") RoPE frequency scaling. Frozen so `ModelConfig` stays hashable for jit."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int

  def __post_init__(self):
    if self.factor <= 0 or self.low_freq_factor <= 0:
      raise ValueError(f"rope_scaling: factor and low_freq_factor must be > 0, got {self}")
    if self.high_freq_factor <= self.low_freq_factor:
      raise ValueError(f"rope_scaling: need high_freq_factor > low_freq_factor, got {self}")
    if self.original_max_position_embeddings <= 0:
      raise ValueError(
          f"rope_scaling: original_max_position_embeddings must be > 0, " f"got {self}"
      )

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> RopeScaling:
    kind = d.get("rope_type", d.get("type", "llama3"))
    if kind != "llama3":
      raise ValueError(f"rope_scaling: only rope_type 'llama3' is supported, got {kind!r}")
    try:
      return cls(
          factor=float(d["factor"]),
          low_freq_factor=float(d["low_freq_factor"]),
          high_freq_factor=float(d["high_freq_factor"]),
          original_max_position_embeddings=int(d["original_max_position_embeddings"]),
      )
    except KeyError as e:
      raise ValueError(f"rope_scaling: missing key {e.args[0]!r} in {dict(d)}") from None


# ModelConfig fields that must be positive ints.
SIZE_FIELDS = (
    "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
    "max_context",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a Llama-style decoder. Hashable, so it can be a static jit argument."""

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  ffn_dim: int
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None  # a dict is accepted and converted
  rms_eps: float = 1e-5
  max_context: int = 2048
  tie_embeddings: bool = False
  qkv_bias: bool = False  # Qwen2 has biases on q/k/v projections
  bos_id: int | None = None
  eos_ids: tuple[int, ...] = ()
  chat_template: str | None = dataclasses.field(default=None, repr=False)
  name: str = "model"

  def __post_init__(self):
    for f in SIZE_FIELDS:
      v = getattr(self, f)
      if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"ModelConfig.{f} must be a positive int, got {v!r}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"ModelConfig: n_heads ({self.n_heads}) must be a multiple of "
          f"n_kv_heads ({self.n_kv_heads})"
      )
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
    if not self.rope_theta > 0:
      raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")
    if not self.rms_eps > 0:
      raise ValueError(f"ModelConfig.rms_eps must be > 0, got {self.rms_eps!r}")
    if isinstance(self.rope_scaling, Mapping):
      object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
    elif self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(
          f"ModelConfig.rope_scaling must be None, a dict or RopeScaling, "
          f"got {type(self.rope_scaling).__name__}"
      )
    object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))
    for what, ids in (
        ("bos_id", () if self.bos_id is None else (self.bos_id,)),
        ("eos_ids", self.eos_ids),
    ):
      bad = [i for i in ids if not 0 <= i < self.vocab_size]
      if bad:
        raise ValueError(f"ModelConfig.{what} {bad} outside [0, vocab_size=" f"{self.vocab_size})")

  @property
  def q_dim(self) -> int:
    return self.n_heads * self.head_dim

  @property
  def kv_dim(self) -> int:
    return self.n_kv_heads * self.head_dim

  def param_shapes(self) -> dict[str, tuple[int, ...]]:
    """Canonical parameter names -> shapes (see `models` package docstring)."""
    d, f, v = self.d_model, self.ffn_dim, self.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed": (v, d), "final_norm": (d,)}
    if not self.tie_embeddings:
      shapes["lm_head"] = (v, d)
    for i in range(self.n_layers):
      p = f"layers.{i}."
      shapes.update(
          {
              p + "attn_norm": (d,),
              p + "wq": (self.q_dim, d),
              p + "wk": (self.kv_dim, d),
              p + "wv": (self.kv_dim, d),
              p + "wo": (d, self.q_dim),
              p + "mlp_norm": (d,),
              p + "w_gate": (f, d),
              p + "w_up": (f, d),
              p + "w_down": (d, f),
          }
      )
      if self.qkv_bias:
        shapes.update({p + "bq": (self.q_dim,), p + "bk": (self.kv_dim,), p + "bv": (self.kv_dim,)})
    return shapes

  @classmethod
  def from_hf_config(
      cls, cfg: Mapping[str, Any], *, name: str | None = None, chat_template: str | None = None
  ) -> ModelConfig:
    """Build from a HF `config.json` dict (model_type llama, mistral or qwen2)."""
    model_type = cfg.get("model_type")
    if model_type not in ("llama", "mistral", "qwen2"):
      raise ValueError(
          f"config.json: model_type {model_type!r} is not supported "
          "(supported: 'llama', 'mistral', 'qwen2')"
      )
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
      raise ValueError(
          "config.json: attention_bias/mlp_bias (biases on every projection) " "is not supported"
      )
    try:
      d, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
      vocab, n_layers, ffn = (
          int(cfg["vocab_size"]),
          int(cfg["num_hidden_layers"]),
          int(cfg["intermediate_size"]),
      )
    except KeyError as e:
      raise ValueError(f"config.json: missing required key {e.args[0]!r}") from None
    # transformers>=5 moves rope settings into `rope_parameters`.
    rope = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or rope or None
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
      scaling = None
    max_ctx = int(cfg.get("max_position_embeddings", 2048))
    # Sliding-window attention equals full attention for contexts within the window, so
    # capping the context keeps Mistral-v0.1-style models exact without a window mask.
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", model_type == "mistral"):
      max_ctx = min(max_ctx, int(window))
    eos = cfg.get("eos_token_id")
    eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
    return cls(
        vocab_size=vocab,
        d_model=d,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or d // n_heads),
        ffn_dim=ffn,
        rope_theta=float(theta),
        rope_scaling=scaling,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_context=max_ctx,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        bos_id=cfg.get("bos_token_id"),
        eos_ids=eos_ids,
        chat_template=chat_template,
        name=name or cfg.get("_name_or_path") or model_type,
    )


def check_params(
    config: ModelConfig, params: Mapping[str, Any], source: str, optional: tuple[str, ...] = ()
) -> None:
  """Raise ValueError naming `source` if `params` lack, add or mis-shape any canonical tensor."""
  want = config.param_shapes()
  missing = sorted(set(want) - set(params))
  extra = sorted(set(params) - set(want) - set(optional))
  if missing or extra:
    raise ValueError(
        f"{source}: parameters do not match the config: "
        f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
        f"unexpected {extra[:8]}{'...' if len(extra) > 8 else ''}"
    )
  for k, shape in want.items():
    if tuple(params[k].shape) != shape:
      raise ValueError(
          f"{source}: tensor {k!r} has shape {tuple(params[k].shape)}, "
          f"expected {shape} from the config"
      )


@dataclasses.dataclass(frozen=True)
class TensorNames:
  """How one checkpoint format names its tensors: whole-model names, and a per-layer pattern
  (`layer_re` with groups (layer index, tensor name)) with per-layer names."""

  globals: Mapping[str, str]
  layer_re: re.Pattern
  layers: Mapping[str, str]

  def canonical(self, name: str, source: str) -> str:
    """The canonical parameter name of tensor `name`; ValueError naming an unknown one."""
    if name in self.globals:
      return self.globals[name]
    m = self.layer_re.fullmatch(name)
    if not m or m.group(2) not in self.layers:
      raise ValueError(f"{source!r}: unexpected tensor {name!r}")
    return f"layers.{m.group(1)}.{self.layers[m.group(2)]}"
