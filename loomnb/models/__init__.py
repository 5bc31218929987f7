"""Research decode loop: a minimal Llama (SmolLM2-135M GGUF) with a paged KV cache.

``load_model()`` reads the GGUF, ``model.generate(prompts, max_new_tokens, backend=...)``
prefills each prompt and greedy-decodes the batch; the norms go through an ops backend
("loomnb-cuda", "loomnb-cpu" or "torch-reference"), everything else is torch. See
:mod:`loomnb.models.llama` for the loop and ``loomnb generate --help`` for the CLI.
"""

from .backends import BACKENDS, get_backend
from .gguf_loader import LlamaConfig, default_gguf_path, load_checkpoint
from .graphs import DECODE_BUCKETS, DecodeGraphs, bucket_size
from .llama import (
    GenerationResult,
    LlamaModel,
    ModelRunner,
    compare_greedy,
    load_model,
)
from .paged_cache import BLOCK_SIZE, PagedKVCache, compute_slot_mapping
from .tokenizer import GGUFTokenizer

__all__ = [
    "BACKENDS",
    "BLOCK_SIZE",
    "DECODE_BUCKETS",
    "DecodeGraphs",
    "GGUFTokenizer",
    "GenerationResult",
    "LlamaConfig",
    "LlamaModel",
    "ModelRunner",
    "PagedKVCache",
    "bucket_size",
    "compare_greedy",
    "compute_slot_mapping",
    "default_gguf_path",
    "get_backend",
    "load_checkpoint",
    "load_model",
]
