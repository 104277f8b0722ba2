"""The paged KV cache: K/V in pages of a shared pool, one page table per (layer, row, kv
head), and an allocator that runs inside `jit`.

    pages        `PageTable`: the page table and free stack, and every allocator operation
                 (allocate, free, compact), as fixed-shape array programs; the page arithmetic
    sizing       how many tokens and pages a budget, a margin or a request needs
    config       `CacheConfig`: sizes, budget and protection, validated once
    paged_cache  `PagedKVCache` (pages + table + per-slot state), `init_cache`, `append`, and
                 the views of it (`logical_view`, `valid_mask`, `read_sequence`)

What a cache keeps is decided by `kvjax.eviction`, scored by `kvjax.policies`.
"""

from kvjax.cache.config import GROUP_REDUCTIONS, CacheConfig
from kvjax.cache.paged_cache import (
    CacheError,
    NumericsError,
    PagedKVCache,
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
from kvjax.cache.pages import NULL_PAGE, PageTable

__all__ = [
    "GROUP_REDUCTIONS",
    "NULL_PAGE",
    "CacheConfig",
    "CacheError",
    "NumericsError",
    "PageTable",
    "PagedKVCache",
    "Slot",
    "Status",
    "append",
    "append_layer",
    "check_status",
    "init_cache",
    "logical_view",
    "read_sequence",
    "valid_mask",
]
