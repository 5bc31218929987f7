"""Activation-family benchmark: silu_and_mul, the fused SiLU + per-token-group FP8 op and the
standalone FP8 quantisers -- loomnb vs vLLM's compiled ops, FlashInfer, torch eager,
torch.compile and Liger-Kernel.

    python3 benchmarks/bench_activation.py --vllm-lib /path/to/vllm/_C_stable_libtorch.abi3.so
    python3 benchmarks/bench_activation.py --quick        # 1, 128, 4096 tokens, d = 11008
    python3 benchmarks/bench_activation.py --dry-run      # no GPU: fake timings, real plumbing/files

Cases: num_tokens 1, 8, 32, 128, 1024, 4096 x d = 11008 and 14336 (the intermediate sizes of
Llama-2-7B and Llama-3-8B), bf16. ``d`` is each op's *output* row: ``silu_and_mul`` and the
fused op read ``x [T, 2d]``; the quantisers read the activation ``x [T, d]``. Group size 128.

Providers (each skips with a logged reason when it cannot load):

* ``loomnb``: preallocated outputs, the eager fast path;
* ``vllm``: vLLM 0.24's compiled ops bound by schema names (``silu_and_mul``,
  ``per_token_group_fp8_quant``, ``dynamic_per_token_scaled_fp8_quant``,
  ``static_scaled_fp8_quant``, ``dynamic_scaled_fp8_quant`` -- preceded by zeroing its scale,
  as vLLM's ``scaled_fp8_quant`` does); the fused op is vLLM's two ops, ``silu_and_mul`` into a
  buffer then ``per_token_group_fp8_quant``: the unfused path, whose bytes it equals;
* ``vllm_per_block``: vLLM's fused ``silu_and_mul_per_block_quant`` (fp32 numerics: it differs
  from the unfused path on a few percent of bytes; fused op only);
* ``flashinfer``: FlashInfer 0.6.12's ``silu_and_mul`` (JIT-compiled at first use);
* ``torch`` / ``torch_compile``: the eager composites with vLLM's rounding points, and the same
  through ``torch.compile`` (default mode, static shapes);
* ``liger``: ``LigerSiLUMulFunction`` on the two halves, passed as two contiguous tensors (its
  kernel indexes both halves with the output's row stride); silu_and_mul only.
* ``loomnb_u2`` (``--tune``): loomnb with ``activation.LARGE_CHUNK_UPT = SMALL_CHUNK_UPT = 2``,
  i.e. 2 units of 8 a thread in the chunked kernels at every size (the default holds 1 up to
  ``SMALL_WORK`` units and 4 from ``LARGE_WORK`` on).

Bytes model: every read tensor once and every written tensor once (``x``; ``out`` in the
activation dtype or FP8; scales 4 B each). ``dynamic_scaled_fp8_quant`` must read ``x`` twice
(a global amax first) but is counted once, like every op: its % of copy bandwidth is the
fraction of a one-pass quantiser's speed (loomnb's last pass walks the rows backwards, so
what is left of ``x`` in L2 is read first).
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
GROUP = 128
EPS = 1e-10
STATIC_SCALE = 0.005  # |x| ~ N(0, 1) up to ~5: values above 2.24 clamp at 448, so the clamp runs
ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _op(name, reads, writes, quant, gated=False, vllm_name=""):
    return H.Op(name, reads, writes, vllm_name=vllm_name, extra={"quant": quant, "gated": gated})


OPS = {op.name: op for op in [
    _op("silu_and_mul", ("x",), ("out",), None, gated=True),
    _op("silu_and_mul_per_token_group_quant_fp8", ("x",), ("out", "scales"), "group", gated=True,
        vllm_name="silu_and_mul"),  # vLLM: silu_and_mul, then per_token_group_fp8_quant
    _op("per_token_group_quant_fp8", ("x",), ("out", "scales"), "group",
        vllm_name="per_token_group_fp8_quant"),
    _op("dynamic_per_token_scaled_fp8_quant", ("x",), ("out", "scales"), "token"),
    _op("static_scaled_fp8_quant", ("x", "scale"), ("out",), "static"),
    _op("dynamic_scaled_fp8_quant", ("x",), ("out", "scale"), "tensor"),
]}


def role_shape(op, role: str, nt: int, d: int) -> tuple[int, ...]:
    if role == "x":
        return (nt, 2 * d) if op.extra["gated"] else (nt, d)
    if role == "scales":
        return (nt, d // GROUP) if op.extra["quant"] == "group" else (nt, 1)
    if role == "scale":
        return (1,)
    return (nt, d)


def role_dtype(op, role: str, act: str) -> str:
    if role in ("scale", "scales"):
        return "fp32"
    return "fp8" if role == "out" and op.extra["quant"] else act


def op_bytes(op, nt: int, d: int, act: str = "bf16") -> int:
    """Bytes the op must move: each read tensor once plus each written tensor once."""
    return sum(math.prod(role_shape(op, r, nt, d)) * ELEM_BYTES[role_dtype(op, r, act)]
               for r in op.reads + op.writes)


def make_inputs(op, nt: int, d: int, act: str, device, seed: int) -> dict:
    """Fresh tensors for one call: ``x`` random; outputs preallocated (uninitialised, but the
    per-tensor scale zeroed: vLLM's op folds its atomic max into it)."""
    g = torch.Generator(device=device).manual_seed(seed)
    t = {"x": torch.randn(role_shape(op, "x", nt, d), generator=g, device=device,
                          dtype=TORCH_DTYPES[act])}
    for role in op.writes + tuple(r for r in op.reads if r != "x"):
        dt = role_dtype(op, role, act)
        shape = role_shape(op, role, nt, d)
        if role == "scale" and "scale" in op.reads:
            t[role] = torch.full(shape, STATIC_SCALE, dtype=torch.float32, device=device)
        elif role == "scale":
            t[role] = torch.zeros(shape, dtype=torch.float32, device=device)
        elif dt == "fp8":
            t[role] = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
        elif dt == "fp32":
            t[role] = torch.empty(shape, dtype=torch.float32, device=device)
        else:
            t[role] = torch.empty(shape, dtype=TORCH_DTYPES[act], device=device)
    return t


# ---------------------------------------------------------------- torch composites (the spec)
def t_silu_and_mul(x):
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def t_group_quant(y, group=GROUP, eps=EPS):
    t, d = y.shape
    yf = y.float().view(t, d // group, group)
    s = yf.abs().amax(-1, keepdim=True).clamp(min=eps) / FP8_MAX
    q = (yf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(t, d), s.squeeze(-1)


def t_fused(x):
    return t_group_quant(t_silu_and_mul(x))


def t_per_token(x):
    xf = x.float()
    s = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def t_static(x, scale):
    return (x.float() * (1 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def t_per_tensor(x):
    s = (x.abs().amax().float() / FP8_MAX).reshape(1)
    return (x.float() * (1 / s)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


# ---------------------------------------------------------------- providers
# bind(op, t, case) -> (call, collect): ``call`` is the bare callable that is timed;
# collect(ret) maps its return value to {output role: tensor}.
def _written(t, op):
    return lambda _: {k: t[k] for k in op.writes}


class Loomnb(H.LoomnbProvider):
    """loomnb's ops with preallocated outputs (as vLLM's)."""

    def bind(self, op, t, case):
        m, x = self.m, t["x"]
        if op.name == "silu_and_mul":
            return partial(m.silu_and_mul, x, out=t["out"]), lambda r: {"out": r}
        if op.name == "silu_and_mul_per_token_group_quant_fp8":
            return (partial(m.silu_and_mul_per_token_group_quant_fp8, x, GROUP, EPS,
                            out_q=t["out"], out_s=t["scales"]), _written(t, op))
        if op.name == "per_token_group_quant_fp8":
            return (partial(m.per_token_group_quant_fp8, x, GROUP, EPS, out_q=t["out"],
                            out_s=t["scales"]), _written(t, op))
        if op.name == "dynamic_per_token_scaled_fp8_quant":
            return (partial(m.dynamic_per_token_scaled_fp8_quant, x, out=t["out"],
                            scales=t["scales"]), _written(t, op))
        if op.name == "static_scaled_fp8_quant":
            return partial(m.static_scaled_fp8_quant, x, t["scale"], out=t["out"]), _written(t, op)
        return (partial(m.dynamic_scaled_fp8_quant, x, out=t["out"], scale=t["scale"]),
                _written(t, op))


class Torch(H.Provider):
    """Eager composites with vLLM's rounding points (the functions above)."""
    name = "torch"
    FNS = {"silu_and_mul": t_silu_and_mul, "silu_and_mul_per_token_group_quant_fp8": t_fused,
           "per_token_group_quant_fp8": t_group_quant,
           "dynamic_per_token_scaled_fp8_quant": t_per_token, "static_scaled_fp8_quant": t_static,
           "dynamic_scaled_fp8_quant": t_per_tensor}

    def fn(self, op):
        return self.FNS[op.name]

    def bind(self, op, t, case):
        fn, x = self.fn(op), t["x"]
        if op.name == "silu_and_mul":
            return partial(fn, x), lambda r: {"out": r}
        if op.name == "static_scaled_fp8_quant":
            return partial(fn, x, t["scale"]), lambda r: {"out": r}
        role = "scale" if op.name == "dynamic_scaled_fp8_quant" else "scales"
        return partial(fn, x), lambda r: {"out": r[0], role: r[1]}


# vLLM schema argument name -> keys of the inputs dict (first present wins: "scale" is the
# static quant's input, the per-token quant's scales output, the per-tensor quant's output).
VLLM_ALIASES = {"result": ("out",), "out": ("out",), "output": ("out",), "input": ("x",),
                "output_q": ("out",), "output_s": ("scales",), "scale": ("scales", "scale"),
                "scales": ("scales",)}
GROUP_SCALARS = {"group_size": GROUP, "eps": EPS, "fp8_min": -FP8_MAX, "fp8_max": FP8_MAX,
                 "scale_ue8m0": False, "dummy_is_scale_transposed": False,
                 "dummy_is_tma_aligned": False}


class Vllm(H.VllmProvider):
    """vLLM's compiled ops by schema names; the fused op is its two unfused ops in sequence,
    the per-tensor quant zeroes its scale first (both as vLLM's Python wrappers run them). An op
    whose schema cannot be bound is n/a (logged with the schema), not an error."""

    def _bound(self, name, values, required, label):
        try:
            packet = getattr(self.ns, name)
            schema = packet.default._schema
        except (AttributeError, RuntimeError) as e:
            raise H.NotAvailable(f"torch.ops.{self.family.vllm_ns}.{name} missing: {e}") from e
        try:
            args, kwargs, desc = H.bind_schema(schema, values, required, VLLM_ALIASES)
        except TypeError as e:
            raise H.NotAvailable(f"cannot bind {schema}: {e}") from e
        if label not in self.bindings:
            self.log(f"[{self.name}] {label}: {name}({desc})")
            self.bindings[label] = f"{name}({desc})"
        return partial(packet, *args, **kwargs)

    def bind(self, op, t, case):
        x, out = t["x"], t["out"]
        if op.name == "silu_and_mul":
            return self._bound("silu_and_mul", {"out": out, "x": x}, ("x", "out"), op.name), _written(t, op)
        if op.name == "silu_and_mul_per_token_group_quant_fp8":
            tmp = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
            act = self._bound("silu_and_mul", {"out": tmp, "x": x}, ("x", "out"), op.name + " [1/2]")
            quant = self._bound("per_token_group_fp8_quant",
                                {"x": tmp, "out": out, "scales": t["scales"], **GROUP_SCALARS},
                                ("x", "out", "scales", "group_size", "eps"), op.name + " [2/2]")

            def both():
                act()
                quant()

            return both, _written(t, op)
        if op.name == "per_token_group_quant_fp8":
            return (self._bound(op.vllm, {"x": x, "out": out, "scales": t["scales"], **GROUP_SCALARS},
                                ("x", "out", "scales", "group_size", "eps"), op.name), _written(t, op))
        if op.name == "dynamic_per_token_scaled_fp8_quant":
            return (self._bound(op.vllm, {"x": x, "out": out, "scales": t["scales"]},
                                ("x", "out", "scales"), op.name), _written(t, op))
        if op.name == "static_scaled_fp8_quant":
            return (self._bound(op.vllm, {"x": x, "out": out, "scale": t["scale"]},
                                ("x", "out", "scale"), op.name), _written(t, op))
        call = self._bound(op.vllm, {"x": x, "out": out, "scale": t["scale"]}, ("x", "out", "scale"),
                           op.name)
        scale = t["scale"]

        def zeroed():  # vLLM's scaled_fp8_quant allocates the scale with torch.zeros
            scale.zero_()
            call()

        return zeroed, _written(t, op)


class VllmPerBlock(Vllm):
    """vLLM's fused ``silu_and_mul_per_block_quant`` (float32 SiLU * up, scale floored at
    1e-10: not the unfused path's numerics), row-major scales, no scale_ub."""
    name = "vllm_per_block"

    def setup(self, args, log):
        reason = super().setup(args, log)
        if reason is None:
            try:
                log(f"[{self.name}] schema {self.ns.silu_and_mul_per_block_quant.default._schema}")
            except (AttributeError, RuntimeError) as e:
                log(f"[{self.name}] MISSING silu_and_mul_per_block_quant: {e}")
        return reason

    def unsupported(self, case):
        if case["op"] != "silu_and_mul_per_token_group_quant_fp8":
            return "vLLM's fused per-block quant is the fused op only"

    def bind(self, op, t, case):
        call = self._bound("silu_and_mul_per_block_quant",
                           {"out": t["out"], "x": t["x"], "scales": t["scales"], "group_size": GROUP,
                            "is_scale_transposed": False},
                           ("x", "out", "scales", "group_size"), "silu_and_mul_per_block_quant")
        return call, _written(t, op)


class FlashInfer(H.Provider):
    """FlashInfer 0.6.12's ``silu_and_mul(input, out)`` (JIT-compiled at first use)."""
    name = "flashinfer"

    def setup(self, args, log):
        try:
            import flashinfer
            self.fn = getattr(flashinfer, "silu_and_mul", None) or flashinfer.activation.silu_and_mul
        except Exception as e:  # noqa: BLE001
            return f"import flashinfer failed: {e!r}"

    def unsupported(self, case):
        if case["op"] != "silu_and_mul":
            return "FlashInfer 0.6.12 has no such op"

    def bind(self, op, t, case):
        return partial(self.fn, t["x"], out=t["out"]), lambda r: {"out": t["out"]}


class Liger(H.Provider):
    """Liger-Kernel 0.8.5 ``LigerSiLUMulFunction.apply(gate, up)`` on two contiguous halves
    (made outside the timed call; the bytes moved are the same)."""
    name = "liger"

    def setup(self, args, log):
        try:
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        except Exception as e:  # noqa: BLE001
            return f"import liger_kernel failed: {e!r}"
        self.fn = LigerSiLUMulFunction.apply

    def unsupported(self, case):
        if case["op"] != "silu_and_mul":
            return "Liger-Kernel 0.8.5 has no FP8 quantiser"

    def bind(self, op, t, case):
        x = t["x"]
        d = x.shape[-1] // 2
        g, u = x[:, :d].contiguous(), x[:, d:].contiguous()
        return partial(self.fn, g, u), lambda r: {"out": r}


_A = "loomnb.ops.activation"
TUNED = [H.tuned(Loomnb, _A, "u2", LARGE_CHUNK_UPT=2, SMALL_CHUNK_UPT=2),  # --tune: 2 units a thread at every size
         H.tuned(Loomnb, _A, "units", SMALL_LAYOUT_WORK=-1),      # never the small layout
         H.tuned(Loomnb, _A, "small", SMALL_LAYOUT_WORK=2 ** 40)]  # the small layout wherever it applies
PROVIDERS = {p.name: p for p in (Loomnb, Vllm, VllmPerBlock, FlashInfer, Torch,
                                 H.compiled(Torch), Liger, *TUNED)}


class ActivationFamily(H.Family):
    name = "activation"
    ops = OPS
    providers = PROVIDERS
    x_default = [1, 8, 32, 128, 1024, 4096]
    x_quick = [1, 128, 4096]
    shape_axes = [("--d", "d", [11008, 14336], "output row lengths d (default 11008,14336)")]
    vllm_aliases = VLLM_ALIASES
    bytes_model = ("every read tensor once + every written tensor once: x ([T, 2d] for "
                   "silu_and_mul and the fused op, [T, d] for the quantisers), out (bf16 or "
                   "fp8), scales 4 B each; dynamic_scaled_fp8_quant reads x twice but is "
                   "counted once")
    fake = {"loomnb": (2.0, 4100.0), "loomnb_u2": (2.0, 4000.0), "vllm": (2.8, 3000.0), "vllm_per_block": (4.0, 1000.0),
            "flashinfer": (2.8, 3900.0), "torch": (9.0, 1200.0), "torch_compile": (1.3, 4200.0),
            "liger": (2.6, 4100.0)}  # (floor µs, GB/s) for --dry-run

    def shape_label(self, case):
        return f"d {case['d']}"

    def op_bytes(self, op, case):
        return op_bytes(op, case["num_tokens"], case["d"], case["dtype"])

    def make_inputs(self, op, case, device, seed):
        return make_inputs(op, case["num_tokens"], case["d"], case["dtype"], device, seed)


FAMILY = ActivationFamily()
DEFAULTS = ["--target-ms", "1", "--repeats", "9"]  # a lean default sweep (~4 min on an H200)


def _with_defaults(argv):
    """This family's defaults on top of the harness's: a leaner timing (``DEFAULTS``), and
    ``--quick`` also means d = 11008 only."""
    argv = list(sys.argv[1:] if argv is None else argv)
    quick = "--quick" in argv
    for flag, value in zip(DEFAULTS[::2], DEFAULTS[1::2]):
        if flag not in argv and not quick:
            argv += [flag, value]
    if quick and "--d" not in argv:
        argv += ["--d", "11008"]
    return argv


def parse_args(argv=None):
    return H.parse_args(FAMILY, _with_defaults(argv))


def main(argv=None) -> Path:
    return H.run(FAMILY, _with_defaults(argv))


if __name__ == "__main__":
    main()
