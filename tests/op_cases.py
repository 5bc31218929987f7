"""Every public op as a generated call: one registry that the zero-size sweep
(``tests/test_zero_size.py``), the property tests (``tests/test_fuzz.py``) and the no-recompile
check iterate, so a new op is covered by all three once it has an entry here (and
``test_every_op_has_a_case`` fails until it has one).

A case is built in NumPy (``build(Draws(seed), dims, kind, special)`` -> ``(args, kwargs)``) and moved to
torch for the GPU (:func:`to_device`, strides and views kept). ``dims`` are the op's named sizes
(vLLM's vocabulary: ``num_tokens``, ``hidden_size``, ``num_heads``, ``head_size``, ``vocab_size``,
``num_blocks``...); ``zero`` lists those a call may have at 0; ``ranges`` those the property
tests draw. ``special`` puts NaN, +-inf, -0.0 and subnormals among the float inputs' values;
``wide`` (a dim, 0 or 1) makes row inputs views of a wider buffer (row stride > row length).
``compare(got, want, kind, what, mode, inputs)`` compares the op's results (outputs and
mutated arguments) with the oracle's (``inputs``: the call's arguments before it ran): bit for bit where the math is elementwise, else under the rows of
``tests/tolerances.py`` (``mode`` "sim" or "gpu": the simulator runs the oracle's math, the GPU
libdevice's).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from loomnb.layouts import paged_kv as pk

from family import assert_bits, bits
from helpers import assert_fp8_codes, assert_ulps
from tolerances import ulps

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
DT = {"bf16": BF16, "f16": np.float16, "f32": np.float32}
ACT = ("bf16", "f16", "f32")


@dataclasses.dataclass
class OpCase:
    name: str
    family: str
    build: object
    dims: dict
    zero: tuple = ()
    ranges: dict = dataclasses.field(default_factory=dict)
    kinds: tuple = ACT
    compare: object = None
    specials: bool = True      # NaN/inf/-0/subnormal inputs are part of the contract
    recompile_dim: object = ""  # the dims a serving loop grows (batch, context): no new compile


CASES = {}


class Draws:
    """The random source a case builder draws from: every draw of values (a call with a size)
    from one stream, every option (a scalar draw: a layout, a flag, a scale) from another, both
    from ``seed`` -- so one seed gives the same options at every size (the no-recompile tests
    grow one dimension with the rest of the call fixed) and other values."""

    SIZE_ARG = {"random": 0, "standard_normal": 0, "choice": 1, "integers": 2, "uniform": 2}

    def __init__(self, seed):
        self._data = np.random.default_rng(seed)
        self._opts = np.random.default_rng([seed, 1])

    def __getattr__(self, name):
        data, opts, at = getattr(self._data, name), getattr(self._opts, name), self.SIZE_ARG.get(name)

        def draw(*args, **kwargs):
            sized = at is None or len(args) > at or "size" in kwargs
            return (data if sized else opts)(*args, **kwargs)
        return draw


def case(name, family, dims, *, zero=(), ranges=None, kinds=ACT, compare=None, specials=True,
         recompile_dim=""):
    def deco(build):
        CASES[name] = OpCase(name, family, build, dict(dims), tuple(zero), dict(ranges or {}),
                             tuple(kinds), compare or compare_bits, specials, recompile_dim)
        return build
    return deco


# ---------------------------------------------------------------- values
SPECIALS = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-41, -3e-39, 6e-8, 65504.0, -1e30],
                    np.float64)


def values(rng, shape, kind, special, scale=1.0):
    """Random values of ``kind``; with ``special``, about one in eight replaced by NaN, +-inf,
    -0.0, float32 subnormals, a half's largest finite, a value past half's range."""
    v = rng.standard_normal(shape) * scale
    if special and v.size:
        mask = rng.random(shape) < 0.125
        v = np.where(mask, rng.choice(SPECIALS, shape), v)
    with np.errstate(over="ignore"):
        return v.astype(np.float32).astype(DT[kind]) if kind in DT else v


def rows_of(rng, T, H, kind, special, wide, scale=1.0):
    """``[T, H]`` values, as a view of a ``[T, H + pad]`` buffer when ``wide``."""
    pad = int(rng.integers(1, 9)) if wide else 0
    buf = values(rng, (T, H + pad), kind, special, scale)
    return buf[:, pad:] if wide else buf


def f32_scalar(v):
    return np.array([v], np.float32)


# ---------------------------------------------------------------- comparisons
def _leaves(x):
    if isinstance(x, (tuple, list)):
        for e in x:
            yield from _leaves(e)
    elif isinstance(x, np.ndarray):
        yield x


def assert_same(g, w, what):
    """Bit for bit, except that a float32 NaN's payload is not part of the contract (the GPU's
    is 0x7FFFFFFF, NumPy's 0x7FC00000: ``docs/numerics.md``), only its position; 16-bit NaNs
    are the canonical 0x7FFF on both and compared as bits."""
    g, w = np.asarray(g), np.asarray(w)
    if g.dtype == np.float32 and w.dtype == np.float32:
        gn, wn = np.isnan(g), np.isnan(w)
        assert np.array_equal(gn, wn), f"{what}: NaN positions differ"
        g, w = np.where(gn, np.float32(0), g), np.where(wn, np.float32(0), w)
    assert_bits(g, w, what)


def compare_bits(got, want, kind, what, mode, inputs=None):
    for i, (g, w) in enumerate(zip(_leaves(got), _leaves(want))):
        assert_same(g, w, f"{what}: result {i}")


def _is_fp8(a):
    return a.dtype in (np.dtype(E4M3), np.dtype(np.uint8))


def compare_norm(got, want, kind, what, mode, inputs=None):
    """Outputs within the norm family's row (float64 inv: bit-exact but for rows on a rounding
    boundary), FP8 codes one step there, per-token scales one bf16 ulp (2^16 float32 ulps) --
    at most 1e-4 of the elements, so none at the property tests' sizes."""
    for i, (g, w) in enumerate(zip(_leaves(got), _leaves(want))):
        if _is_fp8(g):
            assert_fp8_codes(g, w, ulps("norm_fp8", "fp8"), f"{what}: codes")
        elif g.dtype == np.float32 and g.dtype != np.dtype(DT[kind]):
            assert_ulps(g, w, (1 << 16, 1e-4), f"{what}: scales")
        else:
            assert_ulps(g, w, ulps("norm", kind), f"{what}: result {i}")


GATED_NAMES = ("silu", "gelu", "relu", "swiglu")


def compare_activation(got, want, kind, what, mode, inputs=None):
    """The simulator runs the oracle's math: bit for bit. On the GPU the quantisers (correctly
    rounded division, exact multiplications) and the dequantisation stay bit for bit; the gated
    activations run libdevice's expf/erff/tanhf, within the table's ulps -- and where one feeds
    FP8, its code within a step and its group's scale within one bf16 ulp (2^16 float32 ulps):
    any group's scale may move, since each is its amax over 448 and the amax is an activation
    value (an element a ulp off is the group's amax as often as any other; with two groups one
    moving is half of them)."""
    if mode == "sim" or not any(n in what for n in GATED_NAMES):
        return compare_bits(got, want, kind, what, mode)
    fam = "activation_gelu" if "gelu" in what else "activation"
    for i, (g, w) in enumerate(zip(_leaves(got), _leaves(want))):
        if _is_fp8(g):
            assert_fp8_codes(g, w, ulps("activation_fp8", "fp8"), f"{what}: codes")
        elif i > 0:
            assert_ulps(g, w, (1 << 16, 1.0), f"{what}: scales")
        elif fam == "activation_gelu":
            _assert_gelu(g, w, kind, what)
        else:
            assert_ulps(g, w, ulps(fam, kind), f"{what}: result {i}")


def _assert_gelu(g, w, kind, what):
    """GELU on the GPU: ``1 + erf(g)`` (and ``1 + tanh``) cancels for a gate ``g < -2``, so
    libdevice's erff/tanhf, within 2 ulps of 1 there, leave an absolute error of ~2^-22 in the
    factor -- which the table's ulp row (gates in [-2, 2]) does not cover once the property
    tests draw gates out to +-8 and beyond. So: the ulp row for elements of at least 2^-8 of the
    largest output, an absolute 2^-18 of it (2^-14 for fp16's and bf16's own rounding) for the
    smaller ones, and NaN/inf where the oracle has them."""
    g64, w64 = np.asarray(g).astype(np.float64), np.asarray(w).astype(np.float64)
    assert np.array_equal(np.isnan(g64), np.isnan(w64)), f"{what}: NaN positions differ"
    fin = np.isfinite(w64)
    assert np.array_equal(g64[~fin & ~np.isnan(w64)], w64[~fin & ~np.isnan(w64)]), f"{what}: inf"
    top = float(np.max(np.abs(w64[fin]), initial=0.0))
    small = fin & (np.abs(w64) < 2.0 ** -8 * top)
    atol = (2.0 ** -18 if kind == "f32" else 2.0 ** -14) * top
    assert np.all(np.abs(g64[small] - w64[small]) <= atol), f"{what}: small outputs"
    big = ~small
    assert_ulps(np.where(big, g, 0).astype(g.dtype), np.where(big, w, 0).astype(w.dtype),
                ulps("activation_gelu", kind), f"{what}: outputs")


def compare_sampling(got, want, kind, what, mode, inputs=None):
    for i, (g, w) in enumerate(zip(_leaves(got), _leaves(want))):
        if g.dtype == np.float32 and "min_p" not in what:
            assert_ulps(g, w, ulps("sampling_logprob", "f32"), f"{what}: logprobs")
        else:
            assert_bits(g, w, f"{what}: result {i}")


def compare_attention(got, want, kind, what, mode, inputs=None):
    """Within the attention row of the tolerance table: ``|got - want| <= atol_rel * max|V| +
    one ulp of the dtype`` (the oracle's value is itself rounded), NaN where the oracle has NaN;
    the LSE within ``2^-16 (1 + |lse|)``."""
    out_g, out_w = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
    g, w = np.asarray(out_g).astype(np.float64), np.asarray(out_w).astype(np.float64)
    assert np.array_equal(np.isnan(g), np.isnan(w)), f"{what}: NaN positions differ"
    ok = ~np.isnan(w)
    vmax = max(float(np.max(np.abs(w[ok]), initial=0.0)), 1e-30)
    ulp = {"bf16": 2.0 ** -7, "f16": 2.0 ** -10, "f32": 2.0 ** -23}[kind]
    bound = 2.0 ** -15 * vmax + ulp * np.abs(w[ok]) + 1e-30
    assert np.all(np.abs(g[ok] - w[ok]) <= bound), f"{what}: outside the attention tolerance"
    if isinstance(got, tuple) and len(got) > 1 and got[1] is not None:
        lg, lw = np.asarray(got[1], np.float64), np.asarray(want[1], np.float64)
        fin = np.isfinite(lw)
        assert np.array_equal(lg[~fin], lw[~fin]), f"{what}: non-finite LSE differ"
        assert np.all(np.abs(lg[fin] - lw[fin]) <= 2.0 ** -16 * (1 + np.abs(lw[fin]))), what


# ---------------------------------------------------------------- norm
def _norm_inputs(rng, d, kind, special, wide):
    T, H = d["num_tokens"], d["hidden_size"]
    x = rows_of(rng, T, H, kind, special, wide)
    w = values(rng, (H,), kind, False, 0.2) + np.asarray(1, DT[kind])
    return x, w.astype(DT[kind])


NORM_DIMS = {"num_tokens": 3, "hidden_size": 24, "wide": 0}
NORM_RANGES = {"num_tokens": (1, 4), "hidden_size": (1, 72), "wide": (0, 1)}
NORM = dict(zero=("num_tokens", "hidden_size"), ranges=NORM_RANGES, compare=compare_norm,
            recompile_dim="num_tokens")


@case("rms_norm", "norm", NORM_DIMS, **NORM)
def _(rng, d, kind, special):
    x, w = _norm_inputs(rng, d, kind, special, d["wide"])
    return (x, w, 1e-6), {"rounding": str(rng.choice(["twice", "once"]))}


@case("fused_add_rms_norm", "norm", NORM_DIMS, **NORM)
def _(rng, d, kind, special):
    x, w = _norm_inputs(rng, d, kind, special, d["wide"])
    r = values(rng, x.shape, kind, special)
    return (x, r, w, 1e-6), {"rounding": str(rng.choice(["twice", "once"]))}


def _fp8_scale(rng):
    return f32_scalar(float(rng.choice([0.05, 0.003, 1.7])))


@case("rms_norm_static_fp8_quant", "norm", NORM_DIMS, **NORM)
def _(rng, d, kind, special):
    x, w = _norm_inputs(rng, d, kind, special, d["wide"])
    return (x, w, _fp8_scale(rng), 1e-6), {"rounding": str(rng.choice(["twice", "once"]))}


@case("fused_add_rms_norm_static_fp8_quant", "norm", NORM_DIMS, **NORM)
def _(rng, d, kind, special):
    x, w = _norm_inputs(rng, d, kind, special, d["wide"])
    r = values(rng, x.shape, kind, special)
    return (x, r, w, _fp8_scale(rng), 1e-6), {"rounding": str(rng.choice(["twice", "once"]))}


@case("rms_norm_dynamic_per_token_quant", "norm", NORM_DIMS, **NORM)
def _(rng, d, kind, special):
    x, w = _norm_inputs(rng, d, kind, special, d["wide"])
    ub = f32_scalar(float(rng.choice([0.5, 100.0]))) if rng.random() < 0.5 else None
    res = values(rng, x.shape, kind, special) if rng.random() < 0.5 else None
    return (x, w, 1e-6, ub, res), {}


# ---------------------------------------------------------------- activation
ACT_DIMS = {"num_tokens": 2, "d": 24, "wide": 0}
ACT_RANGES = {"num_tokens": (1, 4), "d": (1, 40), "wide": (0, 1)}
ACTIVATION = dict(zero=("num_tokens", "d"), ranges=ACT_RANGES, compare=compare_activation,
                  recompile_dim="num_tokens")


def _gated(rng, d, kind, special):
    return rows_of(rng, d["num_tokens"], 2 * d["d"], kind, special, d["wide"], 2.0)


for _name in ("silu_and_mul", "mul_and_silu", "gelu_and_mul", "gelu_tanh_and_mul"):
    case(_name, "activation", ACT_DIMS, **ACTIVATION)(
        lambda rng, d, kind, special: ((_gated(rng, d, kind, special),), {}))


@case("fatrelu_and_mul", "activation", ACT_DIMS, **ACTIVATION)
def _(rng, d, kind, special):
    return (_gated(rng, d, kind, special), float(rng.choice([0.0, 0.5, -1.0]))), {}


@case("swigluoai_and_mul", "activation", ACT_DIMS, **ACTIVATION)
def _(rng, d, kind, special):
    return (_gated(rng, d, kind, special), 1.702, float(rng.choice([7.0, 0.5]))), {}


@case("silu_and_mul_quant", "activation", ACT_DIMS, **ACTIVATION)
def _(rng, d, kind, special):
    return (_gated(rng, d, kind, special), _fp8_scale(rng)), {}


QUANT_DIMS = {"num_tokens": 2, "hidden_size": 40, "wide": 0}
QUANT_RANGES = {"num_tokens": (1, 4), "hidden_size": (1, 72), "wide": (0, 1)}
QUANT = dict(zero=("num_tokens", "hidden_size"), ranges=QUANT_RANGES, compare=compare_activation,
             recompile_dim="num_tokens")


def _rows(rng, d, kind, special):
    return rows_of(rng, d["num_tokens"], d["hidden_size"], kind, special, d["wide"], 2.0)


@case("static_scaled_fp8_quant", "activation", QUANT_DIMS, **QUANT)
def _(rng, d, kind, special):
    return (_rows(rng, d, kind, special), _fp8_scale(rng)), {}


@case("dynamic_scaled_fp8_quant", "activation", QUANT_DIMS, **QUANT)
def _(rng, d, kind, special):
    return (_rows(rng, d, kind, special),), {}


@case("dynamic_per_token_scaled_fp8_quant", "activation", QUANT_DIMS, **QUANT)
def _(rng, d, kind, special):
    ub = f32_scalar(float(rng.choice([0.5, 100.0]))) if rng.random() < 0.5 else None
    return (_rows(rng, d, kind, special), ub), {}


GROUP_DIMS = {"num_tokens": 2, "groups": 1, "wide": 0}
GROUP_RANGES = {"num_tokens": (1, 3), "groups": (1, 2), "wide": (0, 1)}
GROUP = dict(zero=("num_tokens", "groups"), ranges=GROUP_RANGES, compare=compare_activation,
             recompile_dim="num_tokens")


def _group_options(rng):
    cm = bool(rng.random() < 0.3)
    return {"eps": float(rng.choice([1e-10, 0.0])), "column_major_scales": cm,
            "tma_aligned_scales": bool(cm and rng.random() < 0.5),
            "use_ue8m0": bool(rng.random() < 0.4)}


for _name in ("per_token_group_quant_fp8", "per_token_group_fp8_quant"):
    @case(_name, "activation", GROUP_DIMS, **GROUP)
    def _(rng, d, kind, special):
        g = int(rng.choice([64, 128]))
        x = rows_of(rng, d["num_tokens"], g * d["groups"], kind, special, d["wide"], 2.0)
        return (x, g), _group_options(rng)


@case("silu_and_mul_per_token_group_quant_fp8", "activation", GROUP_DIMS, **GROUP)
def _(rng, d, kind, special):
    g = int(rng.choice([64, 128]))
    x = rows_of(rng, d["num_tokens"], 2 * g * d["groups"], kind, special, d["wide"], 2.0)
    kw = _group_options(rng)
    kw["numerics"] = "unfused" if kw["use_ue8m0"] or rng.random() < 0.5 else "per_block"
    return (x, g), kw


@case("scaled_fp8_dequant", "activation", QUANT_DIMS, **QUANT)
def _(rng, d, kind, special):
    T, H = d["num_tokens"], d["hidden_size"]
    q = rng.integers(0, 256, (T, H)).astype(np.uint8).view(E4M3)
    form = rng.integers(0, 3)
    scale = (f32_scalar(0.1) if form == 0 else
             (rng.random((T, 1)) + 0.01).astype(np.float32) if form == 1 or H == 0 else
             (rng.random((T, 1 if H % 2 else 2)) + 0.01).astype(np.float32))
    return (q, scale, DT[kind]), {}


# ---------------------------------------------------------------- rope_cache
ROPE_DIMS = {"num_tokens": 3, "num_heads": 2, "num_kv_heads": 1, "head_size": 16,
             "num_blocks": 3, "block_size": 4}
ROPE_RANGES = {"num_tokens": (1, 4), "num_heads": (1, 3), "num_kv_heads": (1, 2),
               "head_size": (1, 3), "num_blocks": (1, 3), "block_size": (1, 4)}
ROPE = dict(ranges=ROPE_RANGES, recompile_dim="num_tokens")
MAX_POS = 16


def _head_size(d):
    """Fuzzed head sizes are 8 * 2**(i-1) ... read ``head_size`` as an index when small."""
    h = d["head_size"]
    return {1: 8, 2: 16, 3: 40}.get(h, h) if h else 0


def _cos_sin(rng, rot_dim, kind):
    inv = 1.0 / 10000.0 ** (np.arange(0, rot_dim, 2, dtype=np.float32) / max(rot_dim, 1))
    f = np.outer(np.arange(MAX_POS, dtype=np.float32), inv).astype(np.float32)
    cs = np.concatenate([np.cos(f), np.sin(f)], axis=-1)
    return cs.astype(DT[kind] if rng.random() < 0.7 else np.float32)


def _qk(rng, d, kind, special):
    T, Hq, Hk, D = d["num_tokens"], d["num_heads"], d["num_kv_heads"], _head_size(d)
    buf = values(rng, (T, (Hq + 2 * Hk) * D), kind, special, 2.0)
    q, k, v = buf[:, :Hq * D], buf[:, Hq * D:(Hq + Hk) * D], buf[:, (Hq + Hk) * D:]
    return buf, q, k, v, D


def _positions(rng, T):
    return rng.integers(0, MAX_POS, T).astype(np.int64)


@case("rotary_embedding", "rope_cache", ROPE_DIMS,
      zero=("num_tokens", "num_heads", "num_kv_heads", "head_size"), **ROPE)
def _(rng, d, kind, special):
    _, q, k, _, D = _qk(rng, d, kind, special)
    rot = D if rng.random() < 0.6 or D < 4 else 2 * int(rng.integers(1, D // 2 + 1))
    off = int(rng.integers(0, D - rot + 1)) if D else 0
    cs = _cos_sin(rng, rot, kind)
    return (_positions(rng, q.shape[0]), q, k, D, cs, bool(rng.random() < 0.5), off,
            bool(rng.random() < 0.3)), {"fma": str(rng.choice(["vllm", "none"]))}


@case("apply_rope_with_cos_sin_cache", "rope_cache", ROPE_DIMS,
      zero=("num_tokens", "num_heads", "num_kv_heads", "head_size"), **ROPE)
def _(rng, d, kind, special):
    _, q, k, _, D = _qk(rng, d, kind, special)
    rot = D if rng.random() < 0.6 or D < 4 else 2 * int(rng.integers(1, D // 2 + 1))
    cs = _cos_sin(rng, rot, kind)
    return (_positions(rng, q.shape[0]), q, k, D, cs, bool(rng.random() < 0.5)), {}


def zero_along(a, axis):
    """``a`` with dimension ``axis`` cut to 0 (a zero-size view of the same buffer)."""
    return a[(slice(None),) * axis + (slice(0, 0),)]


# axes of (num_blocks, block_size, num_kv_heads, head_size) in the key / value views
_CACHE_AXES = {"flash": ((0, 1, 2, 3), (0, 1, 2, 3)), "legacy_xpacked": ((0, 3, 1, 2), (0, 3, 1, 2))}


def _cache(rng, d, kind, layout, D, kv):
    """One layer's key/value cache views in ``layout``, filled with garbage the op must keep; a
    zero ``num_blocks``/``block_size``/``num_kv_heads``/``head_size`` is a zero-size view of
    a cache allocated with that dimension at 1."""
    Hk, nb, bs = d["num_kv_heads"], d["num_blocks"], d["block_size"]
    cdt = DT[kind] if kv == "auto" else {"fp8": np.uint8, "fp8_e4m3": E4M3,
                                         "fp8_e5m2": ml_dtypes.float8_e5m2}[kv]
    dims = (nb, bs, Hk, D)
    kvc = pk.allocate_kv_cache(layout, max(nb, 1), max(bs, 1), max(Hk, 1), D or 16, cdt,
                               lib="numpy", fill=0)
    kvc.view(np.uint8)[...] = rng.integers(0, 256, kvc.view(np.uint8).shape)  # garbage to keep
    kc, vc = pk.kv_views(kvc, layout, max(Hk, 1), D or 16)
    axes = _CACHE_AXES["legacy_xpacked" if layout == "legacy_xpacked" else "flash"]
    for i, n in enumerate(dims):
        if n == 0:
            kc, vc = zero_along(kc, axes[0][i]), zero_along(vc, axes[1][i])
    return kc, vc


def _slots(rng, T, nb, bs):
    """``T`` distinct slots of the pool's ``nb * bs`` in random order, ``-1`` (skipped) where the
    pool has fewer, and one more ``-1`` among them. Distinct, as vLLM's scheduler gives them:
    two tokens writing one slot race (the ops leave the winner unspecified, as vLLM's do)."""
    n = nb * bs
    s = rng.permutation(max(n, T))[:T]
    s = np.where(s < n, s, -1).astype(np.int64)
    if T > 1:
        s[int(rng.integers(0, T))] = pk.PAD_SLOT_ID
    return s


def _kv_choice(rng, kind):
    kv = str(rng.choice(["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]))
    nscale = 1
    return kv, f32_scalar(float(rng.uniform(0.01, 0.5))), f32_scalar(float(rng.uniform(0.01, 0.5))), nscale


CACHE_ZERO = ("num_tokens", "num_kv_heads", "head_size", "num_blocks", "block_size")


@case("reshape_and_cache_flash", "rope_cache", ROPE_DIMS, zero=CACHE_ZERO, **ROPE)
def _(rng, d, kind, special):
    _, _, k, v, D = _qk(rng, d, kind, special)
    T, Hk = d["num_tokens"], d["num_kv_heads"]
    layout = str(rng.choice(["interleaved_nhd", "interleaved_hnd", "split_nhd", "split_hnd"]))
    kv, ks, vs, _ = _kv_choice(rng, kind)
    kc, vc = _cache(rng, d, kind, layout, D, kv)
    return (k.reshape(T, Hk, D), v.reshape(T, Hk, D), kc, vc,
            _slots(rng, T, d["num_blocks"], d["block_size"]), kv, ks, vs), {}


@case("reshape_and_cache", "rope_cache", ROPE_DIMS, zero=CACHE_ZERO, **ROPE)
def _(rng, d, kind, special):
    _, _, k, v, D = _qk(rng, d, kind, special)
    T, Hk = d["num_tokens"], d["num_kv_heads"]
    kv, ks, vs, _ = _kv_choice(rng, kind)
    if D % 16:  # the x-packed key needs head_size % (16 / itemsize) == 0
        d = dict(d, head_size=16 * -(-D // 16))
        _, _, k, v, D = _qk(rng, d, kind, special)
    kc, vc = _cache(rng, d, kind, "legacy_xpacked", D, kv)
    return (k.reshape(T, Hk, D), v.reshape(T, Hk, D), kc, vc,
            _slots(rng, T, d["num_blocks"], d["block_size"]), kv, ks, vs), {}


@case("rotary_embedding_and_cache", "rope_cache", ROPE_DIMS, zero=CACHE_ZERO + ("num_heads",),
      **ROPE)
def _(rng, d, kind, special):
    layout = str(rng.choice(pk.KV_LAYOUTS))
    if layout == "legacy_xpacked" and _head_size(d) % 16:  # x-packing: head_size % 16 == 0
        d = dict(d, head_size=16 * -(-_head_size(d) // 16))
    _, q, k, v, D = _qk(rng, d, kind, special)
    T = d["num_tokens"]
    kv, ks, vs, _ = _kv_choice(rng, kind)
    kc, vc = _cache(rng, d, kind, layout, D, kv)
    cs = _cos_sin(rng, D, kind).astype(DT[kind])  # the fused op takes the query's dtype only
    return (_positions(rng, T), q, k, v, kc, vc, _slots(rng, T, d["num_blocks"], d["block_size"]),
            D, cs, bool(rng.random() < 0.5), kv, ks, vs), {}


# ---------------------------------------------------------------- attention
ATTN_DIMS = {"num_seqs": 2, "num_heads": 2, "num_kv_heads": 1, "head_size": 16,
             "block_size": 4, "seq_len": 7}
ATTN_RANGES = {"num_seqs": (1, 3), "num_heads": (1, 4), "num_kv_heads": (1, 2),
               "head_size": (1, 2), "block_size": (1, 8), "seq_len": (0, 20)}


@case("paged_decode_attention", "attention", ATTN_DIMS,
      zero=("num_seqs", "num_heads", "num_kv_heads", "head_size", "block_size", "seq_len"),
      ranges=ATTN_RANGES, compare=compare_attention, specials=False,
      recompile_dim=("num_seqs", "seq_len"))
def _(rng, d, kind, special):
    from test_attention_cases import make_case, op_args
    S, Hk, ratio = d["num_seqs"], d["num_kv_heads"], d["num_heads"]
    D = {1: 16, 2: 32}.get(d["head_size"], d["head_size"])
    zeros = [n for n in ("num_kv_heads", "num_heads", "head_size", "block_size") if d[n] == 0]
    lens = rng.integers(0, d["seq_len"] + 1, S) if d["seq_len"] else np.zeros(S, np.int64)
    if S and d["seq_len"]:
        lens[0] = d["seq_len"]
    c = make_case(int(rng.integers(0, 2 ** 31)), seq_lens=lens, num_heads=max(ratio, 1) * max(Hk, 1),
                  num_kv_heads=max(Hk, 1), head_size=D or 16, block_size=max(d["block_size"], 1),
                  kind=kind, cache=str(rng.choice(["auto", "fp8"])),
                  layout="nhd" if zeros else str(rng.choice(["nhd", "hnd"])), spare_blocks=1)
    args, kw = op_args(c, return_lse=True)
    q, kc, vc = args[:3]
    for n in zeros:  # a zero-size view: query [S, Hq, D], caches [nb, bs, Hk, D]
        q = zero_along(q, {"num_kv_heads": 1, "num_heads": 1, "head_size": 2}.get(n, 3)) \
            if n != "block_size" else q
        if n != "num_heads":
            ax = {"num_kv_heads": 2, "head_size": 3, "block_size": 1}[n]
            kc, vc = zero_along(kc, ax), zero_along(vc, ax)
    args = (q, kc, vc) + args[3:]
    if "head_size" in zeros:
        args = args[:5] + (1.0,)
    if rng.random() < 0.3:
        kw["softcap"] = 5.0
    if rng.random() < 0.3:
        kw["sliding_window"] = int(rng.integers(1, 8))
    return args, kw


MERGE_DIMS = {"num_tokens": 3, "num_heads": 2, "head_size": 8}


@case("merge_attn_states", "attention", MERGE_DIMS, zero=("num_tokens", "num_heads", "head_size"),
      ranges={"num_tokens": (1, 4), "num_heads": (1, 3), "head_size": (1, 24)},
      compare=compare_attention, recompile_dim="num_tokens")
def _(rng, d, kind, special):
    N, H, D = d["num_tokens"], d["num_heads"], d["head_size"]
    po, so = values(rng, (N, H, D), kind, False), values(rng, (N, H, D), kind, False)
    pl = rng.standard_normal((H, N)).astype(np.float32) * 3
    sl = rng.standard_normal((H, N)).astype(np.float32) * 3
    if special and pl.size:
        pl.flat[rng.integers(0, pl.size)] = -np.inf
        sl.flat[rng.integers(0, sl.size)] = -np.inf
    out = np.empty_like(po)
    return (out, po, pl, so, sl), {}


# ---------------------------------------------------------------- sampling
SAMPLE_DIMS = {"num_rows": 2, "vocab_size": 37}
SAMPLE_RANGES = {"num_rows": (1, 3), "vocab_size": (1, 70)}
SAMPLE = dict(zero=("num_rows", "vocab_size"), ranges=SAMPLE_RANGES, compare=compare_sampling,
              kinds=("f32", "bf16"), recompile_dim="num_rows")


def _logits(rng, d, kind, special):
    return values(rng, (d["num_rows"], d["vocab_size"]), kind, special, 3.0)


def _sampler(rng):
    return str(rng.choice(["v1", "v2"]))


@case("greedy_sample_logprob", "sampling", SAMPLE_DIMS, **SAMPLE)
def _(rng, d, kind, special):
    return (_logits(rng, d, kind, special), _sampler(rng)), {}


@case("selected_token_logprob_rank", "sampling", SAMPLE_DIMS, **SAMPLE)
def _(rng, d, kind, special):
    ids = rng.integers(0, d["vocab_size"] + 2, d["num_rows"]).astype(np.int64)
    return (_logits(rng, d, kind, special), ids, _sampler(rng)), {}


@case("top_k_logprobs", "sampling", SAMPLE_DIMS, **SAMPLE)
def _(rng, d, kind, special):
    k = int(rng.integers(1, max(min(d["vocab_size"], 5), 1) + 1))
    ids = (rng.integers(0, d["vocab_size"] + 1, d["num_rows"]).astype(np.int64)
           if rng.random() < 0.5 else None)
    return (_logits(rng, d, kind, special), k, ids, _sampler(rng)), {}


def compare_min_p(got, want, kind, what, mode, inputs=None):
    """Min-P bit for bit in the simulator and for V2 (a compare against ``m + log(min_p)``);
    V1 on the GPU computes each ``p_v`` with libdevice's expf (2 ulps), so a token within 4
    float32 ulps of its row's threshold may fall either side (``tests/test_sampling_gpu.py``'s
    rule): every other token masked exactly as the oracle, unmasked logits untouched."""
    if mode == "sim" or inputs is None or inputs[2] == "v2":
        return compare_bits(got, want, kind, what, mode)
    from loomnb.oracle.sampling import min_p_mask
    g, w = np.asarray(got), np.asarray(want)
    _, p, thr = min_p_mask(inputs[0].copy(), inputs[1], "v1")
    near = np.abs(p.astype(np.float64) - np.asarray(thr, np.float64)[:, None]) <= \
        4 * np.spacing(np.asarray(thr, np.float32))[:, None]
    differ = bits(g) != bits(w)
    assert not (differ & ~near).any(), f"{what}: masked differently away from the threshold"
    kept = g != -np.inf
    assert np.array_equal(bits(g[kept]), bits(inputs[0][kept])), f"{what}: unmasked logits untouched"


@case("min_p_filter_", "sampling", SAMPLE_DIMS,
      **dict(SAMPLE, kinds=("f32",), compare=compare_min_p))
def _(rng, d, kind, special):
    mp = rng.choice(np.array([0.0, 0.05, 0.3, 1.0, -0.5, -1e-30, -np.inf, np.nan, 2.0],
                             np.float32), d["num_rows"]).astype(np.float32)
    return (_logits(rng, d, kind, special), mp, _sampler(rng)), {}


# ---------------------------------------------------------------- sampler
SAMPLER_DIMS = {"num_rows": 2, "vocab_size": 29}
SAMPLER = dict(zero=("num_rows",), ranges={"num_rows": (1, 3), "vocab_size": (1, 48)},
               recompile_dim="num_rows")


def compare_renorm(got, want, kind, what, mode, inputs=None):
    """Renormalised probabilities within the sampler_renorm row (the float64 sum's order)."""
    assert_ulps(got, want, ulps("sampler_renorm", "f32"), what)


def _per_row_or_scalar(rng, R, options, dtype):
    """A per-row parameter as one of ``options`` or (half the time) a [num_rows] array of them
    (drawn from the values' stream, so the options drawn after it do not depend on R)."""
    if rng.random() < 0.5:
        v = rng.choice(options)
        return int(v) if dtype == np.int32 else float(v)
    return np.asarray(rng.choice(options, R), dtype)


def _sampler_kwargs(rng, R):
    seed = int(rng.integers(0, 2 ** 62)) if rng.random() < 0.5 else \
        rng.integers(0, 2 ** 62, R).astype(np.int64)
    kw = {"seed": seed}
    if rng.random() < 0.5:
        kw["offset"] = int(rng.integers(0, 1 << 40))
    return kw


def _top_k(rng, d):
    return _per_row_or_scalar(rng, d["num_rows"], np.arange(-1, d["vocab_size"] + 2), np.int32)


def _top_p(rng, d):
    return _per_row_or_scalar(rng, d["num_rows"], [0.0, 0.3, 0.8, 0.95, 1.0], np.float32)


def _probs(rng, d, special):
    x = values(rng, (d["num_rows"], d["vocab_size"]), "f32", special, 2.0)
    with np.errstate(all="ignore"):
        e = np.exp(x.astype(np.float64) - np.nanmax(np.where(np.isinf(x), np.nan, x), 1,
                                                      keepdims=True, initial=0))
        return np.where(np.isnan(e), 0, e / np.nansum(e, 1, keepdims=True)).astype(np.float32)


@case("top_k_top_p_sampling_from_logits", "sampler", SAMPLER_DIMS, **SAMPLER)
def _(rng, d, kind, special):
    R = d["num_rows"]
    kw = _sampler_kwargs(rng, R)
    kw["temperature"] = _per_row_or_scalar(rng, R, [0.0, 0.5, 1.0, 1.7], np.float32)
    if rng.random() < 0.5:
        kw["min_p"] = _per_row_or_scalar(rng, R, [0.0, 0.05, 0.5], np.float32)
    kw["filter_apply_order"] = str(rng.choice(["top_k_first", "joint"]))
    return (_logits(rng, d, kind, special), _top_k(rng, d), _top_p(rng, d)), kw


@case("top_k_top_p_sampling_from_probs", "sampler", SAMPLER_DIMS, kinds=("f32",), **SAMPLER)
def _(rng, d, kind, special):
    kw = _sampler_kwargs(rng, d["num_rows"])
    kw["filter_apply_order"] = str(rng.choice(["top_k_first", "joint"]))
    return (_probs(rng, d, special), _top_k(rng, d), _top_p(rng, d)), kw


@case("sampling_from_logits", "sampler", SAMPLER_DIMS, **SAMPLER)
def _(rng, d, kind, special):
    kw = _sampler_kwargs(rng, d["num_rows"])
    kw["temperature"] = _per_row_or_scalar(rng, d["num_rows"], [0.0, 0.7, 1.0], np.float32)
    return (_logits(rng, d, kind, special),), kw


@case("sampling_from_probs", "sampler", SAMPLER_DIMS, kinds=("f32",), **SAMPLER)
def _(rng, d, kind, special):
    return (_probs(rng, d, special),), _sampler_kwargs(rng, d["num_rows"])


@case("top_k_sampling_from_probs", "sampler", SAMPLER_DIMS, kinds=("f32",), **SAMPLER)
def _(rng, d, kind, special):
    return (_probs(rng, d, special), _top_k(rng, d)), _sampler_kwargs(rng, d["num_rows"])


@case("top_p_sampling_from_probs", "sampler", SAMPLER_DIMS, kinds=("f32",), **SAMPLER)
def _(rng, d, kind, special):
    return (_probs(rng, d, special), _top_p(rng, d)), _sampler_kwargs(rng, d["num_rows"])


@case("min_p_sampling_from_probs", "sampler", SAMPLER_DIMS, kinds=("f32",), **SAMPLER)
def _(rng, d, kind, special):
    mp = _per_row_or_scalar(rng, d["num_rows"], [0.0, 0.1, 0.6], np.float32)
    return (_probs(rng, d, special), mp), _sampler_kwargs(rng, d["num_rows"])


@case("top_k_mask_logits", "sampler", SAMPLER_DIMS, **SAMPLER)
def _(rng, d, kind, special):
    return (_logits(rng, d, kind, special), _top_k(rng, d)), {}


@case("top_k_top_p_mask_logits", "sampler", SAMPLER_DIMS, **SAMPLER)
def _(rng, d, kind, special):
    R = d["num_rows"]
    kw = dict(temperature=_per_row_or_scalar(rng, R, [0.0, 0.7, 1.0], np.float32),
              min_p=_per_row_or_scalar(rng, R, [0.0, 0.1], np.float32),
              filter_apply_order=str(rng.choice(["top_k_first", "joint"])))
    return (_logits(rng, d, kind, special), _top_k(rng, d), _top_p(rng, d)), kw


@case("top_k_renorm_probs", "sampler", SAMPLER_DIMS, kinds=("f32",), compare=compare_renorm,
      **SAMPLER)
def _(rng, d, kind, special):
    return (_probs(rng, d, special), _top_k(rng, d)), {}


@case("top_p_renorm_probs", "sampler", SAMPLER_DIMS, kinds=("f32",), compare=compare_renorm,
      **SAMPLER)
def _(rng, d, kind, special):
    return (_probs(rng, d, special), _top_p(rng, d)), {}


def _seen(rng, d, p=0.3):
    return rng.random((d["num_rows"], d["vocab_size"])) < p


@case("apply_repetition_penalties_", "sampler", SAMPLER_DIMS, **SAMPLER)
def _(rng, d, kind, special):
    rep = rng.choice([0.5, 1.0, 1.3, 2.0], d["num_rows"]).astype(np.float32).astype(DT[kind])
    return (_logits(rng, d, kind, special), _seen(rng, d), _seen(rng, d), rep), {}


@case("apply_penalties_", "sampler", SAMPLER_DIMS, kinds=("f32",), **SAMPLER)
def _(rng, d, kind, special):
    R, V = d["num_rows"], d["vocab_size"]
    counts = np.where(_seen(rng, d), rng.integers(1, 5, (R, V)), 0).astype(
        rng.choice([np.int32, np.int64]))
    rep = rng.choice([0.7, 1.0, 1.2], R).astype(np.float32)
    freq = rng.choice([0.0, 0.1, -0.3], R).astype(np.float32)
    pres = rng.choice([0.0, 0.5, 1.0], R).astype(np.float32)
    return (_logits(rng, d, kind, special), _seen(rng, d, 0.1), counts, rep, freq, pres), {}


@case("chain_speculative_sampling", "sampler",
      {"num_reqs": 2, "num_speculative_tokens": 3, "vocab_size": 24},
      zero=("num_reqs", "num_speculative_tokens", "vocab_size"),
      ranges={"num_reqs": (1, 3), "num_speculative_tokens": (1, 4), "vocab_size": (1, 40)},
      kinds=("f32",), recompile_dim="num_reqs")
def _(rng, d, kind, special):
    """Target rows and (half the time) draft rows as probabilities, drafts mostly their
    argmax (often accepted) with an id outside the vocabulary now and then, and (half the
    time) the two count accumulators."""
    B, n, V = d["num_reqs"], d["num_speculative_tokens"], d["vocab_size"]
    tp = _probs(rng, {"num_rows": B * (n + 1), "vocab_size": V}, special).reshape(B, n + 1, V)
    dp = _probs(rng, {"num_rows": B * n, "vocab_size": V}, special).reshape(B, n, V)
    ids = np.argmax(tp[:, :n], -1).astype(np.int32) if V else np.zeros((B, n), np.int32)
    ids = np.where(rng.random((B, n)) < 0.2, rng.integers(-1, V + 2, (B, n)), ids).astype(np.int32)
    args = (dp if rng.random() < 0.5 else None, ids, tp)
    if rng.random() < 0.5:
        args += (rng.integers(0, 9, B).astype(np.int32), rng.integers(0, 9, B).astype(np.int32))
    return args, _sampler_kwargs(rng, B)


# ---------------------------------------------------------------- spec_decode
SPEC_DIMS = {"num_reqs": 3, "max_spec_len": 3, "vocab_size": 20}
SPEC_RANGES = {"num_reqs": (1, 4), "max_spec_len": (1, 4), "vocab_size": (2, 40)}


def _batch(rng, d, kind, special):
    from test_spec_decode_oracle import make_batch
    R, K, V = d["num_reqs"], d["max_spec_len"], d["vocab_size"]
    bonus64 = rng.random() < 0.5  # before make_batch, whose per-draft draws depend on the size
    counts = rng.integers(0, K + 1, R) if K else np.zeros(R, np.int64)
    if R and K:
        counts[0] = K
    b = make_batch(rng, counts, K, max(V, 1), logits_dtype=DT[kind])
    if V == 0:
        b["target_logits"] = b["target_logits"][:, :0]
    if special and b["target_logits"].size:
        lg = b["target_logits"].astype(np.float32)
        lg.flat[rng.integers(0, lg.size)] = rng.choice([np.nan, np.inf, -np.inf, -0.0])
        b["target_logits"] = lg.astype(DT[kind])
    if bonus64:
        b["bonus_token_ids"] = b["bonus_token_ids"].astype(np.int64)
    return b


@case("rejection_greedy_sample", "spec_decode", SPEC_DIMS,
      zero=("num_reqs", "max_spec_len"), ranges=SPEC_RANGES, kinds=("f32",),
      recompile_dim="num_reqs")
def _(rng, d, kind, special):
    b = _batch(rng, d, kind, special)
    return (b["draft_token_ids"], b["cu_num_draft_tokens"], b["target_argmax"],
            b["bonus_token_ids"], b["max_spec_len"]), {}


@case("greedy_verify", "spec_decode", SPEC_DIMS,
      zero=("num_reqs", "max_spec_len", "vocab_size"), ranges=SPEC_RANGES,
      kinds=("f32", "bf16", "f16"), recompile_dim="num_reqs")
def _(rng, d, kind, special):
    b = _batch(rng, d, kind, special)
    return (b["draft_token_ids"], b["cu_num_draft_tokens"], b["target_logits"],
            b["bonus_token_ids"], b["max_spec_len"]), {}


# ---------------------------------------------------------------- kv_blocks
KVB_DIMS = {"num_layers": 2, "num_pairs": 3, "num_blocks": 6, "block_size": 4, "num_kv_heads": 2,
            "head_size": 2}
KVB_RANGES = {"num_layers": (1, 3), "num_pairs": (1, 5), "num_blocks": (2, 8),
              "block_size": (1, 4), "num_kv_heads": (1, 2), "head_size": (1, 3)}
FLASH_LAYOUTS = ("interleaved_nhd", "interleaved_hnd", "split_nhd", "split_hnd")


def _pairs(rng, P, nb, nsrc=None):
    """``P`` rows ``(src, dst)``: distinct destinations that are nobody's source, sources drawn
    with repeats (one block forked to several), a ``-1`` row (padding) among them when P > 1
    and rows past what the pool allows. ``nsrc``: the source pool's blocks (default nb; a
    swap's pools differ)."""
    if nsrc is not None:  # two pools: any source, distinct destinations
        dst = rng.permutation(max(nb, P))[:P]
        src = rng.integers(0, max(nsrc, 1), P)
        m = np.stack([src, dst], 1).astype(np.int64)
        m[(m[:, 1] >= nb) | (nsrc == 0)] = -1
    else:
        perm = rng.permutation(nb)
        k = min(P, max(nb - 1, 0))
        dst, pool = perm[:k], perm[k:]
        src = pool[rng.integers(0, len(pool), k)] if len(pool) else np.zeros(k, np.int64)
        m = np.full((P, 2), -1, np.int64)
        m[:k] = np.stack([src, dst], 1)
        m = m[rng.permutation(P)]
    if P > 1:
        m[int(rng.integers(0, P))] = -1
    return np.ascontiguousarray(m)


def _kv_kind(rng, kind):
    kv = str(rng.choice(["auto", "auto", "fp8", "fp8_e5m2"]))
    return (DT[kind] if kv == "auto" else
            {"fp8": np.uint8, "fp8_e5m2": ml_dtypes.float8_e5m2}[kv])


def _garbage(rng, a):
    a.view(np.uint8)[...] = rng.integers(0, 256, a.view(np.uint8).shape)
    return a


def _layer_caches(rng, d, kind):
    """Every layer's key and value caches in one random layout (the legacy one too)."""
    Hk, nb, bs, D = d["num_kv_heads"], d["num_blocks"], d["block_size"], _head_size(d)
    layout = str(rng.choice(FLASH_LAYOUTS + ("legacy_xpacked",)))
    cdt = _kv_kind(rng, kind)
    if layout == "legacy_xpacked" and D % 16:
        D = 16 * -(-D // 16) if D else 0
    kcs, vcs = [], []
    for _ in range(d["num_layers"]):
        kvc = pk.allocate_kv_cache(layout, max(nb, 1), max(bs, 1), max(Hk, 1), D or 16, cdt,
                                   lib="numpy", fill=0)
        _garbage(rng, kvc)
        kc, vc = pk.kv_views(kvc, layout, max(Hk, 1), D or 16)
        axes = _CACHE_AXES["legacy_xpacked" if layout == "legacy_xpacked" else "flash"]
        for i, n in enumerate((nb, bs, Hk, D)):
            if n == 0:
                kc, vc = zero_along(kc, axes[0][i]), zero_along(vc, axes[1][i])
        kcs.append(kc)
        vcs.append(vc)
    return kcs, vcs, layout


@case("copy_blocks", "kv_blocks", KVB_DIMS,
      zero=("num_layers", "num_pairs", "block_size", "num_kv_heads", "head_size"),
      ranges=KVB_RANGES, specials=False, recompile_dim="num_pairs")
def _(rng, d, kind, special):
    kcs, vcs, layout = _layer_caches(rng, d, kind)
    m = _pairs(rng, d["num_pairs"], d["num_blocks"])
    if layout.startswith("interleaved") and kcs and kcs[0].size and rng.random() < 0.3:
        return ([k.base for k in kcs], [], m), {}  # whole [num_blocks, 2, ...] buffers, one list
    return (kcs, vcs, m), {}


@case("swap_blocks", "kv_blocks", {k: KVB_DIMS[k] for k in KVB_DIMS if k != "num_layers"},
      zero=("num_pairs", "num_blocks", "block_size", "num_kv_heads", "head_size"),
      ranges={k: v for k, v in KVB_RANGES.items() if k != "num_layers"}, specials=False,
      recompile_dim="num_pairs")
def _(rng, d, kind, special):
    Hk, nb, bs, D = d["num_kv_heads"], d["num_blocks"], d["block_size"], _head_size(d)
    dt = _kv_kind(rng, kind)
    ns = int(rng.integers(1, 6)) if nb else 0
    src = _garbage(rng, np.zeros((ns, bs, Hk, D), dt))
    dst = _garbage(rng, np.zeros((nb, bs, Hk, D), dt))
    full = bs * Hk * D * np.dtype(dt).itemsize
    n = full if rng.random() < 0.7 or full == 0 else int(rng.integers(0, full + 1))
    return (src, dst, n, _pairs(rng, d["num_pairs"], nb, ns)), {}


@case("compact_blocks", "kv_blocks", dict(KVB_DIMS, num_blocks=40, block_size=2, head_size=1),
      zero=("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size"),
      ranges=dict(KVB_RANGES, num_blocks=(0, 48)), specials=False, recompile_dim="num_blocks")
def _(rng, d, kind, special):
    kcs, vcs, _ = _layer_caches(rng, d, kind)
    nb = d["num_blocks"]
    n = nb if rng.random() < 0.7 else int(rng.integers(0, nb + 1))
    perm = rng.permutation(n).astype(np.int64)
    if n > 3 and rng.random() < 0.3:  # some fixed points
        keep = rng.random(n) < 0.5
        idx = np.flatnonzero(~keep)
        perm = np.arange(n, dtype=np.int64)
        perm[idx] = idx[rng.permutation(len(idx))]
    caches = kcs + vcs
    return ((caches if rng.random() < 0.8 or not caches else caches[0]), perm), {}


GATHER_DIMS = {"num_seqs": 2, "seq_len": 6, "num_blocks": 5, "block_size": 4, "num_kv_heads": 2,
               "head_size": 2}
GATHER_RANGES = {"num_seqs": (1, 3), "seq_len": (0, 9), "num_blocks": (1, 5),
                 "block_size": (1, 4), "num_kv_heads": (1, 2), "head_size": (1, 3)}


@case("gather_cache", "kv_blocks", GATHER_DIMS,
      zero=("num_seqs", "seq_len", "block_size", "num_kv_heads", "head_size"),
      ranges=GATHER_RANGES, recompile_dim="num_seqs")
def _(rng, d, kind, special):
    S, Hk, nb, bs, D = (d["num_seqs"], d["num_kv_heads"], d["num_blocks"], d["block_size"],
                        _head_size(d))
    kv = str(rng.choice(["auto", "auto", "fp8", "fp8_e4m3", "fp8_e5m2"]))
    mla = rng.random() < 0.25 and Hk > 0
    if kv == "auto":
        src = values(rng, (nb, max(bs, 1), Hk, D), kind, special)
        if rng.random() < 0.5:  # a K view of an interleaved cache
            layout = str(rng.choice(FLASH_LAYOUTS))
            kvc = pk.allocate_kv_cache(layout, nb, max(bs, 1), max(Hk, 1), D or 16, DT[kind],
                                       lib="numpy", fill=0)
            _garbage(rng, kvc)
            src = pk.kv_views(kvc, layout, max(Hk, 1), D or 16)[int(rng.integers(0, 2))]
            src = src[:, :, :Hk, :D]
    else:
        cdt = {"fp8": E4M3, "fp8_e4m3": np.uint8, "fp8_e5m2": ml_dtypes.float8_e5m2}[kv]
        src = _garbage(rng, np.zeros((nb, max(bs, 1), Hk, D), cdt))
    if bs == 0:
        src = src[:, :0]
    if mla:
        src = src[:, :, 0]
    lens = rng.integers(0, d["seq_len"] + 1, S) * (bs > 0)
    starts = rng.integers(0, 5, S) if rng.random() < 0.4 else None
    top = lens + (starts if starts is not None else 0)
    nbl = max(1, int(-(-top.max() // max(bs, 1))) if S else 1)
    bt = rng.integers(0, nb, (S + int(rng.integers(0, 2)), nbl)).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    rows = int(cu[-1]) + int(rng.integers(0, 3))
    dkind = kind
    dst = _garbage(rng, np.zeros((rows,) + src.shape[2:], DT[dkind] if kv != "auto" else
                                 src.dtype))
    scale = f32_scalar(float(rng.uniform(0.01, 2.0)))
    return (src, dst, bt, cu, kv, scale if kv != "auto" or rng.random() < 0.5 else None,
            starts.astype(np.int32) if starts is not None else None), {}


MLA_DIMS = {"num_tokens": 3, "kv_lora_rank": 16, "pe_dim": 8, "num_blocks": 3, "block_size": 2}
MLA_RANGES = {"num_tokens": (1, 5), "kv_lora_rank": (1, 24), "pe_dim": (1, 16),
              "num_blocks": (1, 3), "block_size": (1, 3)}


@case("concat_and_cache_mla", "kv_blocks", MLA_DIMS,
      zero=("num_tokens", "kv_lora_rank", "pe_dim", "num_blocks", "block_size"),
      ranges=MLA_RANGES, recompile_dim="num_tokens")
def _(rng, d, kind, special):
    T, Lr, P, nb, bs = (d["num_tokens"], d["kv_lora_rank"], d["pe_dim"], d["num_blocks"],
                        d["block_size"])
    if rng.random() < 0.5:  # vLLM's widths, scaled down: multiples of 8
        Lr, P = 8 * -(-Lr // 8), 8 * -(-P // 8)
    buf = values(rng, (T, Lr + P + 3), kind, special, 2.0)
    kv_c, k_pe = buf[:, :Lr], buf[:, Lr + 3:]
    if rng.random() < 0.5:
        k_pe = k_pe[:, None, :]
    kv = str(rng.choice(["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]))
    cdt = DT[kind] if kv == "auto" else {"fp8": np.uint8, "fp8_e4m3": E4M3,
                                         "fp8_e5m2": ml_dtypes.float8_e5m2}[kv]
    cache = _garbage(rng, np.zeros((nb, bs, Lr + P), cdt))
    scale = f32_scalar(float(rng.uniform(0.01, 0.5)))
    return (kv_c, k_pe, cache, _slots(rng, T, nb, bs), kv,
            scale if kv != "auto" or rng.random() < 0.5 else None), {}


# ---------------------------------------------------------------- moe
def compare_moe_route(got, want, kind, what, mode, inputs=None):
    """Ids (and token_expert_indices) bit for bit; the float32 weights bit for bit in the
    simulator and within the ``moe_route`` row on the GPU (libdevice ``expf``)."""
    for i, (g, w) in enumerate(zip(_leaves(got), _leaves(want))):
        if g.dtype == np.float32 and mode == "gpu":
            assert np.array_equal(np.isnan(g), np.isnan(w)), f"{what}: NaN positions differ"
            ok = ~np.isnan(w)
            assert_ulps(g[ok], w[ok], ulps("moe_route", "f32"), f"{what}: weights")
        else:
            assert_same(g, w, f"{what}: result {i}")


ROUTE_DIMS = {"num_tokens": 3, "num_experts": 24, "topk": 3}
ROUTE_RANGES = {"num_tokens": (1, 6), "num_experts": (2, 70), "topk": (1, 4)}
ROUTE = dict(zero=("num_tokens",), ranges=ROUTE_RANGES, compare=compare_moe_route,
             recompile_dim="num_tokens")


def _route_args(rng, d, kind, special):
    E = d["num_experts"]
    g = values(rng, (d["num_tokens"], E), kind, special, 2.0)
    bias = values(rng, (E,), "f32", False, 0.3) if rng.random() < 0.5 else None
    return g, min(d["topk"], E), bool(rng.random() < 0.5), bias


@case("topk_softmax", "moe", ROUTE_DIMS, **ROUTE)
def _(rng, d, kind, special):
    g, k, renorm, bias = _route_args(rng, d, kind, special)
    return (g, k, renorm), {"e_score_correction_bias": bias}


@case("topk_sigmoid", "moe", ROUTE_DIMS, **ROUTE)
def _(rng, d, kind, special):
    g, k, renorm, bias = _route_args(rng, d, kind, special)
    return (g, k, renorm), {"e_score_correction_bias": bias}


GROUPED_DIMS = {"num_tokens": 3, "num_expert_group": 4, "group_size": 4, "topk": 3}
GROUPED_RANGES = {"num_tokens": (1, 5), "num_expert_group": (1, 8), "group_size": (2, 8),
                  "topk": (1, 6)}


@case("grouped_topk", "moe", GROUPED_DIMS, zero=("num_tokens",), ranges=GROUPED_RANGES,
      compare=compare_moe_route, recompile_dim="num_tokens")
def _(rng, d, kind, special):
    G, gs = d["num_expert_group"], d["group_size"]
    E = G * gs
    g = values(rng, (d["num_tokens"], E), kind, special, 2.0)
    tg = int(rng.integers(1, G + 1))
    k = min(d["topk"], tg * gs)
    bias = values(rng, (E,), "f32", False, 0.3) if rng.random() < 0.5 else None
    score = str(rng.choice(["softmax", "sigmoid"]))
    scale = float(rng.choice([1.0, 2.5]))
    hidden = np.zeros((d["num_tokens"], 2), np.float32)
    return (hidden, g, k, bool(rng.random() < 0.5), G, tg, score, scale, bias), {}


ALIGN_DIMS = {"num_tokens": 5, "topk": 2, "num_experts": 6, "block_size": 4}
ALIGN_RANGES = {"num_tokens": (1, 40), "topk": (1, 4), "num_experts": (1, 20),
                "block_size": (1, 8)}


def _topk_ids(rng, M, k, E, dtype=np.int32, invalid=True):
    ids = rng.integers(0, E, (M, k))
    if invalid and ids.size and rng.random() < 0.3:  # dropped ids: -1 and >= num_experts
        ids[rng.random(ids.shape) < 0.1] = int(rng.choice([-1, E]))
    return ids.astype(dtype)


@case("moe_align_block_size", "moe", ALIGN_DIMS, zero=("num_tokens", "topk"),
      ranges=ALIGN_RANGES, kinds=("f32",), specials=False, recompile_dim="num_tokens")
def _(rng, d, kind, special):
    E = d["num_experts"]
    ids = _topk_ids(rng, d["num_tokens"], d["topk"], E,
                    np.int64 if rng.random() < 0.3 else np.int32)
    emap = rng.integers(-1, E, E).astype(np.int32) if rng.random() < 0.3 else None
    return (ids, d["block_size"], E, emap, bool(rng.random() < 0.3)), {}


ROWS_DIMS = {"num_tokens": 3, "topk": 2, "hidden_size": 16, "num_experts": 4, "wide": 0}
ROWS_RANGES = {"num_tokens": (1, 5), "topk": (1, 3), "hidden_size": (1, 40),
               "num_experts": (1, 6), "wide": (0, 1)}


def _sorted_ids(rng, d):
    from loomnb.oracle import moe_align_block_size
    E = d["num_experts"]
    ids = _topk_ids(rng, d["num_tokens"], d["topk"], E, invalid=False)
    return moe_align_block_size(ids, int(rng.choice([1, 4])), E)[0]


@case("moe_permute", "moe", ROWS_DIMS, zero=("num_tokens", "hidden_size"), ranges=ROWS_RANGES,
      recompile_dim="num_tokens")
def _(rng, d, kind, special):
    x = rows_of(rng, d["num_tokens"], d["hidden_size"], kind, special, d["wide"], 2.0)
    fp8 = rng.random() < 0.4
    ub = f32_scalar(float(rng.choice([0.5, 100.0]))) if fp8 and rng.random() < 0.5 else None
    return (x, _sorted_ids(rng, d), d["topk"], "fp8" if fp8 else "none", ub), {}


@case("moe_unpermute", "moe", ROWS_DIMS, zero=("num_tokens", "hidden_size"),
      ranges=ROWS_RANGES, recompile_dim="num_tokens")
def _(rng, d, kind, special):
    s = _sorted_ids(rng, d)
    y = rows_of(rng, s.shape[0], d["hidden_size"], kind, special, d["wide"])
    w = values(rng, (d["num_tokens"], d["topk"]), "f32", False).astype(np.float32)
    return (y, s, w), {}


SUM_DIMS = {"num_tokens": 3, "topk": 2, "hidden_size": 16, "wide": 0}
SUM_RANGES = {"num_tokens": (1, 5), "topk": (1, 9), "hidden_size": (1, 40), "wide": (0, 1)}


@case("moe_sum", "moe", SUM_DIMS, zero=("num_tokens", "topk", "hidden_size"), ranges=SUM_RANGES,
      recompile_dim="num_tokens")
def _(rng, d, kind, special):
    M, k, H = d["num_tokens"], d["topk"], d["hidden_size"]
    pad = int(rng.integers(1, 9)) if d["wide"] else 0
    buf = values(rng, (M, k, H + pad), kind, special)
    return (buf[:, :, pad:],), {}


# ---------------------------------------------------------------- what a serving loop grows
# The sizes each grown dimension takes in the no-recompile tests: past every size rule of the
# families (activation: 1, 2 and 4 units a thread at 33,792 and 2^20 units; attention: 1/2/4
# heads a CTA, the vector lanes past a wave, split-K from 256 tokens).
GROWN_SIZES = {"num_tokens": (1, 3, 250, 20000, 400000), "num_rows": (1, 3, 250, 20000),
               "num_reqs": (1, 3, 250, 2000), "num_seqs": (1, 3, 64, 300),
               "seq_len": (1, 40, 300, 5000), "num_pairs": (1, 3, 250, 2000),
               "num_blocks": (40, 200, 2000)}


def grown():
    """``(op name, dimension)`` for every dimension a serving loop grows of every op."""
    out = []
    for name in sorted(CASES):
        dims = CASES[name].recompile_dim
        out += [(name, d) for d in ((dims,) if isinstance(dims, str) else dims) if d]
    return out


def grown_call(name, dim, n):
    """The case of ``name`` with ``dim = n`` and every option fixed (one seed at every size);
    decode attention grows its batch at a short context."""
    c = CASES[name]
    d = dict(c.dims, **{dim: n})
    if name == "paged_decode_attention" and dim == "num_seqs":
        d["seq_len"] = 8
    return c.build(Draws(0), d, c.kinds[0], False)


# ---------------------------------------------------------------- moving a case to the GPU
def to_device(x):
    """A case's NumPy arguments as torch CUDA tensors with the same strides, views of one moved
    buffer staying views (a q/k/v slice of one QKV buffer, a K/V view of one KV cache); dtypes
    (NumPy or ml_dtypes) as torch dtypes; everything else unchanged."""
    import torch
    moved = {}

    def base_of(a):
        while isinstance(a.base, np.ndarray):
            a = a.base
        return a

    def torch_of(buf):
        key = id(buf)
        if key not in moved:
            raw = np.ascontiguousarray(buf).view(np.uint8).reshape(-1)
            moved[key] = torch.from_numpy(raw.copy()).to("cuda")
        return moved[key]

    tdt = {np.dtype(BF16): torch.bfloat16, np.dtype(E4M3): torch.float8_e4m3fn,
           np.dtype(ml_dtypes.float8_e5m2): torch.float8_e5m2}

    def one(a):
        if isinstance(a, type) and a in (BF16, np.float16, np.float32):
            return {BF16: torch.bfloat16, np.float16: torch.float16, np.float32: torch.float32}[a]
        if not isinstance(a, np.ndarray):
            return a
        base = base_of(a)
        raw = torch_of(base)
        dt = tdt.get(a.dtype) or getattr(torch, a.dtype.name)
        off = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        isz = a.itemsize
        flat = raw.view(torch.uint8)[:base.nbytes] if base.nbytes else raw[:0]
        t = flat.view(dt) if flat.numel() else torch.empty(0, dtype=dt, device="cuda")
        return torch.as_strided(t, a.shape, tuple(s // isz for s in a.strides), off // isz)

    def any_(v):
        return [one(e) for e in v] if isinstance(v, list) else one(v)

    if isinstance(x, dict):
        return {k: any_(v) for k, v in x.items()}
    return tuple(any_(v) for v in x)


def to_host(x):
    """torch results back to NumPy (bf16/FP8 as ml_dtypes), recursively."""
    import torch
    if isinstance(x, (tuple, list)):
        return type(x)(to_host(e) for e in x)
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        m = {torch.bfloat16: BF16, torch.float8_e4m3fn: E4M3, torch.float8_e5m2: ml_dtypes.float8_e5m2}
        if t.dtype in m:
            return t.view(torch.uint8 if t.element_size() == 1 else torch.int16).numpy().view(m[t.dtype])
        return t.numpy()
    return x
