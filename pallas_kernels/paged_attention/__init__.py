"""Paged attention over the kvjax page pool, returning the statistics eviction policies use.

One op in modules by role, as jax's own Pallas ops are split:

- `reference`: the specification (pure jnp): `paged_attention_reference` and
  `paged_attention_lse_reference`.
- `blocks`: the live-blocks loops (pure jnp, reading only live pages):
  `paged_attention_live_blocks` and `paged_attention_key_max`.
- `tpu`: the TPU decode kernel `paged_attention_pallas` (its design notes head the module).
- `gpu`: its GPU (Triton) variant `paged_attention_pallas_gpu`.
- `dispatch`: `paged_attention(..., impl=...)`, the dispatcher, and
  `paged_attention_live_prefix`, the reference path's decode.
- `_decode`: what the two kernels share (the in-kernel online softmax and the epilogue).

Every name is importable from this package, as it was from the one module it replaces.
"""

from pallas_kernels._common import (
    IMPLS,
    SUPPORTED_DTYPES,
    check_float_dtypes,
    check_page_table_range,
    default_pages_per_block,
    effective_lengths,
    is_traced,
    last_live_block,
    paged_kv_specs,
    prepare_paged_operands,
    resolve_impl,
)
from pallas_kernels._common import validate_paged_args as validate_paged_attention_args
from pallas_kernels.paged_attention.blocks import (
    KEY_MAX_BLOCK_TOKENS,
    LIVE_BLOCK_TOKENS,
    paged_attention_key_max,
    paged_attention_live_blocks,
)

# Not PREFIX_MIN_TOKENS: `dispatch` reads it at call time, so it is set there, not here.
from pallas_kernels.paged_attention.dispatch import (
    paged_attention,
    paged_attention_live_prefix,
    prefix_heads_per_step,
    prefix_widths,
)
from pallas_kernels.paged_attention.gpu import (
    check_gpu_pool_size,
    check_gpu_shapes,
    gpu_pages_per_block,
    paged_attention_pallas_gpu,
)
from pallas_kernels.paged_attention.reference import (
    paged_attention_lse_reference,
    paged_attention_reference,
    visible_mask,
)
from pallas_kernels.paged_attention.tpu import paged_attention_pallas

__all__ = [
    "IMPLS",
    "SUPPORTED_DTYPES",
    "check_float_dtypes",
    "check_gpu_pool_size",
    "check_gpu_shapes",
    "default_pages_per_block",
    "effective_lengths",
    "gpu_pages_per_block",
    "is_traced",
    "last_live_block",
    "paged_attention",
    "paged_attention_key_max",
    "paged_attention_live_blocks",
    "paged_attention_live_prefix",
    "paged_attention_lse_reference",
    "paged_attention_pallas",
    "paged_attention_pallas_gpu",
    "paged_attention_reference",
    "paged_kv_specs",
    "prepare_paged_operands",
    "resolve_impl",
    "validate_paged_attention_args",
    "visible_mask",
]
