"""Model hyper-parameters of the decoders in `models/`: the Llama family (Llama 2/3, Mistral,
Qwen2/3, SmolLM2) and Gemma 3."""

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


HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
FAMILIES = ("llama", "gemma3")  # the decoder block: `models.Llama` or `models.Gemma3`
LAYER_TYPES = ("full", "sliding")  # a layer attends to every earlier token, or to a window

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
  family: str = "llama"  # the block layout (FAMILIES)
  qk_norm: bool = False  # RMSNorm over each q/k head before RoPE (Qwen3, Gemma 3)
  sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
  # Per layer, "full" or "sliding" (empty: every layer full). A sliding layer's query at
  # position i sees keys at positions in (i - sliding_window, i].
  layer_types: tuple[str, ...] = ()
  rope_local_theta: float | None = None  # the RoPE base of sliding layers (None: rope_theta)
  query_pre_attn_scalar: float | None = None  # attention scale s**-0.5 (None: head_dim)

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
    object.__setattr__(self, "layer_types", tuple(self.layer_types))
    if self.family not in FAMILIES:
      raise ValueError(f"ModelConfig.family must be one of {FAMILIES}, got {self.family!r}")
    if self.layer_types and (
        len(self.layer_types) != self.n_layers
        or any(t not in LAYER_TYPES for t in self.layer_types)
    ):
      raise ValueError(
          f"ModelConfig.layer_types must give one of {LAYER_TYPES} for each of the "
          f"{self.n_layers} layers, got {self.layer_types!r}"
      )
    window = self.sliding_window
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
      raise ValueError(f"ModelConfig.sliding_window must be None or an int >= 1, got {window!r}")
    if (window is None or window < 1) and "sliding" in self.layer_types:
      raise ValueError(
          f"ModelConfig: sliding layers need sliding_window >= 1, got {self.sliding_window!r}"
      )
    for name in ("rope_local_theta", "query_pre_attn_scalar"):
      value = getattr(self, name)
      if value is not None and not value > 0:
        raise ValueError(f"ModelConfig.{name} must be None or > 0, got {value!r}")
    for what, ids in (
        ("bos_id", () if self.bos_id is None else (self.bos_id,)),
        ("eos_ids", self.eos_ids),
    ):
      bad = [i for i in ids if not 0 <= i < self.vocab_size]
      if bad:
        raise ValueError(f"ModelConfig.{what} {bad} outside [0, vocab_size=" f"{self.vocab_size})")

  @property
  def layer_windows(self) -> tuple[int, ...]:
    """Per layer, the keys its query sees (itself included): the sliding window on a
    sliding layer, 0 (every earlier key) on a full one. The seam's optional attribute."""
    types = self.layer_types or ("full",) * self.n_layers
    return tuple(self.sliding_window if t == "sliding" else 0 for t in types)

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
      if self.qk_norm:
        shapes.update({p + "q_norm": (self.head_dim,), p + "k_norm": (self.head_dim,)})
      if self.family == "gemma3":
        shapes.update({p + "post_attn_norm": (d,), p + "post_mlp_norm": (d,)})
    return shapes

  @classmethod
  def from_hf_config(
      cls, cfg: Mapping[str, Any], *, name: str | None = None, chat_template: str | None = None
  ) -> ModelConfig:
    """Build from a HF `config.json` dict (model_type in `HF_MODEL_TYPES`)."""
    model_type = cfg.get("model_type")
    if model_type not in HF_MODEL_TYPES:
      raise ValueError(
          f"config.json: model_type {model_type!r} is not supported "
          f"(supported: {', '.join(map(repr, HF_MODEL_TYPES))})"
      )
    gemma = model_type == "gemma3_text"
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
      if cfg.get(key) is not None:
        raise ValueError(f"config.json: {key}={cfg[key]!r} is not supported")
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
    # transformers>=5 moves rope settings into `rope_parameters` (Gemma 3: one entry per
    # layer type, {"full_attention": {...}, "sliding_attention": {...}}).
    rope = cfg.get("rope_parameters") or {}
    local = rope.get("sliding_attention") or {}
    rope = rope.get("full_attention", rope)
    theta = cfg.get("rope_theta", rope.get("rope_theta", 1e6 if gemma else 10000.0))
    scaling = cfg.get("rope_scaling") or rope or None
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
      scaling = None
    if gemma and scaling:
      raise ValueError(f"config.json: Gemma 3 RoPE scaling {scaling!r} is not supported yet")
    window = cfg.get("sliding_window")
    layer_types: tuple[str, ...] = ()
    if gemma:  # five sliding layers, then a full one, unless the config lists them
      pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
      types = cfg.get("layer_types") or [
          "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
          for i in range(n_layers)
      ]
      layer_types = tuple("sliding" if t == "sliding_attention" else "full" for t in types)
    elif window and cfg.get("use_sliding_window", model_type == "mistral"):
      layer_types = ("sliding",) * n_layers  # Mistral: a window on every layer
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
        max_context=int(cfg.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        qkv_bias=model_type == "qwen2",
        bos_id=cfg.get("bos_token_id"),
        eos_ids=eos_ids,
        chat_template=chat_template,
        name=name or cfg.get("_name_or_path") or model_type,
        family="gemma3" if gemma else "llama",
        qk_norm=gemma or model_type == "qwen3",
        sliding_window=int(window) if layer_types else None,
        layer_types=layer_types,
        rope_local_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
        if gemma
        else None,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)) if gemma else None,
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
