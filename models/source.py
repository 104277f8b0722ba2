"""What a model name or path resolves to: the files a model is read from (`registry`), and
what the weight cache keys its entries on (`weight_cache`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """Where a model is read from: a GGUF file or a Hugging Face directory (config.json and
  *.safetensors), and the name it goes by."""

  kind: Literal["gguf", "hf"]  # "hf": a directory with config.json + *.safetensors
  path: Path
  name: str
