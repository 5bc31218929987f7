"""Layout helpers: dtype packing (bf16/fp16/FP8 E4M3) and vLLM's paged KV-cache layouts."""
