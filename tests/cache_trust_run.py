"""One fresh process for tests/test_cache_trust.py: generates with a tiny model through JAX's
persistent cache (the executable store off), with another through the executable store,
and loads a tiny checkpoint through the weight cache; prints one JSON line: the tokens,
steps loaded from the store, JAX cache hits, a digest of the weights, the warnings."""

import hashlib
import json
import pathlib
import sys
import warnings

import numpy as np

# Run as a script from tests/, whose models/ folder would hide the `models` package.
sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])


def main(checkpoint: str) -> None:
  import os

  import kvjax
  import models
  from kvjax.runtime import compilation
  from kvjax.testing import ByteTokenizer, tiny_llama

  spec = kvjax.CompressionSpec(policy="h2o", budget=8, page_size=4, prefill_chunk=8)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    os.environ["KVJAX_EXECUTABLES"] = "off"
    through_jax = kvjax.generate(
        tiny_llama(n_layers=1), ByteTokenizer(), ["jax cache"], spec, max_new_tokens=6
    )
    hits = compilation._JAX_CACHE_HITS[0]
    os.environ["KVJAX_EXECUTABLES"] = "on"
    result = kvjax.generate(tiny_llama(), ByteTokenizer(), ["planted?"], spec, max_new_tokens=6)
    _, params, _ = models.load_model(checkpoint)
  digest = hashlib.sha256()
  for name in sorted(params):
    digest.update(name.encode() + np.asarray(params[name], np.float32).tobytes())
  print(
      json.dumps(
          {
              "tokens": [through_jax.tokens, result.tokens],
              "loaded": result.stats["loaded"],
              "jax_cache_hits": hits,
              "weights": digest.hexdigest(),
              "warnings": [str(w.message) for w in caught],
          }
      )
  )


if __name__ == "__main__":
  main(sys.argv[1])
