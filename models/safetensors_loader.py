"""Load a local HF checkpoint dir (config.json + *.safetensors) into canonical float32 params."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from .config import ModelConfig, TensorNames, check_params

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
_LAYERS_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_QK_NORMS = {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}
_NAMES = TensorNames(_GLOBAL_NAMES, _LAYERS_RE, {**_LAYER_NAMES, **_QK_NORMS})
# Gemma 3 norms around both blocks: its "post_attention_layernorm" follows attention (Llama's
# precedes the MLP).
_GEMMA3_NAMES = TensorNames(
    _GLOBAL_NAMES,
    _LAYERS_RE,
    {
        **{k: v for k, v in _LAYER_NAMES.items() if not k.startswith("post_attention")},
        **_QK_NORMS,
        "post_attention_layernorm.weight": "post_attn_norm",
        "pre_feedforward_layernorm.weight": "mlp_norm",
        "post_feedforward_layernorm.weight": "post_mlp_norm",
    },
)
INDEX_FILE = "model.safetensors.index.json"


def read_json(path: Path) -> Any:
  try:
    return json.loads(path.read_text(encoding="utf-8"))
  except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{str(path)!r} is not a readable JSON file: {e}") from e


def read_chat_template(d: Path) -> str | None:
  """The chat template from chat_template.jinja or tokenizer_config.json, if any."""
  if (d / "chat_template.jinja").is_file():
    return (d / "chat_template.jinja").read_text(encoding="utf-8")
  if (d / "tokenizer_config.json").is_file():
    t = read_json(d / "tokenizer_config.json").get("chat_template")
    if isinstance(t, list):  # named templates: [{"name": ..., "template": ...}]
      t = next((x["template"] for x in t if x.get("name") == "default"), None)
    return t
  return None


def shard_files(d: Path) -> list[Path]:
  """The safetensors files of checkpoint dir `d`, from the shard index when there is one."""
  if (d / INDEX_FILE).is_file():
    weight_map = read_json(d / INDEX_FILE).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise ValueError(f"{str(d / INDEX_FILE)!r} has no 'weight_map'")
    files = [d / f for f in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
      raise FileNotFoundError(
          f"{str(d)!r}: shards listed in {INDEX_FILE} are missing: " f"{missing}"
      )
    return files
  files = sorted(d.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(f"{str(d)!r}: no *.safetensors files")
  return files


def load_hf_dir(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
  """Load a local HF checkpoint dir (Llama, Mistral, Qwen2/3, Gemma 3 text): (config,
  canonical float32 params)."""
  from safetensors import SafetensorError, safe_open

  d = Path(path)
  if not d.exists():
    raise FileNotFoundError(f"model directory not found: {str(d)!r}")
  if not d.is_dir():
    raise ValueError(f"{str(d)!r} is not a directory (expected config.json + *.safetensors)")
  if not (d / "config.json").is_file():
    raise FileNotFoundError(f"{str(d)!r}: no config.json")
  hf = read_json(d / "config.json")
  if (d / "generation_config.json").is_file():
    # Instruct models list extra stop ids (e.g. Llama-3's <|eot_id|>) only here.
    gen_eos = read_json(d / "generation_config.json").get("eos_token_id")
    if gen_eos is not None:
      eos = hf.get("eos_token_id")
      eos = [] if eos is None else (list(eos) if isinstance(eos, list) else [eos])
      gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
      hf = {**hf, "eos_token_id": list(dict.fromkeys(eos + gen_eos))}
  config = ModelConfig.from_hf_config(hf, name=d.name, chat_template=read_chat_template(d))

  names = _GEMMA3_NAMES if config.family == "gemma3" else _NAMES
  params: dict[str, np.ndarray] = {}
  for f in shard_files(d):
    try:
      with safe_open(f, framework="numpy") as sf:
        for name in sf.keys():
          if name.endswith("rotary_emb.inv_freq"):  # buffer saved by old transformers
            continue
          key = names.canonical(name, str(f))
          if key in params:
            raise ValueError(f"{str(f)!r}: tensor {name!r} appears in several shards")
          params[key] = np.asarray(sf.get_tensor(name), dtype=np.float32)
          if config.family == "gemma3" and key.endswith("norm"):
            params[key] += 1.0  # Gemma's norms scale by (1 + w): the params hold the factor
    except SafetensorError as e:
      raise ValueError(f"{str(f)!r} is not a valid safetensors file: {e}") from e
  if config.tie_embeddings:
    params.pop("lm_head", None)  # some tied checkpoints also save the (identical) head
  check_params(config, params, str(d))
  return config, params
