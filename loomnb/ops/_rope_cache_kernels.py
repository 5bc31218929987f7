"""RoPE and paged KV-cache kernels: one kernel factory, specialised by a frozen :class:`RopeCacheSpec`.

One thread block per token. A token's work is a flat list of *items*, one per thread (a block
loops when there are more items than threads), in this order:

1. rotation items (``spec.rope``): query heads, then key heads. Vector layout: 8 rotation pairs
   per item -- NeoX: the 16-byte unit of ``x`` at channel ``off + 8j`` and the unit of ``y`` at
   ``off + e + 8j``; GPT-J: the two units at ``off + 16j`` (word ``k`` of them is pair ``k``,
   ``x`` in the low half); scalar layout: one pair per item. ``e = rot_dim / 2``, ``off =
   rope_dim_offset``. A key item also writes its rotated (rounded) values to the key cache.
2. pass-through items (``spec.out``): the query's and key's channels outside the rotated span,
   copied to ``query_out``/``key_out`` (the rotation items write there too; in place, the
   output arrays are the inputs and there are no such items).
3. key copy items (``spec.cache``, slot >= 0): the key channels outside the rotated span (all of
   them without ``rope``), straight to the key cache.
4. value items (``spec.cache``, slot >= 0): the value head, to the value cache.

Rotation (fp32, ``c``/``s`` the cache's cos/sin, ``s`` negated for ``inverse``), each output
rounded once to the activation dtype. Which products are fused into an FMA is ``spec.form``,
two letters for the two outputs (all with explicit rounding instructions, so ``ptxas`` cannot
contract anything else):

* ``x' =``  ``a``: ``fma(x, c, -r32(y*s))``, ``b``: ``fma(-y, s, r32(x*c))``,
  ``n``: ``r32(r32(x*c) - r32(y*s))``
* ``y' =``  ``d``: ``fma(y, c, r32(x*s))``, ``e``: ``fma(x, s, r32(y*c))``,
  ``n``: ``r32(r32(y*c) + r32(x*s))``

``FORMS`` maps the public ``fma`` option to them: ``"vllm"`` is ``ae`` on both paths -- what
vLLM 0.24's compiled ``rotary_embedding`` computes, measured byte for byte on the H200 (a SASS
reading of a copy of its source had suggested ``ad`` on the ``inverse`` path; vLLM's binary
matched only ``ae`` there, bf16 data with an fp32 cache); ``"none"`` contracts nothing.

Cache writes: ``"auto"`` stores the activation bits (rotated values as rounded; copied
channels bit for bit, NaN payloads included); FP8 stores ``e4m3(f(v) / scale)`` or
``e5m2(...)`` -- an IEEE division, saturating round to nearest even, NaN kept (0x7F), the sign
of zero kept -- with ``scale = k_scale[h]`` / ``v_scale[h]`` (a stride-0 view for one scale).

Layouts: ``"vector"`` moves 16-byte units (rows as uint32 words; bf16/fp16; FP8 caches take
8-byte stores), ``"scalar"`` one element at a time (any dtype, size and alignment). Key
caches are ``[num_blocks, block_size, num_kv_heads, head_size]`` views (``cache="flash"``) or
the x-packed legacy key seen as ``[num_blocks, block_size, num_kv_heads, head_size // x, x]``
(``"legacy"``, ``x = 16 // cache element size``); value caches are 4-D ``[num_blocks,
block_size, num_kv_heads, head_size]`` views in both (the legacy value has a head_size stride
of block_size, so the vector layout stores it element by element).

Parameters (one signature per spec; an unused array is empty): ``positions [T]`` int64,
``query [T, Hq, D]``, ``key [T, Hk, D]``, ``query_out``, ``key_out`` (the same arrays as query
and key unless ``spec.out``), ``value [T, Hk, D]``, ``cos_sin_cache [P, rot_dim]``,
``slot_mapping [T']`` int64, ``key_cache``, ``value_cache``, ``k_scale [Hk]``, ``v_scale [Hk]``
fp32, then ``num_cache_tokens`` (T'), ``rope_dim_offset``, ``e`` (rot_dim / 2), ``head_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int64

from .._dtypes import storage_dtype
from .._numba_internals import SIM, device
from ..layouts.dtypes import bits_f32
from . import _launch as L
from ._fp8 import kv_encoder, kv_packer
from ._vector import CODECS, load_u32x4, store_u32x2, store_u32x4

KINDS = ("bf16", "f16", "f32")
CACHES = ("none", "flash", "legacy")
KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
FMAS = ("vllm", "none")
FORMS = {("vllm", False): "ae", ("vllm", True): "ae", ("none", False): "nn", ("none", True): "nn"}
X_FORMS, Y_FORMS = "abn", "den"
CS_KINDS = {"bf16": ("bf16", "f32"), "f16": ("f16", "f32"), "f32": ("f32",)}  # rotary_embedding
UNIT = 8  # elements per vector unit (16 bytes of bf16/fp16, 8 bytes of FP8)

if SIM:
    from ..oracle.numerics import fma_f32

    @device
    def mul_rn(a, b):
        return np.float32(np.float32(a) * np.float32(b))

    @device
    def add_rn(a, b):
        return np.float32(np.float32(a) + np.float32(b))

    @device
    def sub_rn(a, b):
        return np.float32(np.float32(a) - np.float32(b))

    @device
    def fma_rn(a, b, c):
        return np.float32(fma_f32(a, b, c))
else:
    from numba.cuda import libdevice

    @device
    def mul_rn(a, b):
        """``mul.rn.f32``: an explicit rounding mode, so ptxas never fuses it into an FMA."""
        return libdevice.fmul_rn(a, b)

    @device
    def add_rn(a, b):
        return libdevice.fadd_rn(a, b)

    @device
    def sub_rn(a, b):
        return libdevice.fsub_rn(a, b)

    @device
    def fma_rn(a, b, c):
        return libdevice.fmaf_rn(a, b, c)


@dataclass(frozen=True)
class RopeCacheSpec:
    kind: str                 # activation dtype of query/key/value: KINDS
    cs_kind: str = "bf16"     # cos_sin_cache dtype (ignored without rope)
    rope: bool = True         # rotate query/key in place
    neox: bool = True         # NeoX (i, i + e) pairs, else GPT-J (2i, 2i + 1)
    inverse: bool = False     # negate sin
    form: str = "ae"          # which products are fused (module docstring)
    cache: str = "none"       # CACHES: no cache write, flash views, legacy x-packed key
    kv: str = "auto"          # KV_DTYPES
    layout: str = "scalar"    # "scalar", or "vector" (16-byte units; chosen by the op)
    out: bool = False         # write the rotated heads to query_out/key_out, not in place

    def __post_init__(self):
        assert self.kind in KINDS and self.cache in CACHES and self.kv in KV_DTYPES
        assert self.rope or self.cache != "none"
        assert len(self.form) == 2 and self.form[0] in X_FORMS and self.form[1] in Y_FORMS
        assert self.layout in ("vector", "scalar")
        assert not (self.layout == "vector" and self.kind == "f32")
        assert not self.out or (self.rope and self.cache == "none")

    @property
    def cache_itemsize(self):
        return 1 if self.kv != "auto" else (4 if self.kind == "f32" else 2)

    @property
    def x(self):
        """Elements of a legacy key chunk (vLLM's ``x = 16 // element_size``)."""
        return 16 // self.cache_itemsize


def argtypes(spec):
    """The numba signature of ``rope_cache_kernel(spec)``'s parameters."""
    vec = spec.layout == "vector"
    act = "uint32" if vec else storage_dtype(spec.kind)
    cs = "uint32" if vec else storage_dtype(spec.cs_kind)
    cstore = "uint8" if spec.kv != "auto" else storage_dtype(spec.kind)
    kc = "uint32" if vec else cstore
    vc = "uint32" if vec and spec.cache != "legacy" else cstore
    kdim = 5 if spec.cache == "legacy" else 4
    a = L.array_type
    return (a("int64", 1), a(act, 3), a(act, 3), a(act, 3), a(act, 3), a(act, 3), a(cs, 2),
            a("int64", 1),
            a(kc, kdim), a(vc, 4), a("float32", 1), a("float32", 1),
            L.i64(0).numba_type, L.i64(0).numba_type, L.i64(0).numba_type, L.i64(0).numba_type)


def _rotation(form, inverse):
    """``rot(x, y, c, s) -> (x', y')`` in float32 for ``form`` (module docstring)."""
    xf, yf = form

    @device
    def rot(x, y, c, s):
        if inverse:
            s = -s
        if xf == "a":
            xo = fma_rn(x, c, -mul_rn(y, s))
        elif xf == "b":
            xo = fma_rn(-y, s, mul_rn(x, c))
        else:
            xo = sub_rn(mul_rn(x, c), mul_rn(y, s))
        if yf == "d":
            yo = fma_rn(y, c, mul_rn(x, s))
        elif yf == "e":
            yo = fma_rn(x, s, mul_rn(y, c))
        else:
            yo = add_rn(mul_rn(y, c), mul_rn(x, s))
        return xo, yo

    return rot


@device
def rotation_item(i, nq, per_head):
    """``(is_key, head, j)`` of rotation item ``i``: the ``nq`` query items come first, then the
    key's, ``per_head`` items a head (``j``: the pair, or the 8-pair item, within the head)."""
    is_k = i >= nq
    ii = i - nq if is_k else i
    h = ii // per_head
    return is_k, h, ii - h * per_head


@device
def outside_span(ii, n, step, off, gap):
    """``(head, channel)`` of item ``ii`` of ``n`` items per head that skip the rotated span:
    item ``u`` of a head is channel ``step * u``, moved past ``[off, off + gap)``."""
    h = ii // n
    c = (ii - h * n) * step
    if c >= off:
        c += gap
    return h, c


def _token_work(spec):
    """``work(t, positions, q, k, v, slots, kc, n_cache, rot, span, head) -> (Hq, write, nq,
    nrot, kcopy, ncp, nkc, total, blk, boff, pos)``: token ``t``'s list of items (the module
    docstring) -- where each kind of item starts, how many there are, and the cache slot
    (``write``: slot >= 0, as block ``blk`` and offset ``boff``) and position it needs -- counted
    in the layout's step: ``rot`` rotation items, ``span`` rotated steps and ``head`` steps per
    head (scalar: ``e``, ``2e`` and ``D`` channels; vector: ``e/8``, ``e/4`` and ``D/8`` units)."""
    ROPE, OUT, CACHE = spec.rope, spec.out, spec.cache != "none"

    @device
    def work(t, positions, q, k, v, slots, kc, n_cache, rot, span, head):
        Hq = int64(q.shape[1])
        Hk = int64(k.shape[1]) if ROPE else int64(v.shape[1])
        slot = int64(-1)
        if CACHE and t < n_cache:
            slot = slots[t]
        write = CACHE and slot >= 0
        nq = Hq * rot if ROPE else int64(0)
        nrot = (Hq + Hk) * rot if ROPE else int64(0)
        kcopy = head - span if ROPE else head
        ncp = (Hq + Hk) * kcopy if OUT else int64(0)
        nkc = Hk * kcopy if write else int64(0)
        nvc = Hk * head if write else int64(0)
        total = nrot + ncp + nkc + nvc
        blk = int64(0)
        boff = int64(0)
        if write:
            bs = int64(kc.shape[1])
            blk = slot // bs
            boff = slot - blk * bs
        pos = int64(0)
        if ROPE:
            pos = positions[t]
        return Hq, write, nq, nrot, kcopy, ncp, nkc, total, blk, boff, pos

    return work


def rope_cache_kernel(spec):
    """The ``@cuda.jit`` function for ``spec`` (see the module docstring)."""
    return (_vector if spec.layout == "vector" else _scalar)(spec)


rope_cache_kernel.__name__ = "rope_cache_kernel"


def _name(spec):
    return (f"rope_cache_{spec.kind}_{spec.cs_kind if spec.rope else 'nocs'}_"
            f"{'neox' if spec.neox else 'gptj'}_{'inv' if spec.inverse else 'fwd'}_{spec.form}_"
            f"{'rope' if spec.rope else 'norope'}_{spec.cache}_{spec.kv}_{spec.layout}"
            f"{'_out' if spec.out else ''}")


# ------------------------------------------------------------------------------------ scalar
def _scalar(spec):
    codec = CODECS[spec.kind]
    dec, enc_act = codec.decode, codec.encode
    dec_cs = CODECS[spec.cs_kind].decode
    rot = _rotation(spec.form, spec.inverse)
    work = _token_work(spec)
    ROPE, NEOX, LEGACY = spec.rope, spec.neox, spec.cache == "legacy"
    FP8 = spec.kv != "auto"
    fp8 = kv_encoder(spec.kv) if FP8 else None
    XS = spec.x.bit_length() - 1  # log2 of the legacy chunk
    XM = spec.x - 1

    @device
    def put_key(kc, blk, boff, h, d, code):
        if LEGACY:
            kc[blk, boff, h, d >> XS, d & XM] = code
        else:
            kc[blk, boff, h, d] = code

    @device
    def cache_code(v, scale):
        """The cache element of the (rounded) float ``v``."""
        if FP8:
            return fp8(v, scale)
        return enc_act(v)

    def kernel(positions, q, k, qo, ko, v, cs, slots, kc, vc, ks, vs, n_cache, off, e, D):
        t = int64(cuda.blockIdx.x)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        Hq, write, nq, nrot, kcopy, ncp, nkc, total, blk, boff, pos = work(
            t, positions, q, k, v, slots, kc, n_cache, e, 2 * e, D)  # one pair an item
        for i in range(tid, total, nt):
            if i < nrot:
                is_k, h, p = rotation_item(i, nq, e)
                row = k[t, h] if is_k else q[t, h]
                if NEOX:
                    cx = off + p
                    cy = cx + e
                else:
                    cx = off + 2 * p
                    cy = cx + 1
                c = dec_cs(cs[pos, p])
                s = dec_cs(cs[pos, e + p])
                xo, yo = rot(dec(row[cx]), dec(row[cy]), c, s)
                bx = enc_act(xo)
                by = enc_act(yo)
                orow = ko[t, h] if is_k else qo[t, h]
                orow[cx] = bx
                orow[cy] = by
                if is_k and write:
                    sc = ks[h] if FP8 else float32(1)
                    put_key(kc, blk, boff, h, cx, cache_code(dec(bx), sc))
                    put_key(kc, blk, boff, h, cy, cache_code(dec(by), sc))
            elif i < nrot + ncp:  # out of place: the channels outside the rotated span
                h, d = outside_span(i - nrot, kcopy, 1, off, 2 * e)
                if h < Hq:
                    qo[t, h, d] = q[t, h, d]
                else:
                    ko[t, h - Hq, d] = k[t, h - Hq, d]
            elif i < nrot + ncp + nkc:
                h, d = outside_span(i - nrot - ncp, kcopy, 1, off, 2 * e if ROPE else 0)
                if FP8:
                    put_key(kc, blk, boff, h, d, fp8(dec(k[t, h, d]), ks[h]))
                else:
                    put_key(kc, blk, boff, h, d, k[t, h, d])
            else:
                ii = i - nrot - ncp - nkc
                h = ii // D
                d = ii - h * D
                if FP8:
                    vc[blk, boff, h, d] = fp8(dec(v[t, h, d]), vs[h])
                else:
                    vc[blk, boff, h, d] = v[t, h, d]

    kernel.__name__ = _name(spec)
    return kernel


# ------------------------------------------------------------------------------------ vector
def _vector(spec):
    codec = CODECS[spec.kind]
    unpack, pack, rnd = codec.unpack, codec.pack, codec.rnd
    enc_act = codec.encode
    CS16 = spec.cs_kind in ("bf16", "f16")
    cs_unpack = CODECS[spec.cs_kind].unpack if CS16 else None
    rot = _rotation(spec.form, spec.inverse)
    work = _token_work(spec)
    ROPE, NEOX, LEGACY = spec.rope, spec.neox, spec.cache == "legacy"
    FP8 = spec.kv != "auto"
    fp8 = kv_encoder(spec.kv) if FP8 else None
    fp8_words = kv_packer(spec.kv) if FP8 else None
    XS = spec.x.bit_length() - 1
    XM = spec.x - 1

    @device
    def load_unit(vals, b, row, c):
        """Decode the 8 activation values at channel ``c`` of ``row`` (words) into vals[b:b+8]."""
        w = load_u32x4(row, c >> 1)
        for m in range(4):
            lo, hi = unpack(w[m])
            vals[b + 2 * m] = lo
            vals[b + 2 * m + 1] = hi

    @device
    def load_cs(vals, row, c):
        """8 cos or sin values at element ``c`` of a cos_sin_cache row (words)."""
        if CS16:
            w = load_u32x4(row, c >> 1)
            for m in range(4):
                lo, hi = cs_unpack(w[m])
                vals[2 * m] = lo
                vals[2 * m + 1] = hi
        else:
            w0 = load_u32x4(row, c)
            w1 = load_u32x4(row, c + 4)
            for m in range(4):
                vals[m] = bits_f32(w0[m])
                vals[4 + m] = bits_f32(w1[m])

    @device
    def act_words(vals, b):
        return (pack(vals[b + 1], vals[b]), pack(vals[b + 3], vals[b + 2]),
                pack(vals[b + 5], vals[b + 4]), pack(vals[b + 7], vals[b + 6]))

    @device
    def store_key_words(kc, blk, boff, h, c, words):
        """16 bytes of activation bits at channel ``c`` of the key cache row."""
        if LEGACY:
            store_u32x4(kc[blk, boff, h, c >> XS], 0, words)
        else:
            store_u32x4(kc[blk, boff, h], c >> 1, words)

    @device
    def store_key_fp8(kc, blk, boff, h, c, words):
        """8 FP8 codes (2 words) at channel ``c`` of the key cache row."""
        if LEGACY:
            store_u32x2(kc[blk, boff, h, c >> XS], (c & XM) >> 2, words)
        else:
            store_u32x2(kc[blk, boff, h], c >> 2, words)

    @device
    def cache_key_unit(kc, blk, boff, h, c, vals, b, scale):
        if FP8:
            store_key_fp8(kc, blk, boff, h, c, fp8_words(vals, b, scale))
        else:
            store_key_words(kc, blk, boff, h, c, act_words(vals, b))

    def kernel(positions, q, k, qo, ko, v, cs, slots, kc, vc, ks, vs, n_cache, off, e, D):
        t = int64(cuda.blockIdx.x)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        U = D >> 3          # units per head
        P = e >> 3          # rotation items per head (8 pairs each)
        R = e >> 2          # rotated units per head (2 per item)
        Hq, write, nq, nrot, kcopy, ncp, nkc, total, blk, boff, pos = work(
            t, positions, q, k, v, slots, kc, n_cache, P, R, U)
        xv = cuda.local.array(16, float32)  # x values, then y values (8 pairs)
        cv = cuda.local.array(8, float32)
        sv = cuda.local.array(8, float32)
        for i in range(tid, total, nt):
            if i < nrot:
                is_k, h, j = rotation_item(i, nq, P)
                row = k[t, h] if is_k else q[t, h]
                orow = ko[t, h] if is_k else qo[t, h]
                csrow = cs[pos]
                if NEOX:
                    cx = off + 8 * j
                    cy = cx + e
                    load_unit(xv, 0, row, cx)
                    load_unit(xv, 8, row, cy)
                else:
                    cx = off + 16 * j
                    cy = cx + 8
                    w0 = load_u32x4(row, cx >> 1)
                    w1 = load_u32x4(row, cy >> 1)
                    for m in range(4):
                        lo, hi = unpack(w0[m])
                        xv[m] = lo
                        xv[8 + m] = hi
                        lo, hi = unpack(w1[m])
                        xv[4 + m] = lo
                        xv[12 + m] = hi
                load_cs(cv, csrow, 8 * j)
                load_cs(sv, csrow, e + 8 * j)
                for m in range(8):
                    xo, yo = rot(xv[m], xv[8 + m], cv[m], sv[m])
                    xv[m] = rnd(xo)
                    xv[8 + m] = rnd(yo)
                if NEOX:
                    store_u32x4(orow, cx >> 1, act_words(xv, 0))
                    store_u32x4(orow, cy >> 1, act_words(xv, 8))
                else:  # back to memory order: pair m = (x, y) in one word
                    for m in range(8):
                        cv[m] = xv[m]
                        sv[m] = xv[8 + m]
                    for m in range(4):
                        xv[2 * m] = cv[m]
                        xv[2 * m + 1] = sv[m]
                        xv[8 + 2 * m] = cv[4 + m]
                        xv[8 + 2 * m + 1] = sv[4 + m]
                    store_u32x4(orow, cx >> 1, act_words(xv, 0))
                    store_u32x4(orow, cy >> 1, act_words(xv, 8))
                if is_k and write:
                    sc = ks[h] if FP8 else float32(1)
                    cache_key_unit(kc, blk, boff, h, cx, xv, 0, sc)
                    cache_key_unit(kc, blk, boff, h, cy, xv, 8, sc)
            elif i < nrot + ncp:  # out of place: the units outside the rotated span
                h, c = outside_span(i - nrot, kcopy, 8, off, 2 * e)
                if h < Hq:
                    store_u32x4(qo[t, h], c >> 1, load_u32x4(q[t, h], c >> 1))
                else:
                    store_u32x4(ko[t, h - Hq], c >> 1, load_u32x4(k[t, h - Hq], c >> 1))
            elif i < nrot + ncp + nkc:
                h, c = outside_span(i - nrot - ncp, kcopy, 8, off, 2 * e if ROPE else 0)
                row = k[t, h]
                if FP8:
                    load_unit(xv, 0, row, c)
                    store_key_fp8(kc, blk, boff, h, c, fp8_words(xv, 0, ks[h]))
                else:
                    store_key_words(kc, blk, boff, h, c, load_u32x4(row, c >> 1))
            else:
                ii = i - nrot - ncp - nkc
                h = ii // U
                u = ii - h * U
                c = u * 8
                row = v[t, h]
                if LEGACY:  # value [.., d, offset]: one element at a time
                    load_unit(xv, 0, row, c)
                    for m in range(8):
                        if FP8:
                            vc[blk, boff, h, c + m] = fp8(xv[m], vs[h])
                        else:
                            vc[blk, boff, h, c + m] = enc_act(xv[m])
                elif FP8:
                    load_unit(xv, 0, row, c)
                    store_u32x2(vc[blk, boff, h], c >> 2, fp8_words(xv, 0, vs[h]))
                else:
                    store_u32x4(vc[blk, boff, h], c >> 1, load_u32x4(row, c >> 1))

    kernel.__name__ = _name(spec)
    return kernel


# ------------------------------------------------------------------------------------ variants
def layouts_of(kind):
    return ("vector", "scalar") if kind != "f32" else ("scalar",)


def variants():
    """Every ``(factory, spec, argtypes)`` the family's ops can launch (the PTX test compiles
    them all): ``rotary_embedding`` (every dtype pair, pairing, ``fma`` and ``inverse``), its
    out-of-place form ``apply_rope_with_cos_sin_cache`` (every dtype pair and pairing),
    ``reshape_and_cache[_flash]`` (every dtype, cache layout and kv_cache_dtype) and the fused
    op (cos_sin_cache of the query's dtype, ``fma="vllm"``, no ``inverse``)."""
    specs = []
    for kind in KINDS:
        for layout in layouts_of(kind):
            for cs in CS_KINDS[kind]:
                for neox in (True, False):
                    for (fma, inverse), form in FORMS.items():
                        specs.append(RopeCacheSpec(kind, cs, True, neox, inverse, form, "none",
                                                   "auto", layout))
                    specs.append(RopeCacheSpec(kind, cs, True, neox, False, FORMS[("vllm", False)],
                                               "none", "auto", layout, out=True))
            for cache in ("flash", "legacy"):
                for kv in KV_DTYPES:
                    specs.append(RopeCacheSpec(kind, kind, False, True, False, "nn", cache, kv,
                                               layout))
                    for neox in (True, False):
                        specs.append(RopeCacheSpec(kind, kind, True, neox, False,
                                                   FORMS[("vllm", False)], cache, kv, layout))
    return [(rope_cache_kernel, s, argtypes(s)) for s in specs]
