"""Layout helpers: dtype packing (bf16/fp16/FP8 E4M3) and vLLM's paged KV-cache layouts."""

# The dtype packing helpers (``loomnb.layouts.dtypes``) are device functions: import that
# module where it is needed, never here at package import time.
from .paged_kv import (FLASHINFER_TO_VLLM, KV_LAYOUTS, LAYOUTS, PAD_SLOT_ID, allocate_kv_cache,
                       block_offset_to_slot, block_tables_to_flashinfer, cdiv, element_index,
                       flashinfer_to_block_tables, from_nhd, key_cache_shape, kv_cache_shape,
                       kv_element_offset, kv_views, paged_attention_x, seq_idx_and_positions,
                       slot_mapping_from_block_tables, slot_mapping_from_seq_lens,
                       slot_to_block_offset, to_nhd, value_cache_shape)

__all__ = ["FLASHINFER_TO_VLLM", "KV_LAYOUTS", "LAYOUTS", "PAD_SLOT_ID", "allocate_kv_cache",
           "block_offset_to_slot", "block_tables_to_flashinfer", "cdiv", "element_index",
           "flashinfer_to_block_tables", "from_nhd", "key_cache_shape", "kv_cache_shape",
           "kv_element_offset", "kv_views", "paged_attention_x", "seq_idx_and_positions",
           "slot_mapping_from_block_tables", "slot_mapping_from_seq_lens", "slot_to_block_offset",
           "to_nhd", "value_cache_shape"]
