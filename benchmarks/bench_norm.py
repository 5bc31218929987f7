"""RMSNorm-family benchmark: loomnb vs vLLM's CUDA ops, torch eager / torch.compile, Liger-Kernel.

    python3 benchmarks/bench_norm.py --vllm-lib /path/to/vllm/_C_stable_libtorch.abi3.so
    python3 benchmarks/bench_norm.py --dry-run     # no GPU: fake timings, real plumbing and files
    python3 benchmarks/bench_norm.py --device cpu --providers torch --num-tokens 1,8 \
        --hidden-sizes 256                         # CPU smoke test of the real path (times: noise)

Only the family's parts live here (ops, bytes model, inputs, the torch composites, the loomnb and
Liger bindings); the command line, providers' setup, the vLLM binding, timing, exactness, the
sweep and result files are ``_harness.run``. README.md says what each number means.
"""

from __future__ import annotations

import math
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
import torch  # noqa: E402

FP8_MAX = 448.0
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
STATIC_SCALE = 0.01  # |rms_norm(x)*w| reaches ~6, so some values saturate at 448: clamp path runs
ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _op(name, reads, writes, quant=False):
    return H.Op(name, reads, writes, extra={"quant": quant})


OPS = {op.name: op for op in [
    _op("rms_norm", ("x", "weight"), ("out",)),
    _op("fused_add_rms_norm", ("x", "residual", "weight"), ("x", "residual")),
    _op("rms_norm_dynamic_per_token_quant", ("x", "weight"), ("out", "scales"), quant=True),
    _op("rms_norm_static_fp8_quant", ("x", "weight", "scale"), ("out",), quant=True),
    _op("fused_add_rms_norm_static_fp8_quant", ("x", "residual", "weight", "scale"),
        ("out", "residual"), quant=True),
]}


def role_shape(role: str, nt: int, h: int) -> tuple[int, ...]:
    return {"weight": (h,), "scales": (nt, 1), "scale": (1,)}.get(role, (nt, h))


def role_dtype(op, role: str, act: str) -> str:
    if role in ("scale", "scales"):
        return "fp32"
    return "fp8" if role == "out" and op.extra["quant"] else act


def op_bytes(op, nt: int, h: int, act: str = "bf16") -> int:
    """Bytes the op must move: each read tensor once plus each written tensor once."""
    return sum(math.prod(role_shape(r, nt, h)) * ELEM_BYTES[role_dtype(op, r, act)]
               for r in op.reads + op.writes)


def make_inputs(op, nt: int, h: int, act: str, device, seed: int) -> dict:
    """Fresh tensors for one call (inputs random; outputs preallocated, uninitialised)."""
    g = torch.Generator(device=device).manual_seed(seed)
    dt = TORCH_DTYPES[act]
    t = {"x": torch.randn(nt, h, generator=g, device=device, dtype=dt),
         "weight": (1 + 0.25 * torch.randn(h, generator=g, device=device)).to(dt)}
    if "residual" in op.reads:
        t["residual"] = torch.randn(nt, h, generator=g, device=device, dtype=dt)
    if "scale" in op.reads:
        t["scale"] = torch.full((1,), STATIC_SCALE, dtype=torch.float32, device=device)
    if "out" in op.writes:
        t["out"] = torch.empty(nt, h, device=device,
                               dtype=torch.float8_e4m3fn if op.extra["quant"] else dt)
    if "scales" in op.writes:
        t["scales"] = torch.empty(nt, 1, device=device, dtype=torch.float32)
    return t


# ---------------------------------------------------------------- torch composites (the spec)
def _rms(x, w, eps):
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * inv).to(x.dtype) * w


def t_rms_norm(x, w, eps):
    return _rms(x, w, eps)


def t_fused_add(x, r, w, eps):
    z = x + r
    r.copy_(z)
    x.copy_(_rms(z, w, eps))
    return x, r


def t_dynamic_quant(x, w, eps):
    y = _rms(x, w, eps)
    scale = torch.clamp(y.abs().amax(-1, keepdim=True).float() / FP8_MAX, min=FP8_MIN_SCALE)
    return (y.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def t_static_quant(x, w, scale, eps):
    y = _rms(x, w, eps)
    return (y.float() * (1 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def t_fused_static_quant(x, r, w, scale, eps):
    z = x + r
    r.copy_(z)
    return t_static_quant(z, w, scale, eps), r


# ---------------------------------------------------------------- providers
# bind(op, t, case) -> (call, collect): `call` is the bare callable that is timed; collect(ret)
# maps its return value to {output role: tensor} (for in-place ops: the mutated inputs).
class Loomnb(H.LoomnbProvider):
    """loomnb's ops with preallocated outputs (as vLLM's), ``rounding`` as --rounding."""

    def setup(self, args, log):
        self.rounding = getattr(args, "rounding", "twice")
        return super().setup(args, log)

    def bind(self, op, t, case):
        fn = getattr(self.m, op.name, None)
        if fn is None:
            raise H.NotAvailable(f"loomnb has no {op.name}")
        x, w, eps = t["x"], t["weight"], case["eps"]
        inplace = lambda _: {k: t[k] for k in op.writes}  # noqa: E731
        if op.name == "rms_norm":
            return partial(fn, x, w, eps, out=t["out"], rounding=self.rounding), lambda r: {"out": r}
        if op.name == "fused_add_rms_norm":
            return partial(fn, x, t["residual"], w, eps, rounding=self.rounding), inplace
        if op.name == "rms_norm_dynamic_per_token_quant":
            return (partial(fn, x, w, eps, out=t["out"], scales=t["scales"]),
                    lambda r: {"out": r[0], "scales": r[1]})
        if op.name == "rms_norm_static_fp8_quant":
            return partial(fn, x, w, t["scale"], eps, out=t["out"]), inplace
        return partial(fn, x, t["residual"], w, t["scale"], eps, out=t["out"]), inplace


class Torch(H.Provider):
    """Eager composites with the same rounding points as vLLM (the functions above)."""
    name = "torch"
    FNS = {"rms_norm": t_rms_norm, "fused_add_rms_norm": t_fused_add,
           "rms_norm_dynamic_per_token_quant": t_dynamic_quant,
           "rms_norm_static_fp8_quant": t_static_quant,
           "fused_add_rms_norm_static_fp8_quant": t_fused_static_quant}

    def fn(self, op):
        return self.FNS[op.name]

    def bind(self, op, t, case):
        fn, x, w, eps = self.fn(op), t["x"], t["weight"], case["eps"]
        if op.name == "rms_norm":
            return partial(fn, x, w, eps), lambda r: {"out": r}
        if op.name == "fused_add_rms_norm":
            return partial(fn, x, t["residual"], w, eps), lambda r: {"x": r[0], "residual": r[1]}
        if op.name == "rms_norm_dynamic_per_token_quant":
            return partial(fn, x, w, eps), lambda r: {"out": r[0], "scales": r[1]}
        if op.name == "rms_norm_static_fp8_quant":
            return partial(fn, x, w, t["scale"], eps), lambda r: {"out": r}
        return (partial(fn, x, t["residual"], w, t["scale"], eps),
                lambda r: {"out": r[0], "residual": r[1]})


class Liger(H.Provider):
    """Liger-Kernel 0.8.5 forward functions (not the autograd.Function), casting_mode="llama"
    (rstd in fp32, x*rstd rounded to the input dtype before *weight), offset 0. Both allocate
    their outputs; the fused add is out of place (new Y and S, same bytes moved)."""
    name = "liger"

    def setup(self, args, log):
        try:
            from liger_kernel.ops.fused_add_rms_norm import fused_add_rms_norm_forward
            from liger_kernel.ops.rms_norm import rms_norm_forward
        except Exception as e:  # noqa: BLE001
            return f"import liger_kernel failed: {e!r}"
        self.rms, self.fused = rms_norm_forward, fused_add_rms_norm_forward

    def unsupported(self, case):
        if case["op"] not in ("rms_norm", "fused_add_rms_norm"):
            return "Liger-Kernel 0.8.5 has no RMSNorm + FP8-quant op"

    def bind(self, op, t, case):
        x, w, eps = t["x"], t["weight"], case["eps"]
        if op.name == "rms_norm":
            return partial(self.rms, x, w, eps, 0.0, "llama", None), lambda r: {"out": r[0]}
        return (partial(self.fused, x, t["residual"], w, eps, 0.0, "llama"),
                lambda r: {"x": r[0], "residual": r[1]})


class Vllm(H.VllmProvider):
    pass


PROVIDERS = {p.name: p for p in (Loomnb, Vllm, Torch, H.compiled(Torch), Liger)}
# vLLM schema argument name -> keys of the inputs dict (first present wins; "scale" is the
# scales output of the dynamic op and the scale input of the static ones).
VLLM_ALIASES = {"result": ("out",), "out": ("out",), "output": ("out",), "input": ("x",),
                "residual": ("residual",), "weight": ("weight",), "scale": ("scales", "scale"),
                "scales": ("scales", "scale"), "epsilon": ("eps",), "scale_ub": ("scale_ub",)}


class NormFamily(H.Family):
    name = "norm"
    ops = OPS
    providers = PROVIDERS
    shape_axes = [("--hidden-sizes", "hidden_size", [4096], "default 4096")]
    vllm_aliases = VLLM_ALIASES
    bytes_model = ("every read tensor once + every written tensor once; fp8 1 B/elem, "
                   "scales 4 B/row, static scale 4 B")
    fake = {"loomnb": (2.4, 4300.0), "vllm": (2.6, 4200.0), "torch": (18.0, 2500.0),
            "torch_compile": (3.5, 3900.0), "liger": (4.0, 3800.0)}  # (floor µs, GB/s)

    def add_arguments(self, p):
        p.add_argument("--eps", type=float, default=1e-6)
        p.add_argument("--rounding", choices=["twice", "once"], default="twice",
                       help="loomnb's rounding mode (once: vLLM 0.24's compiled ops)")

    def scalars_of_args(self, args):
        return {"eps": args.eps}

    def scalars(self, case):
        return {"eps": case["eps"]}

    def shape_label(self, case):
        return f"hidden {case['hidden_size']}"

    def op_bytes(self, op, case):
        return op_bytes(op, case["num_tokens"], case["hidden_size"], case["dtype"])

    def make_inputs(self, op, case, device, seed):
        return make_inputs(op, case["num_tokens"], case["hidden_size"], case["dtype"], device, seed)


FAMILY = NormFamily()


def parse_args(argv=None):
    return H.parse_args(FAMILY, argv)


def main(argv=None) -> Path:
    return H.run(FAMILY, argv)


if __name__ == "__main__":
    main()
