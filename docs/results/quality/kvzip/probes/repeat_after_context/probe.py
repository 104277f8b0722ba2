# Ran on kvjax at 99e2702, the commit that recorded its results (results.md beside it);
# not edited since. It subclasses kvjax internals (kvjax.policies.kvzip at that commit),
# which have moved since.
"""Probe: chunk-local kvzip with the repeat placed after the whole context (not after its span)."""
import dataclasses, sys
from typing import ClassVar
import numpy as np
import kvjax.policies.kvzip as kz
from kvjax import policies
from kvjax.cli import main

_orig_minimum = np.minimum

@dataclasses.dataclass(frozen=True)
class KVzipAfterContext(kz.KVzip):
  name: ClassVar[str] = "kvzip_after_context"
  def score_context(self, reader, state, context, progress=None):
    # np.minimum(context.lengths, start + chunk) -> context.lengths: positions after the context
    kz.np = type("npshim", (), {"minimum": staticmethod(lambda a, b: np.asarray(a)), "int32": np.int32, "asarray": np.asarray})
    try:
      return super().score_context(reader, state, context, progress)
    finally:
      kz.np = np

policies.register(KVzipAfterContext)
sys.exit(main(sys.argv[1:]))
