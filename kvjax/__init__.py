"""kvjax: KV-cache compression for JAX.

The session API (any model with the seam of `kvjax.seam`):

    spec = kvjax.CompressionSpec(policy="h2o", budget=512)
    state = kvjax.prefill(model, [document], spec, tokenizer=tokenizer, chat=True)
    _, answer = kvjax.ask(model, tokenizer, state, ["Who wrote it?"], chat=True)
    state, result = kvjax.decode(model, state, max_new_tokens=32)
    state = kvjax.extend(model, state, follow_ups)
    a, b = kvjax.fork(state, 2)
    kvjax.save_state("doc.kvjax", state, model)     # orbax; kvjax.load_state in any process
    state = kvjax.prefill(model, prompts, spec, mesh="data=2,model=2")   # over 4 devices
    kvjax.tune(model, tokenizer, text=sample, target="kl=0.05").write("tuned")
    spec = kvjax.load_spec("tuned/tuned.json", model)   # the setting kvjax chose

`kvjax.generate` does prefill + ask (or decode) in one call; the cache primitives below (`init_cache`,
`append`, `evict`) are the layer underneath.
"""

from kvjax._version import __version__ as __version__
from kvjax.cache import (
    CacheConfig,
    CacheError,
    NumericsError,
    PagedKVCache,
    PageTable,
    Slot,
    Status,
    append,
    append_layer,
    check_status,
    init_cache,
    logical_view,
    read_sequence,
    valid_mask,
)
from kvjax.eviction import evict, protection_mask
from kvjax.persistence import StateFileError, load_state, save_state, state_info
from kvjax.runtime.compilation import compile_stats
from kvjax.runtime.generation import (
    CompressionSkipped,
    Generation,
    GenerationResult,
    TokenEvent,
    ask,
    generate,
)
from kvjax.runtime.prompts import Segment
from kvjax.runtime.sampling import Sampling
from kvjax.runtime.tokenizer import TokenizerLike, as_tokenizer
from kvjax.runtime.session import decode, extend, fork, prefill
from kvjax.runtime.state import DecodeResult, State
from kvjax.seam import ModelShape
from kvjax.sharding import make_mesh, shard_model
from kvjax.spec import CompressionSpec
from kvjax.tuning import load_spec, tune

__all__ = [
    "CacheConfig",
    "CacheError",
    "CompressionSkipped",
    "CompressionSpec",
    "DecodeResult",
    "Generation",
    "GenerationResult",
    "ModelShape",
    "NumericsError",
    "PageTable",
    "PagedKVCache",
    "Sampling",
    "Segment",
    "Slot",
    "StateFileError",
    "TokenizerLike",
    "State",
    "Status",
    "TokenEvent",
    "append",
    "append_layer",
    "as_tokenizer",
    "ask",
    "check_status",
    "compile_stats",
    "decode",
    "evict",
    "extend",
    "fork",
    "generate",
    "init_cache",
    "load_spec",
    "load_state",
    "logical_view",
    "make_mesh",
    "prefill",
    "protection_mask",
    "read_sequence",
    "save_state",
    "shard_model",
    "state_info",
    "tune",
    "valid_mask",
]
