"""kvjax: KV-cache compression for JAX."""

from kvjax.cache import (
    CacheError,
    PagedKVCache,
    Status,
    append,
    append_layer,
    check_status,
    init_cache,
    logical_view,
    read_sequence,
    valid_mask,
)
from kvjax.config import CacheConfig
from kvjax.eviction import evict, protection_mask
from kvjax.scores import group_importance

__version__ = "0.1.0"

__all__ = [
    "CacheConfig",
    "CacheError",
    "PagedKVCache",
    "Status",
    "append",
    "append_layer",
    "check_status",
    "evict",
    "group_importance",
    "init_cache",
    "logical_view",
    "protection_mask",
    "read_sequence",
    "valid_mask",
]

from kvjax.generation import GenerationResult, Segment, TokenEvent, generate  # noqa: E402

__all__ += ["GenerationResult", "Segment", "TokenEvent", "generate"]
