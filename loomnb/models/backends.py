"""Ops backends: the memory-bound operators of the decode loop, swappable as a unit.

A backend has ``name``, ``loomnb_ops`` (the ops it runs through loomnb) and one method per op
of ``LOOMNB_OPS``, named and ordered as the loomnb op (``loomnb.<name>``) it stands for:

* ``rms_norm(x, weight, eps) -> y`` (new tensor);
* ``fused_add_rms_norm(x, residual, weight, eps) -> (x, residual)``, in place:
  ``residual <- r(x + residual)``, ``x <- rms_norm(residual)``;
* ``rotary_embedding_and_cache(positions, query, key, value, key_cache, value_cache,
  slot_mapping, head_size, cos_sin_cache, is_neox, kv_cache_dtype="auto", k_scale=None,
  v_scale=None)``: NeoX (or GPT-J) rotary embedding of ``query``/``key`` in place (views of the
  fused QKV projection, ``[num_tokens, num_heads * head_size]`` with the QKV row stride) and
  the rotated key and the value written to the paged cache at ``slot_mapping`` (slots < 0
  write nothing that is read: loomnb skips them, torch sends them to the scratch block), as
  bits (``"auto"``) or as ``uint8`` E4M3 codes of ``x / scale`` (``"fp8"``; float32 ``[1]``
  scales: ``loomnb.reshape_and_cache_flash``'s rule);
* ``paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, *,
  kv_cache_dtype="auto", k_scale=None, v_scale=None) -> out``, one query token per sequence,
  ``[num_seqs, num_heads * head_size]`` (the op's heads flattened); an FP8 cache is read as
  ``f32(code) * scale``;
* ``silu_and_mul(x) -> y``: ``silu(x[..., :d]) * x[..., d:]``;
* ``greedy_sample_logprob(logits) -> (token_ids int64, logprob fp32, rank int64)``: argmax
  (lowest index on ties) and the token's log-softmax and rank (vLLM's V1 sampler).

and, for a sampled decode (:mod:`loomnb.models.sampling_params`; ``SAMPLER_OPS``), the
sampler family's ops with loomnb's signatures:

* ``apply_penalties_(logits, prompt_token_mask, output_token_counts, repetition_penalties,
  frequency_penalties, presence_penalties) -> logits``: vLLM's penalties on fp32 logits, in
  place (the torch backends in torch, with the division of vLLM's CUDA op);
* ``top_k_top_p_sampling_from_logits(logits, top_k, top_p, temperature, min_p, seed, offset)
  -> token_ids int32``: the seeded draw (per-row int64 seeds, an int64 ``[1]`` offset);
  the torch backends run loomnb's NumPy oracle on host copies (the draw's definition; not
  inside a CUDA graph);
* ``selected_token_logprob_rank(logits, token_ids) -> (logprob fp32, rank int64)``: the
  sampled token's log-softmax and rank (V1's definitions);
* ``top_k_top_p_mask_logits(logits, top_k, top_p, temperature, min_p) -> fp32 [R, V]``: the
  processed logits (``logprobs_mode="processed_logprobs"``), the torch backends through the
  oracle on host copies;
* ``chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, seed, offset) ->
  (output_token_ids, accepted, emitted)``: speculative sampling of a pass's drafts (one-hot
  drafts with ``draft_probs`` None; the torch backends through the oracle on host copies);

and, outside the decode step (not in ``LOOMNB_OPS``), the cache op of the prefix cache's
copy-on-write (:mod:`loomnb.models.prefix_cache`):

* ``copy_blocks(key_caches, value_caches, block_mapping)``: for every layer ``l`` and row
  ``(src, dst)`` of ``block_mapping`` (int64 ``[num_pairs, 2]``, on the caches' device),
  ``key_caches[l][dst] = key_caches[l][src]`` and ``value_caches[l][dst] =
  value_caches[l][src]`` (bits), one call for all layers; mutates the caches. No ``dst`` may
  be another row's ``src`` or ``dst`` (the rows run at once, in the torch backends as in
  ``loomnb.copy_blocks`` and vLLM's kernel).

Caches are per-layer strided views ``[num_blocks, block_size, num_kv_heads, head_size]`` of
the interleaved ``(num_blocks, 2, block_size, num_kv_heads, head_size)`` layout of vLLM 0.24's
FlashAttention backend. Every backend follows loomnb's numerics (``docs/numerics.md``): the
norms' float64 ``inv``, vLLM's CUDA rounding points for RoPE (fp32, the products of the
rotation fused as vLLM's build fuses them, one rounding per output), silu and the multiply
each rounded to the activation dtype, fp32 attention rounded once. So greedy tokens compare
exactly between backends; attention differs only in the fp32 summation order (the torch
reference softmaxes in one piece, the kernel online), which can move an output by one ulp.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ._names import BACKENDS, LOOMNB_OPS
from .paged_cache import paged_attention, reshape_and_cache


def _rope_and_cache(rotate, widen, positions, query, key, value, key_cache, value_cache,
                    slot_mapping, head_size, cos_sin_cache, is_neox, kv_cache_dtype, k_scale,
                    v_scale):
    """The torch backends' ``rotary_embedding_and_cache``: ``(x, y) <- rotate(x, y, cos, sin)``
    rounded to the query dtype, in place, for ``query`` and ``key`` (``[num_tokens, heads *
    head_size]``), ``x, y`` the two halves (NeoX) or the even/odd channels (GPT-J) of the first
    ``rot = cos_sin_cache.shape[1]`` dimensions of each head and ``cos, sin`` (``[num_tokens, 1,
    rot / 2]``) the rows ``positions`` of ``cos_sin_cache``, all of them passed through
    ``widen`` (the arithmetic dtype); then the key and value written to the paged cache."""
    num_tokens = positions.shape[0]
    rot = cos_sin_cache.shape[1]
    cos, sin = widen(cos_sin_cache.index_select(0, positions)).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    xs, ys = ((slice(0, rot // 2), slice(rot // 2, rot)) if is_neox else
              (slice(0, rot, 2), slice(1, rot, 2)))
    for t in (query, key):
        heads = t.view(num_tokens, -1, head_size)
        new_x, new_y = rotate(widen(heads[..., xs]), widen(heads[..., ys]), cos, sin)
        heads[..., xs], heads[..., ys] = new_x.to(t.dtype), new_y.to(t.dtype)
    num_kv_heads = key_cache.shape[2]
    reshape_and_cache(key.view(num_tokens, num_kv_heads, head_size),
                      value.reshape(num_tokens, num_kv_heads, head_size), key_cache,
                      value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


class TorchReferenceOps:
    """Pure torch with loomnb's rounding points (the spec the kernels are checked against)."""

    name = "torch-reference"
    loomnb_ops: tuple[str, ...] = ()

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        ss = xf.double().pow(2).sum(-1, keepdim=True)
        eps64 = float(np.float32(eps))  # eps is a float32 in the kernels, as in vLLM
        inv = (1.0 / torch.sqrt(ss / x.shape[-1] + eps64)).float()
        n = (xf * inv).to(x.dtype)
        return n * weight

    @classmethod
    def fused_add_rms_norm(cls, x, residual, weight, eps):
        z = x + residual  # one rounding to the activation dtype
        residual.copy_(z)
        x.copy_(cls.rms_norm(z, weight, eps))
        return x, residual

    @staticmethod
    def rotary_embedding_and_cache(positions, query, key, value, key_cache, value_cache,
                                   slot_mapping, head_size, cos_sin_cache, is_neox,
                                   kv_cache_dtype="auto", k_scale=None, v_scale=None):
        """The rotation as vLLM's CUDA op computes it: ``x' = fma(x, c, -r32(y*s))``,
        ``y' = fma(x, s, r32(y*c))`` in fp32 (emulated in float64: the float32 products are
        exact there), rounded once to the query dtype, ``(x, y)`` the two halves (NeoX) or the
        even/odd channels (GPT-J) of the rotary dimensions; then the cache write."""
        def rotate(x, y, cos, sin):  # float64 operands, r32 = .float()
            y_sin, y_cos = (y * sin).float().double(), (y * cos).float().double()
            return (x * cos - y_sin).float(), (x * sin + y_cos).float()

        _rope_and_cache(rotate, lambda t: t.float().double(), positions, query, key, value,
                        key_cache, value_cache, slot_mapping, head_size, cos_sin_cache, is_neox,
                        kv_cache_dtype, k_scale, v_scale)

    @staticmethod
    def paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, *,
                               kv_cache_dtype="auto", k_scale=None, v_scale=None):
        """The decode attention's float64 value rounded once to the query dtype (what
        ``loomnb.oracle.paged_decode_attention`` computes; the kernel's fp32 online softmax
        lands within its tolerance of it)."""
        positions = (seq_lens - 1).to(torch.long)
        return paged_attention(query, key_cache, value_cache, block_tables, seq_lens, positions,
                               scale, acc_dtype=torch.float64, k_scale=k_scale, v_scale=v_scale)

    @staticmethod
    def silu_and_mul(x):
        """``r(f(r(silu(g))) * f(u))`` with ``silu(g) = g / (1 + expf(-g))`` in fp32, ``expf``
        correctly rounded (float64 ``exp`` rounded once): vLLM's rounding points, and the
        oracle's ``expf`` (the GPU kernel's libdevice ``expf`` is within 2 ulps of it)."""
        d = x.shape[-1] // 2
        g, u = x[..., :d].float(), x[..., d:].float()
        s = (g / (1 + torch.exp(-g.double()).float())).to(x.dtype)
        return (s.float() * u).to(x.dtype)

    @classmethod
    def greedy_sample_logprob(cls, logits):
        ids = torch.argmax(logits.float(), dim=-1)
        return (ids, *cls.selected_token_logprob_rank(logits, ids))

    @staticmethod
    def selected_token_logprob_rank(logits, token_ids):
        lp = torch.log_softmax(logits.float(), dim=-1)
        tok_lp = lp.gather(-1, token_ids.view(-1, 1))
        return tok_lp.squeeze(-1), (lp >= tok_lp).sum(-1)

    @staticmethod
    def apply_penalties_(logits, prompt_token_mask, output_token_counts, repetition_penalties,
                         frequency_penalties, presence_penalties):
        """vLLM's order on fp32 ``logits``, in place: where the token is in the prompt or the
        output, ``x / r`` if ``x > 0`` else ``x * r``; then ``x -= f * count`` and ``x -= p *
        (count > 0)`` (each product rounded, then the difference)."""
        counts = output_token_counts
        seen = prompt_token_mask | (counts > 0)
        r = repetition_penalties.view(-1, 1).expand_as(logits)
        pen = torch.where(logits > 0, logits / r, logits * r)
        logits.copy_(torch.where(seen, pen, logits))
        logits -= frequency_penalties.view(-1, 1) * counts.to(torch.float32)
        logits -= presence_penalties.view(-1, 1) * (counts > 0).to(torch.float32)
        return logits

    @staticmethod
    def chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, seed, offset):
        """loomnb's NumPy oracle on host copies, the outputs back on the device (not inside a
        CUDA graph, as :meth:`top_k_top_p_sampling_from_logits`)."""
        if target_probs.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the torch backends sample through loomnb's NumPy oracle on the "
                               "host, which a CUDA graph cannot hold; decode without CUDA "
                               "graphs")
        from loomnb import oracle

        def h(t):
            return None if t is None else t.detach().cpu().numpy()

        outs = oracle.chain_speculative_sampling(h(draft_probs), h(draft_token_ids),
                                                 h(target_probs), seed=h(seed), offset=h(offset))
        return tuple(torch.from_numpy(np.ascontiguousarray(o)).to(target_probs.device)
                     for o in outs)

    @staticmethod
    def top_k_top_p_sampling_from_logits(logits, top_k, top_p, temperature, min_p, seed, offset):
        """loomnb's NumPy oracle on host copies (the definition of the draw), the ids back on
        ``logits``' device. Raises ``RuntimeError`` inside a CUDA graph capture."""
        if logits.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the torch backends sample through loomnb's NumPy oracle on the "
                               "host, which a CUDA graph cannot hold; decode without CUDA "
                               "graphs")
        from loomnb import oracle

        ids = oracle.top_k_top_p_sampling_from_logits(
            _to_numpy(logits.detach().cpu()), top_k, top_p, temperature=temperature,
            min_p=min_p, seed=seed.cpu().numpy(), offset=offset.cpu().numpy())
        return torch.from_numpy(np.ascontiguousarray(ids)).to(logits.device)

    @staticmethod
    def top_k_top_p_mask_logits(logits, top_k, top_p, temperature, min_p):
        """loomnb's NumPy oracle on host copies (the kept set is the draw's), the result back
        on ``logits``' device. Raises ``RuntimeError`` inside a CUDA graph capture."""
        if logits.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the torch backends mask through loomnb's NumPy oracle on the "
                               "host, which a CUDA graph cannot hold; decode without CUDA "
                               "graphs")
        from loomnb import oracle

        y = oracle.top_k_top_p_mask_logits(_to_numpy(logits.detach().cpu()), top_k, top_p,
                                           temperature=temperature, min_p=min_p)
        return torch.from_numpy(np.ascontiguousarray(y)).to(logits.device)

    @staticmethod
    def copy_blocks(key_caches, value_caches, block_mapping):
        """``kc[dst] = kc[src]`` and ``vc[dst] = vc[src]`` for every layer's caches and all
        rows ``(src, dst)`` of ``block_mapping`` (int64 ``[num_pairs, 2]``) at once (torch
        index copies, no host sync). Mutates: ``key_caches``, ``value_caches``. Raises
        ``TypeError`` for another index dtype, ``ValueError`` for another shape."""
        if block_mapping.dtype != torch.int64:
            raise TypeError(f"block_mapping must be int64; got {block_mapping.dtype}")
        if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
            raise ValueError(f"block_mapping must be [num_pairs, 2]; got "
                             f"{list(block_mapping.shape)}")
        src, dst = block_mapping[:, 0], block_mapping[:, 1]
        for kc, vc in zip(key_caches, value_caches, strict=True):
            kc[dst] = kc[src]
            vc[dst] = vc[src]


class TorchOps(TorchReferenceOps):
    """The loop as a research codebase would write it in torch, fp32 where it computes: RoPE
    in fp32, attention as fp32 einsum + softmax, ``F.silu(g) * u`` -- the speed baseline of
    ``benchmarks/bench_decode.py`` (the torch reference's float64 attention and emulated FMAs
    are a specification, not a fair baseline). Its tokens may differ from the reference's at
    near-ties of bf16 logits."""

    name = "torch"

    @staticmethod
    def rotary_embedding_and_cache(positions, query, key, value, key_cache, value_cache,
                                   slot_mapping, head_size, cos_sin_cache, is_neox,
                                   kv_cache_dtype="auto", k_scale=None, v_scale=None):
        _rope_and_cache(lambda x, y, cos, sin: (x * cos - y * sin, x * sin + y * cos),
                        torch.Tensor.float, positions, query, key, value, key_cache, value_cache,
                        slot_mapping, head_size, cos_sin_cache, is_neox, kv_cache_dtype, k_scale,
                        v_scale)

    @staticmethod
    def paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, *,
                               kv_cache_dtype="auto", k_scale=None, v_scale=None):
        return paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                               (seq_lens - 1).to(torch.long), scale, k_scale=k_scale,
                               v_scale=v_scale)

    @staticmethod
    def silu_and_mul(x):
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """Zero-copy NumPy view of a CPU tensor, strides kept (bf16 as ``ml_dtypes.bfloat16``)."""
    if t.device.type != "cpu":
        raise ValueError("loomnb-cpu backend needs CPU tensors")
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _scale_numpy(t):
    return None if t is None else _to_numpy(t)


def _to_torch(a: np.ndarray) -> torch.Tensor:
    """Zero-copy torch view of a NumPy array (``ml_dtypes.bfloat16`` -> ``torch.bfloat16``)."""
    a = np.ascontiguousarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


class _LoomnbOps:
    """What the two loomnb backends share: each op calls the function of the same name in
    ``self.m`` (``loomnb`` or ``loomnb.oracle``, which mirror each other), its tensors passed
    through ``_array`` (optional scales through ``_scale``) and its result back through
    ``_tensor``; identities here, NumPy views for the oracles."""

    loomnb_ops = LOOMNB_OPS

    @staticmethod
    def _array(t):
        return t

    _scale = _tensor = _array

    def rms_norm(self, x, weight, eps):
        return self._tensor(self.m.rms_norm(self._array(x), self._array(weight), eps))

    def fused_add_rms_norm(self, x, residual, weight, eps):
        self.m.fused_add_rms_norm(self._array(x), self._array(residual), self._array(weight), eps)
        return x, residual

    def paged_decode_attention(self, query, key_cache, value_cache, block_tables, seq_lens,
                               scale, *, kv_cache_dtype="auto", k_scale=None, v_scale=None):
        a = self._array
        out = self.m.paged_decode_attention(a(query), a(key_cache), a(value_cache),
                                            a(block_tables), a(seq_lens), scale,
                                            kv_cache_dtype=kv_cache_dtype,
                                            k_scale=self._scale(k_scale),
                                            v_scale=self._scale(v_scale))
        return self._tensor(out).view(query.shape[0], -1)  # contiguous: a fresh tensor

    def silu_and_mul(self, x):
        return self._tensor(self.m.silu_and_mul(self._array(x)))

    def apply_penalties_(self, logits, prompt_token_mask, output_token_counts,
                         repetition_penalties, frequency_penalties, presence_penalties):
        a = self._array
        self.m.apply_penalties_(a(logits), a(prompt_token_mask), a(output_token_counts),
                                a(repetition_penalties), a(frequency_penalties),
                                a(presence_penalties))
        return logits

    def top_k_top_p_sampling_from_logits(self, logits, top_k, top_p, temperature, min_p, seed,
                                         offset):
        a = self._array
        return self._tensor(self.m.top_k_top_p_sampling_from_logits(
            a(logits), top_k, top_p, temperature=temperature, min_p=min_p, seed=a(seed),
            offset=a(offset)))

    def top_k_top_p_mask_logits(self, logits, top_k, top_p, temperature, min_p):
        return self._tensor(self.m.top_k_top_p_mask_logits(
            self._array(logits), top_k, top_p, temperature=temperature, min_p=min_p))

    def selected_token_logprob_rank(self, logits, token_ids):
        lp, rank = self.m.selected_token_logprob_rank(self._array(logits),
                                                      self._array(token_ids))
        return self._tensor(lp), self._tensor(rank)

    def chain_speculative_sampling(self, draft_probs, draft_token_ids, target_probs, seed,
                                   offset):
        a = self._array
        outs = self.m.chain_speculative_sampling(
            None if draft_probs is None else a(draft_probs), a(draft_token_ids),
            a(target_probs), seed=a(seed), offset=a(offset))
        return tuple(self._tensor(o) for o in outs)

    def copy_blocks(self, key_caches, value_caches, block_mapping):
        """``loomnb.copy_blocks`` / ``loomnb.oracle.copy_blocks`` on every layer's caches in
        one call (mutates them; the oracle through zero-copy NumPy views)."""
        a = self._array
        self.m.copy_blocks([a(k) for k in key_caches], [a(v) for v in value_caches],
                           a(block_mapping))


class LoomnbCpuOps(_LoomnbOps):
    """The loomnb NumPy oracles (``loomnb.oracle``) on zero-copy views of CPU tensors."""

    name = "loomnb-cpu"
    _array, _scale = staticmethod(_to_numpy), staticmethod(_scale_numpy)
    _tensor = staticmethod(_to_torch)

    def __init__(self):
        from loomnb import oracle  # lazy: the package core may be absent at import time

        self.m = oracle

    def rotary_embedding_and_cache(self, positions, query, key, value, key_cache, value_cache,
                                   slot_mapping, head_size, cos_sin_cache, is_neox,
                                   kv_cache_dtype="auto", k_scale=None, v_scale=None):
        self.m.rotary_embedding_and_cache(
            _to_numpy(positions), _to_numpy(query), _to_numpy(key), _to_numpy(value),
            _to_numpy(key_cache), _to_numpy(value_cache), _to_numpy(slot_mapping), head_size,
            _to_numpy(cos_sin_cache), is_neox, kv_cache_dtype, _scale_numpy(k_scale),
            _scale_numpy(v_scale))

    def greedy_sample_logprob(self, logits):
        ids, lp, rank = self.m.greedy_sample_logprob(_to_numpy(logits))
        return _to_torch(ids), _to_torch(lp), _to_torch(rank)


class LoomnbCudaOps(_LoomnbOps):
    """The loomnb Numba-CUDA kernels on torch CUDA tensors."""

    name = "loomnb-cuda"

    def __init__(self):
        import loomnb  # lazy, see LoomnbCpuOps

        self.m = loomnb

    def rotary_embedding_and_cache(self, positions, query, key, value, key_cache, value_cache,
                                   slot_mapping, head_size, cos_sin_cache, is_neox,
                                   kv_cache_dtype="auto", k_scale=None, v_scale=None):
        if cos_sin_cache.dtype == torch.float32:  # the fused op takes a cache of the query dtype
            self.m.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
            self.m.reshape_and_cache_flash(key.view(key.shape[0], -1, head_size),
                                           value.view(value.shape[0], -1, head_size), key_cache,
                                           value_cache, slot_mapping, kv_cache_dtype, k_scale,
                                           v_scale)
            return
        self.m.rotary_embedding_and_cache(positions, query, key, value, key_cache, value_cache,
                                          slot_mapping, head_size, cos_sin_cache, is_neox,
                                          kv_cache_dtype, k_scale, v_scale)

    def greedy_sample_logprob(self, logits):
        return self.m.greedy_sample_logprob(logits)


def default_backend(device: torch.device | str) -> str:
    return "loomnb-cuda" if torch.device(device).type == "cuda" else "loomnb-cpu"


def get_backend(name: str | None = None, device: torch.device | str = "cpu"):
    """Instantiate a backend by name (``None``: loomnb-cuda on cuda, loomnb-cpu on cpu)."""
    name = name or default_backend(device)
    if name == "torch-reference":
        return TorchReferenceOps()
    if name == "torch":
        return TorchOps()
    if name == "loomnb-cpu":
        if torch.device(device).type != "cpu":
            raise ValueError("loomnb-cpu runs on CPU tensors; use --device cpu")
        return LoomnbCpuOps()
    if name == "loomnb-cuda":
        if torch.device(device).type != "cuda":
            raise ValueError("loomnb-cuda runs on CUDA tensors; use --device cuda")
        return LoomnbCudaOps()
    raise ValueError(f"unknown backend {name!r}; choose from {BACKENDS}")
