"""Research decode loop: a minimal Llama (SmolLM2-135M GGUF) with a paged KV cache.

``load_model()`` reads the GGUF, ``model.generate(prompts, max_new_tokens, backend=...)``
prefills each prompt and greedy-decodes the batch, each sequence until its end-of-text token
(``ignore_eos=True``: all ``max_new_tokens``); the memory-bound ops of the step go through an
ops backend ("loomnb-cuda", "loomnb-cpu", "torch-reference" or "torch"), the GEMMs are torch.
See :mod:`loomnb.models.llama` for the loop and ``loomnb generate --help`` for the CLI.
:mod:`loomnb.models.moe` is a reference mixture-of-experts layer (``moe_forward``) over
loomnb's MoE ops, in the same backend split (kernels on CUDA, oracles on the CPU).

The names below load their modules (and torch) at first use, so ``loomnb --version`` and
``loomnb generate --help`` (:mod:`loomnb.models.cli`) run without importing torch.
"""

import importlib as _importlib

_WHERE = {  # name -> the module of this package that defines it
    "BACKENDS": "_names", "get_backend": "backends",
    "LlamaConfig": "gguf_loader", "default_gguf_path": "gguf_loader",
    "load_checkpoint": "gguf_loader",
    "DECODE_BUCKETS": "graphs", "DecodeGraphs": "graphs", "bucket_size": "graphs",
    "GenerationResult": "llama", "LlamaModel": "llama", "ModelRunner": "llama",
    "compare_greedy": "llama", "load_model": "llama",
    "DEEPSEEK_V3": "moe", "MoEConfig": "moe", "MoEWeights": "moe", "QWEN3_30B_A3B": "moe",
    "moe_forward": "moe", "moe_route": "moe", "synthetic_weights": "moe",
    "BLOCK_SIZE": "paged_cache", "PagedKVCache": "paged_cache",
    "compute_slot_mapping": "paged_cache",
    "GGUFTokenizer": "tokenizer",
}
__all__ = sorted(_WHERE)


def __getattr__(name):  # PEP 562
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
