"""Fill the compiled-step store ahead of the requests a deployment will see.

A request compiles the steps of its shapes (`kvjax.runtime.compilation`): its capacity bucket, its
prefill chunk, its batch, its `max_new_tokens`, greedy or sampling, the compression spec.
On a CPU that is seconds per new shape, once per machine: later processes load the steps
from the store in the cache directory. `warmup` runs one request of each shape on filler
tokens, so that a fresh image or notebook pays none of it on its users' first requests.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvjax.runtime import compilation
from kvjax_store.cache_dir import private_dir
from kvjax.runtime.sampling import Sampling
from kvjax.seam import ModelShape
from kvjax.cache.sizing import BUCKET_TOKENS
from kvjax.spec import CompressionSpec
from kvjax._checks import check_int

# What the warm-up prompts say: the compiled steps depend on the prompts' lengths only.
_FILLER = "The committee met on Tuesday to review the budget, the schedule and the plans. "
SHORT_PROMPTS = (32, 64, 128)  # chat-sized prompts: prefill chunks of 32, 64 and 128 tokens


def default_lengths(max_context: int, max_new_tokens: int) -> list[int]:
  """Prompt lengths that cover every shape a request of one row can have up to the model
  context: short prompts (their prefill chunk is a power of two under 256), then the
  longest prompt of each capacity bucket (`sizing.BUCKET_TOKENS`) that leaves room for
  `max_new_tokens`."""
  check_int("max_context", max_context)
  check_int("max_new_tokens", max_new_tokens)
  if max_new_tokens >= max_context:
    raise ValueError(
        f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model context "
        f"{max_context}"
    )
  room = max_context - max_new_tokens
  lengths = [n for n in SHORT_PROMPTS if n <= room]
  top = BUCKET_TOKENS
  while top - BUCKET_TOKENS < room:
    longest = min(top, max_context) - max_new_tokens
    if longest > (lengths[-1] if lengths else 0):
      lengths.append(longest)
    top += BUCKET_TOKENS
  return lengths


def store_path():
  """The compiled-step store warmup fills; ValueError when there is none to fill."""
  if not compilation.store_enabled():
    raise ValueError("KVJAX_EXECUTABLES=off turns the compiled-step store off: nothing to warm")
  path = private_dir("executables")
  if path is None:
    raise ValueError(
        "no compiled-step store: KVJAX_CACHE_DIR=off, or the cache directory is not private "
        "to this user (see the warning above)"
    )
  return path


def warmup(
    model,
    tokenizer,
    spec: CompressionSpec | None = None,
    *,
    lengths: Sequence[int] | None = None,
    batch: int = 1,
    max_new_tokens: int = 64,
    sampling: Sampling = Sampling(),
    report=None,
) -> list[dict]:
  """Runs `kvjax.generate` once per prompt length (a repeated filler sentence, no chat
  template, `batch` rows) with these settings, so that the store holds their compiled steps
  (they depend on shapes and settings, not on the text).

  `lengths` default to `default_lengths`. `report(row)` is called after each length.
  Returns one dict per length: length, compiled (steps compiled), loaded (steps loaded
  from the store), seconds (the request's wall time)."""
  from kvjax.runtime.generation import generate

  spec = CompressionSpec() if spec is None else spec
  shape = ModelShape.of(model)
  check_int("batch", batch)
  default = default_lengths(shape.max_context, max_new_tokens)  # checks max_new_tokens
  lengths = default if lengths is None else list(lengths)
  for n in lengths:
    check_int("lengths", n)
    if n + max_new_tokens > shape.max_context:
      raise ValueError(
          f"lengths: a {n}-token prompt + max_new_tokens={max_new_tokens} passes the model "
          f"context {shape.max_context}"
      )
  filler = tokenizer.encode(_FILLER)
  filler = filler * -(-max(lengths, default=1) // len(filler))
  rows = []
  for n in lengths:
    start = time.perf_counter()
    stats = generate(
        model,
        tokenizer,
        [filler[:n]] * batch,
        spec,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
    ).stats
    row = {
        "length": n,
        "compiled": stats["compiles"] - stats["loaded"],  # `compiles` counts the loaded too
        "loaded": stats["loaded"],
        "seconds": time.perf_counter() - start,
    }
    rows.append(row)
    if report is not None:
      report(row)
  return rows
