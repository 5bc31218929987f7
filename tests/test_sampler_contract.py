"""Bad input to the sampler ops gets a clear error naming the argument, what was expected and
what came, before any launch, and nothing the caller passed is modified (the error-message table
of the family template); an empty batch is a no-op. For the twelve ops of
``loomnb/ops/sampler.py``: the seven sampling ops, the four filters (``top_k_mask_logits``,
``top_k_top_p_mask_logits``, ``top_k_renorm_probs``, ``top_p_renorm_probs``) and the two
penalty ops.

Runs in the simulator pass (NumPy arrays are the device arrays there); host-array and
cross-device cases are GPU-only. Every test here runs with ``loomnb.ops._launch.launch``
replaced by a function that fails the test: no call launches a kernel -- a rejected call
raises before it, and an empty batch returns before it.
"""

import re

import ml_dtypes
import numpy as np
import pytest

import loomnb
from loomnb import LoomnbTypeError, LoomnbValueError

from family import Launched, no_launch, rejects  # noqa: F401 (no_launch: a fixture)

pytestmark = [pytest.mark.sim, pytest.mark.usefixtures("no_launch")]

BF16 = ml_dtypes.bfloat16
T, V = LoomnbTypeError, LoomnbValueError
ROWS, VOCAB = 3, 16


def make():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((ROWS, VOCAB)).astype(np.float32)
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    return dict(
        logits=logits, probs=probs.astype(np.float32),
        k=np.array([2, 0, 5], np.int32), p=np.array([0.9, 1.0, 0.5], np.float32),
        t=np.array([1.0, 0.0, 0.7], np.float32), mp=np.array([0.1, 0.0, 0.2], np.float32),
        seed=np.array([1, 2, 3], np.int64), off=np.array([0, 4, 8], np.int64),
        pm=rng.random((ROWS, VOCAB)) < 0.3, om=rng.random((ROWS, VOCAB)) < 0.3,
        counts=rng.integers(0, 3, (ROWS, VOCAB)).astype(np.int32),
        rep=np.array([1.2, 1.0, 0.8], np.float32), freq=np.array([0.1, 0.0, 0.5], np.float32),
        pres=np.array([0.2, 0.0, 0.5], np.float32))


# ---------------------------------------------------------------- the ops and their arguments
# op: (input, positional per-row parameters, keyword per-row parameters, what it returns)
ROW_OPS = {
    "top_k_top_p_sampling_from_logits": ("logits", ("top_k", "top_p"), ("temperature", "min_p"),
                                         "sample"),
    "top_k_top_p_sampling_from_probs": ("probs", ("top_k", "top_p"), ("min_p",), "sample"),
    "sampling_from_logits": ("logits", (), ("temperature",), "sample"),
    "sampling_from_probs": ("probs", (), (), "sample"),
    "top_k_sampling_from_probs": ("probs", ("top_k",), (), "sample"),
    "top_p_sampling_from_probs": ("probs", ("top_p",), (), "sample"),
    "min_p_sampling_from_probs": ("probs", ("min_p",), (), "sample"),
    "top_k_mask_logits": ("logits", ("top_k",), (), "mask"),
    "top_k_top_p_mask_logits": ("logits", ("top_k", "top_p"), ("temperature", "min_p"),
                                "processed"),
    "top_k_renorm_probs": ("probs", ("top_k",), (), "renorm"),
    "top_p_renorm_probs": ("probs", ("top_p",), (), "renorm"),
}
SAMPLE_OPS = [op for op, s in ROW_OPS.items() if s[3] == "sample"]
ORDER_OPS = ["top_k_top_p_sampling_from_logits", "top_k_top_p_sampling_from_probs",
             "top_k_top_p_mask_logits"]
PENALTY_OPS = {
    "apply_repetition_penalties_": ("logits", "prompt_mask", "output_mask",
                                    "repetition_penalties"),
    "apply_penalties_": ("logits", "prompt_token_mask", "output_token_counts",
                         "repetition_penalties", "frequency_penalties", "presence_penalties"),
}
ALL_OPS = [*ROW_OPS, *PENALTY_OPS]

# a valid value of each argument (a number for the per-row parameters)
DEFAULT = dict(logits=lambda a: a["logits"], probs=lambda a: a["probs"], top_k=lambda a: 2,
               top_p=lambda a: 0.9, min_p=lambda a: 0.1, prompt_mask=lambda a: a["pm"],
               output_mask=lambda a: a["om"], repetition_penalties=lambda a: a["rep"],
               prompt_token_mask=lambda a: a["pm"], output_token_counts=lambda a: a["counts"],
               frequency_penalties=lambda a: a["freq"], presence_penalties=lambda a: a["pres"])
# per-row parameter: (its dtype, its tensor in make())
PER_ROW = dict(top_k=(np.int32, "k"), top_p=(np.float32, "p"), temperature=(np.float32, "t"),
               min_p=(np.float32, "mp"))


def positional(op):
    return ROW_OPS[op][:1] + ROW_OPS[op][1] if op in ROW_OPS else PENALTY_OPS[op]


def call(op, a, over):
    """``loomnb.<op>`` on valid arguments, with ``over`` (argument name: value) replacing
    them; returns (the call, every NumPy array it passes)."""
    over = dict(over)
    args = [over.pop(n) if n in over else DEFAULT[n](a) for n in positional(op)]
    arrays = [x for x in (*args, *over.values()) if isinstance(x, np.ndarray)]
    return (lambda: getattr(loomnb, op)(*args, **over)), arrays


def msg(op, name, expected, got):
    return "^" + re.escape(f"loomnb.{op}: argument '{name}' must be {expected}; got {got}") + "$"


# ---------------------------------------------------------------- the table, op by op
CASES = []  # (id, op, overrides(a), error, message regex)


def case(what, op, over, exc, match):
    CASES.append((f"{op}: {what}", op, over, exc, match))


def dtype_names(op):
    """The input dtypes ``op`` takes, as its message names them."""
    fp32_only = op == "apply_penalties_" or ROW_OPS.get(op, ("logits",))[0] == "probs"
    return "float32" if fp32_only else "float32 or bfloat16 or float16"


def main_array_cases(op, src):
    m = lambda name, e, g: msg(op, name, e, g)  # noqa: E731
    bad = np.float64 if dtype_names(op) != "float32" else BF16
    case("input dtype", op, lambda a: {src: a[src].astype(bad)}, T,
         m(src, f"of dtype {dtype_names(op)}", f"dtype {np.dtype(bad).name}"))
    case("input int32", op, lambda a: {src: a[src].astype(np.int32)}, T,
         m(src, f"of dtype {dtype_names(op)}", "dtype int32"))
    case("input 1-D", op, lambda a: {src: a[src][0]}, V, m(src, "2-D", "a 1-D array of shape [16]"))
    case("input 3-D", op, lambda a: {src: a[src][:, :, None]}, V,
         m(src, "2-D", "a 3-D array of shape [3, 16, 1]"))
    shape = "of shape [num_rows, vocab_size], 1 <= vocab_size <= 2097152"
    case("vocab_size 0", op, lambda a: {src: a[src][:, :0]}, V, m(src, shape, "shape [3, 0]"))
    case("vocab_size 0, no rows", op, lambda a: {src: a[src][:0, :0]}, V,
         m(src, shape, "shape [0, 0]"))
    case("vocab_size over 2^21", op,
         lambda a: {src: np.broadcast_to(np.float32(0), (1, (1 << 21) + 1))}, V,
         m(src, shape, "shape [1, 2097153]"))
    case("input strided last dim", op, lambda a: {src: a[src][:, ::2]}, V,
         m(src, "contiguous in its last dimension (stride 1)", "strides (16, 2) (in elements)"))
    case("input a list", op, lambda a: {src: a[src].tolist()}, T,
         m(src, "a NumPy array (simulator)", "builtins.list"))


def per_row_cases(op, name):
    m = lambda e, g: msg(op, name, e, g)  # noqa: E731
    dtype, key = PER_ROW[name]
    wrong = np.int64 if dtype is np.int32 else np.float64
    want = np.dtype(dtype).name
    case(f"{name} dtype {np.dtype(wrong).name}", op, lambda a: {name: a[key].astype(wrong)}, T,
         m(f"of dtype {want}", f"dtype {np.dtype(wrong).name}"))
    other = np.float32 if dtype is np.int32 else np.int32
    case(f"{name} dtype {np.dtype(other).name}", op, lambda a: {name: a[key].astype(other)}, T,
         m(f"of dtype {want}", f"dtype {np.dtype(other).name}"))
    case(f"{name} bf16", op, lambda a: {name: a[key].astype(BF16)}, T,
         m(f"of dtype {want}", "dtype bfloat16"))
    case(f"{name} rows", op, lambda a: {name: a[key][:2]}, V,
         m("of shape [3] ([num_rows])", "shape [2]"))
    case(f"{name} one for all rows", op, lambda a: {name: a[key][:1]}, V,
         m("of shape [3] ([num_rows])", "shape [1]"))
    case(f"{name} 2-D", op, lambda a: {name: a[key][:, None]}, V,
         m("of shape [3] ([num_rows])", "shape [3, 1]"))
    case(f"{name} 0-D", op, lambda a: {name: a[key][0, ...]}, V,
         m("of shape [3] ([num_rows])", "shape []"))
    case(f"{name} bool", op, lambda a: {name: True}, T,
         m("a number or a [num_rows] tensor", "True"))
    case(f"{name} str", op, lambda a: {name: "1"}, T,
         m("a number or a [num_rows] tensor", "'1'"))
    case(f"{name} list", op, lambda a: {name: a[key].tolist()}, T,
         m("a NumPy array (simulator)", "builtins.list"))
    if dtype is np.int32:
        case(f"{name} float", op, lambda a: {name: 2.5}, T, m("an int", "2.5"))
        case(f"{name} float of an int", op, lambda a: {name: 2.0}, T, m("an int", "2.0"))
    else:
        case(f"{name} NaN", op, lambda a: {name: float("nan")}, V, m("a number", "nan"))


def seed_cases(op, name, key):
    m = lambda e, g: msg(op, name, e, g)  # noqa: E731
    kind = "an int or an int64 tensor"
    case(f"{name} float", op, lambda a: {name: 1.0}, T, m(kind, "1.0"))
    case(f"{name} bool", op, lambda a: {name: True}, T, m(kind, "True"))
    case(f"{name} str", op, lambda a: {name: "1"}, T, m(kind, "'1'"))
    case(f"{name} beyond 64 bits", op, lambda a: {name: 1 << 64}, V,
         m("an int that fits 64 bits", "18446744073709551616"))
    case(f"{name} below -2^63", op, lambda a: {name: -(1 << 63) - 1}, V,
         m("an int that fits 64 bits", "-9223372036854775809"))
    case(f"{name} int32 tensor", op, lambda a: {name: a[key].astype(np.int32)}, T,
         m("of dtype int64", "dtype int32"))
    case(f"{name} uint64 tensor", op, lambda a: {name: a[key].astype(np.uint64)}, T,
         m("of dtype int64", "dtype uint64"))
    case(f"{name} float tensor", op, lambda a: {name: a[key].astype(np.float64)}, T,
         m("of dtype int64", "dtype float64"))
    case(f"{name} rows", op, lambda a: {name: a[key][:2]}, V,
         m("of shape [num_rows] (3) or [1]", "shape [2]"))
    case(f"{name} empty", op, lambda a: {name: a[key][:0]}, V,
         m("of shape [num_rows] (3) or [1]", "shape [0]"))
    case(f"{name} 2-D", op, lambda a: {name: a[key][:, None]}, V,
         m("1-D", "a 2-D array of shape [3, 1]"))
    case(f"{name} 0-D", op, lambda a: {name: a[key][0, ...]}, V,
         m("1-D", "a 0-D array of shape []"))


def out_cases(op, src, returns):
    m = lambda e, g: msg(op, "out", e, g)  # noqa: E731
    if returns == "sample":
        case("out int64", op, lambda a: {"out": np.zeros(ROWS, np.int64)}, T,
             m("of dtype int32", "dtype int64"))
        case("out uint32", op, lambda a: {"out": np.zeros(ROWS, np.uint32)}, T,
             m("of dtype int32", "dtype uint32"))
        case("out rows", op, lambda a: {"out": np.zeros(ROWS + 1, np.int32)}, V,
             m(f"of shape [3] (from '{src}')", "shape [4]"))
        case("out 2-D", op, lambda a: {"out": np.zeros((ROWS, 1), np.int32)}, V,
             m(f"of shape [3] (from '{src}')", "shape [3, 1]"))
        case("out read-only", op, lambda a: {"out": np.broadcast_to(np.int32(0), (ROWS,))}, V,
             m("a writable array", "a read-only array"))
        # the same buffer, read as int32: overlaps the input (whatever name the message gives it)
        case("out overlaps the input", op, lambda a: {"out": a[src][0, :ROWS].view(np.int32)}, V,
             r"argument 'out' must be a buffer that does not overlap '")
        case("out overlaps seed", op,
             lambda a: {"seed": a["seed"], "out": a["seed"].view(np.int32)[:ROWS]}, V,
             m("a buffer that does not overlap 'seed'",
               "overlapping memory (same address, different element size or strides)"))
        case("out overlaps offset", op,
             lambda a: {"offset": a["off"], "out": a["off"].view(np.int32)[1:ROWS + 1]}, V,
             m("a buffer that does not overlap 'offset'", "overlapping memory"))
    else:
        case("out dtype", op, lambda a: {"out": np.zeros((ROWS, VOCAB), BF16)}, T,
             m("of dtype float32", "dtype bfloat16"))
        case("out float64", op, lambda a: {"out": np.zeros((ROWS, VOCAB), np.float64)}, T,
             m("of dtype float32", "dtype float64"))
        case("out shape", op, lambda a: {"out": np.zeros((ROWS, VOCAB // 2), np.float32)}, V,
             m(f"of shape [3, 16] (from '{src}')", "shape [3, 8]"))
        case("out 1-D", op, lambda a: {"out": np.zeros(ROWS * VOCAB, np.float32)}, V,
             m(f"of shape [3, 16] (from '{src}')", "shape [48]"))
        case("out read-only", op,
             lambda a: {"out": np.broadcast_to(np.float32(0), (ROWS, VOCAB))}, V,
             m("a writable array", "a read-only array"))
        case("out rows overlap each other", op,
             lambda a: {"out": np.lib.stride_tricks.as_strided(
                 np.zeros(64, np.float32), (ROWS, VOCAB), (8 * 4, 4))}, V,
             m("an array whose elements do not overlap each other",
               "shape (3, 16) with strides (8, 1) (in elements)"))
        case("out is the input (not in place)", op, lambda a: {"out": a[src]}, V,
             r"argument 'out' must be a buffer that does not overlap '.*'; got overlapping "
             r"memory \(the same memory\)$")
        case("out overlaps the input", op,
             lambda a: {"out": np.lib.stride_tricks.as_strided(
                 a[src][0, 8:], (ROWS, VOCAB), (VOCAB * 4, 4), writeable=True)}, V,
             r"argument 'out' must be a buffer that does not overlap '.*'; got overlapping memory$")
    if returns == "sample" and "top_k" in ROW_OPS[op][1]:
        case("out is top_k", op, lambda a: {"top_k": a["k"], "out": a["k"]}, V,
             m("a buffer that does not overlap 'top_k'", "overlapping memory (the same memory)"))
    if op == "top_k_top_p_sampling_from_logits":
        case("out overlaps temperature", op,
             lambda a: {"temperature": a["t"], "out": a["t"].view(np.int32)}, V,
             m("a buffer that does not overlap 'temperature'",
               "overlapping memory (the same memory)"))


for _op, (_src, _pos, _kw, _ret) in ROW_OPS.items():
    main_array_cases(_op, _src)
    for _n in (*_pos, *_kw):
        per_row_cases(_op, _n)
    if _ret == "sample":
        seed_cases(_op, "seed", "seed")
        seed_cases(_op, "offset", "off")
        case("seed a NumPy float", _op, lambda a: {"seed": np.float32(1)}, T,
             r"argument 'seed' must be an int or an int64 tensor; got ")
        case("deterministic int", _op, lambda a: {"deterministic": 1}, T,
             msg(_op, "deterministic", "a bool", "1"))
        case("deterministic None", _op, lambda a: {"deterministic": None}, T,
             msg(_op, "deterministic", "a bool", "None"))
        case("generator for NumPy arrays", _op, lambda a: {"generator": object()}, T,
             r"argument 'generator' must be a torch.Generator \(with torch tensors\) or None; "
             r"got <object")
        case("generator with a seed", _op, lambda a: {"generator": "g", "seed": 1}, T,
             r"argument 'generator' must be a torch.Generator \(with torch tensors\) or None; "
             r"got 'g'")
    out_cases(_op, _src, _ret)
for _op in ORDER_OPS:
    for _bad, _got in (("JOINT", "'JOINT'"), ("top_p_first", "'top_p_first'"), ("", "''"),
                       (None, "None"), (0, "0")):
        case(f"filter_apply_order {_got}", _op, lambda a, b=_bad: {"filter_apply_order": b}, V,
             msg(_op, "filter_apply_order", "one of 'top_k_first', 'joint'", _got))
case("top_k_mask_logits bf16 out for fp32", "top_k_mask_logits",
     lambda a: {"logits": a["logits"].astype(BF16), "out": np.zeros((ROWS, VOCAB), np.float32)}, T,
     msg("top_k_mask_logits", "out", "of dtype bfloat16", "dtype float32"))
case("top_k_mask_logits fp16 out for fp16", "top_k_mask_logits",
     lambda a: {"logits": a["logits"].astype(np.float16), "out": np.zeros((ROWS, VOCAB), BF16)}, T,
     msg("top_k_mask_logits", "out", "of dtype float16", "dtype bfloat16"))
case("processed logits fp32 out for bf16", "top_k_top_p_mask_logits",
     lambda a: {"logits": a["logits"].astype(BF16), "out": np.zeros((ROWS, VOCAB), BF16)}, T,
     msg("top_k_top_p_mask_logits", "out", "of dtype float32", "dtype bfloat16"))
# an empty batch still checks its arguments
case("empty batch, top_k rows", "top_k_renorm_probs",
     lambda a: {"probs": a["probs"][:0], "top_k": a["k"][:1]}, V,
     msg("top_k_renorm_probs", "top_k", "of shape [0] ([num_rows])", "shape [1]"))
case("empty batch, dtype", "sampling_from_logits",
     lambda a: {"logits": a["logits"][:0].astype(np.float64)}, T,
     msg("sampling_from_logits", "logits", "of dtype float32 or bfloat16 or float16",
         "dtype float64"))
case("empty batch, seed", "sampling_from_probs",
     lambda a: {"probs": a["probs"][:0], "seed": 1.5}, T,
     msg("sampling_from_probs", "seed", "an int or an int64 tensor", "1.5"))
case("empty batch, out", "top_k_mask_logits",
     lambda a: {"logits": a["logits"][:0], "out": np.zeros((1, VOCAB), np.float32)}, V,
     msg("top_k_mask_logits", "out", "of shape [0, 16] (from 'logits')", "shape [1, 16]"))


# ---------------------------------------------------------------- penalties
def _read_only(x):
    x.flags.writeable = False
    return x


def _overlapping_rows(a):
    return np.lib.stride_tricks.as_strided(a["logits"], (ROWS, VOCAB), (8 * 4, 4), writeable=True)


for _op, _args in PENALTY_OPS.items():
    main_array_cases(_op, "logits")
    mm = lambda name, e, g, op=_op: msg(op, name, e, g)  # noqa: E731
    case("logits read-only", _op,
         lambda a: {"logits": np.broadcast_to(a["logits"][:1], (ROWS, VOCAB))}, V,
         mm("logits", "a writable array", "a read-only array"))
    case("logits flagged read-only", _op,
         lambda a: {"logits": _read_only(a["logits"].copy())}, V,
         mm("logits", "a writable array", "a read-only array"))
    case("logits rows overlap each other", _op, lambda a: {"logits": _overlapping_rows(a)}, V,
         mm("logits", "an array whose elements do not overlap each other",
            "shape (3, 16) with strides (8, 1) (in elements)"))
    shape = "of shape [3, 16] ([num_seqs, vocab_size], the logits' shape)"
    for _n in _args[1:3]:
        _key = {"prompt_mask": "pm", "output_mask": "om", "prompt_token_mask": "pm",
                "output_token_counts": "counts"}[_n]
        _kinds = "int32 or int64" if "counts" in _n else "bool"
        for _bad in ((np.float32, np.int16, np.uint32, bool) if "counts" in _n
                     else (np.uint8, np.int32, np.float32)):
            case(f"{_n} dtype {np.dtype(_bad).name}", _op,
                 lambda a, n=_n, k=_key, b=_bad: {n: a[k].astype(b)}, T,
                 mm(_n, f"of dtype {_kinds}", f"dtype {np.dtype(_bad).name}"))
        case(f"{_n} vocab", _op, lambda a, n=_n, k=_key: {n: a[k][:, :8]}, V,
             mm(_n, shape, "shape [3, 8]"))
        case(f"{_n} rows", _op, lambda a, n=_n, k=_key: {n: a[k][:2]}, V,
             mm(_n, shape, "shape [2, 16]"))
        case(f"{_n} transposed", _op, lambda a, n=_n, k=_key: {n: a[k].T}, V,
             mm(_n, shape, "shape [16, 3]"))
        case(f"{_n} 1-D", _op, lambda a, n=_n, k=_key: {n: a[k].reshape(-1)}, V,
             mm(_n, shape, "shape [48]"))
        case(f"{_n} a list", _op, lambda a, n=_n, k=_key: {n: a[k].tolist()}, T,
             mm(_n, "a NumPy array (simulator)", "builtins.list"))
    for _n in _args[3:]:
        _key = {"repetition_penalties": "rep", "frequency_penalties": "freq",
                "presence_penalties": "pres"}[_n]
        for _bad in (np.float64, BF16, np.float16):
            case(f"{_n} dtype {np.dtype(_bad).name}", _op,
                 lambda a, n=_n, k=_key, b=_bad: {n: a[k].astype(b)}, T,
                 mm(_n, "of dtype float32", f"dtype {np.dtype(_bad).name}"))
        case(f"{_n} rows", _op, lambda a, n=_n, k=_key: {n: a[k][:2]}, V,
             mm(_n, "of shape [3] ([num_seqs])", "shape [2]"))
        case(f"{_n} one for all", _op, lambda a, n=_n, k=_key: {n: a[k][:1]}, V,
             mm(_n, "of shape [3] ([num_seqs])", "shape [1]"))
        case(f"{_n} 2-D", _op, lambda a, n=_n, k=_key: {n: a[k][:, None]}, V,
             mm(_n, "of shape [3] ([num_seqs])", "shape [3, 1]"))
        case(f"{_n} a number", _op, lambda a, n=_n: {n: 1.0}, T,
             mm(_n, "a NumPy array (simulator)", "builtins.float"))
        case(f"{_n} overlaps logits", _op, lambda a, n=_n: {n: a["logits"][1, :ROWS]}, V,
             mm("logits", f"a buffer that does not overlap '{_n}'", "overlapping memory"))
    case("prompt mask overlaps logits", _op,
         lambda a, n=_args[1]: {n: a["logits"].view(np.bool_)[:, :VOCAB]}, V,
         mm("logits", f"a buffer that does not overlap '{_args[1]}'",
            "overlapping memory (same address, different element size or strides)"))

R_ = "apply_repetition_penalties_"
for _kind, _name in ((BF16, "bfloat16"), (np.float16, "float16")):
    case(f"fp32 penalties for {_name} logits", R_,
         lambda a, k=_kind: {"logits": a["logits"].astype(k)}, T,
         msg(R_, "repetition_penalties", f"of dtype {_name}", "dtype float32"))
    case(f"{_name} penalties for fp32 logits", R_,
         lambda a, k=_kind: {"repetition_penalties": a["rep"].astype(k)}, T,
         msg(R_, "repetition_penalties", "of dtype float32", f"dtype {_name}"))
case("bf16 logits, fp16 penalties", R_,
     lambda a: {"logits": a["logits"].astype(BF16),
                "repetition_penalties": a["rep"].astype(np.float16)}, T,
     msg(R_, "repetition_penalties", "of dtype bfloat16", "dtype float16"))
P_ = "apply_penalties_"
case("float16 logits", P_, lambda a: {"logits": a["logits"].astype(np.float16)}, T,
     msg(P_, "logits", "of dtype float32", "dtype float16"))
case("counts are the logits", P_, lambda a: {"output_token_counts": a["logits"].view(np.int32)}, V,
     msg(P_, "logits", "a buffer that does not overlap 'output_token_counts'",
         "overlapping memory (the same memory)"))


@pytest.mark.parametrize("what, op, over, exc, match", CASES, ids=[c[0] for c in CASES])
def test_error_table(what, op, over, exc, match):
    a = make()
    fn, arrays = call(op, a, over(a))
    rejects(fn, exc, match, *a.values(), *arrays)


def test_a_launch_fails_these_tests():
    """The guard is on: a valid call reaches the launch (and fails there), so every row of the
    table that passes raised before it."""
    a = make()
    for op in ALL_OPS:
        fn, _ = call(op, a, {"seed": 1} if op in SAMPLE_OPS else {})
        with pytest.raises(Launched):
            fn()


def test_the_table_covers_every_op_of_the_family():
    import loomnb.ops.sampler as family
    # chain_speculative_sampling's table is test_chain_speculative_contract.py's
    assert sorted(ALL_OPS) == sorted(set(family.__all__) - {"chain_speculative_sampling"})
    whats = {op: {c[0].split(": ", 1)[1] for c in CASES if c[1] == op} for op in ALL_OPS}
    for op, have in whats.items():
        need = {"input dtype", "input 1-D", "vocab_size 0", "input strided last dim"}
        if op in ROW_OPS:
            src, pos, kw, ret = ROW_OPS[op]
            need |= {"out read-only", "out overlaps the input"} | {f"{n} rows" for n in (*pos, *kw)}
            need |= {f"{n} bool" for n in (*pos, *kw)}
            if ret == "sample":
                need |= {"seed float", "seed beyond 64 bits", "seed rows", "offset int32 tensor",
                         "deterministic int"}
            if op in ORDER_OPS:
                need.add("filter_apply_order 'JOINT'")
        else:
            need |= {"logits read-only"} | {f"{n} rows" for n in PENALTY_OPS[op][1:]}
        assert need <= have, (op, sorted(need - have))


# ---------------------------------------------------------------- empty batches: no-ops
@pytest.mark.parametrize("tensors", [False, True], ids=["numbers", "tensors"])
@pytest.mark.parametrize("op", ALL_OPS)
def test_an_empty_batch_is_a_noop(op, tensors):
    a = make()
    e = {k: v[:0] for k, v in a.items()}
    over = {n: e[n] for n in ("logits", "probs") if n in positional(op)}
    if op in PENALTY_OPS:
        over.update({n: DEFAULT[n](e) for n in PENALTY_OPS[op][1:]})
    else:
        src, pos, kw, ret = ROW_OPS[op]
        if tensors:
            over.update({n: e[PER_ROW[n][1]] for n in (*pos, *kw)})
            if ret == "sample":
                over.update(seed=e["seed"], offset=e["off"])
        elif ret == "sample":
            over.update(seed=7, offset=3)
    fn, _ = call(op, a, over)
    before = [x.copy() for x in a.values()]
    res = fn()
    assert all(np.array_equal(x, y) for x, y in zip(a.values(), before))
    if op == "apply_repetition_penalties_":
        assert res is None
    elif op == "apply_penalties_":
        assert res is over["logits"]
    else:
        ret = ROW_OPS[op][3]
        want = ((0,), np.int32) if ret == "sample" else ((0, VOCAB), np.float32)
        assert isinstance(res, np.ndarray), type(res)
        assert (res.shape, res.dtype) == want, (res.shape, res.dtype)


@pytest.mark.parametrize("op", list(ROW_OPS))
def test_an_empty_batch_fills_and_returns_out(op):
    a = make()
    src, _, _, ret = ROW_OPS[op]
    out = np.zeros((0,), np.int32) if ret == "sample" else np.zeros((0, VOCAB), np.float32)
    fn, _ = call(op, a, {src: a[src][:0], "out": out})
    assert fn() is out


def test_an_empty_batch_keeps_the_logits_dtype_and_draws_its_own_seed():
    a = make()
    for kind in (BF16, np.float16):
        x = a["logits"][:0].astype(kind)
        y = loomnb.top_k_mask_logits(x, 2)
        assert y.shape == (0, VOCAB) and y.dtype == np.dtype(kind)
        loomnb.apply_repetition_penalties_(x, a["pm"][:0], a["om"][:0], a["rep"][:0].astype(kind))
        assert loomnb.sampling_from_logits(x).shape == (0,)  # no seed: one drawn, nothing launched
    x = a["logits"][:0, ::2]  # no rows: the row layout does not matter
    ids = loomnb.top_k_top_p_sampling_from_logits(x, 2, 0.5, filter_apply_order="joint")
    assert ids.shape == (0,)


# ---------------------------------------------------------------- bounds and names
@pytest.mark.parametrize("op", [op for op, s in ROW_OPS.items() if "top_k" in s[1]])
def test_top_k_beyond_64_bits_is_rejected_before_launch(op):
    a = make()
    fn, _ = call(op, a, {"top_k": 1 << 64})
    rejects(fn, V, r"argument 'top_k' must be an int32 value", *a.values())


@pytest.mark.parametrize("op", ["top_k_mask_logits", "top_k_renorm_probs",
                                "top_k_top_p_sampling_from_logits"])
def test_overlap_message_names_the_input_argument(op):
    a = make()
    src, _, _, ret = ROW_OPS[op]
    out = a[src][0, :ROWS].view(np.int32) if ret == "sample" else a[src]
    fn, _ = call(op, a, {"out": out})
    rejects(fn, V, rf"argument 'out' must be a buffer that does not overlap '{src}'", *a.values())
