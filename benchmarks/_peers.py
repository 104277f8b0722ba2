"""Timing one request in kvjax and in transformers (PyTorch), shared by the benchmarks that
put them side by side (`vs_torch`, `roofline`). Not a benchmark itself."""

from __future__ import annotations

import pathlib
import time
import warnings

import jax

import kvjax


def load_transformers(path: pathlib.Path):
  """transformers' `AutoModelForCausalLM` from the GGUF at `path` (float32, sdpa attention;
  from the test extras), in eval mode."""
  import torch
  import transformers

  warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' cache renames
  transformers.logging.set_verbosity_error()
  return transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa"
  ).eval()


def kvjax_prefill(model, ids, spec, steps):
  """(seconds, state): kvjax's prefill of `ids` with room for `steps` decode steps."""
  start = time.perf_counter()
  state = kvjax.prefill(model, [ids], spec, reserve=steps)
  jax.block_until_ready(state.logits)
  return time.perf_counter() - start, state


def kvjax_decode(model, state, steps):
  """Seconds per token of `steps` greedy decode steps from `state`."""
  _, result = kvjax.decode(model, state, steps)
  return result.stats["decode_seconds"] / steps


def torch_prefill_decode(ref, ids, steps):
  """(prefill seconds, decode seconds per token or None for no steps) of transformers on
  `ids`, greedy."""
  import torch

  with torch.no_grad():
    x = torch.tensor([ids])
    start = time.perf_counter()
    # The last token's logits only, as kvjax's prefill (and transformers' generate) computes.
    out = ref(input_ids=x, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - start
    past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for _ in range(steps):
      out = ref(input_ids=token, past_key_values=past, use_cache=True)
      past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return prefill, ((time.perf_counter() - start) / steps if steps else None)


def torch_generate(ref, ids, new_tokens):
  """Seconds for transformers' greedy `generate` of `new_tokens` after `ids`."""
  import torch

  with torch.no_grad():
    start = time.perf_counter()
    ref.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
    return time.perf_counter() - start
