"""RMSNorm-family benchmark: loomnb vs vLLM's CUDA ops, torch eager / torch.compile, Liger-Kernel.

    python3 benchmarks/bench_norm.py --vllm-lib /path/to/vllm/_C_stable_libtorch.abi3.so
    python3 benchmarks/bench_norm.py --dry-run     # no GPU: fake timings, real plumbing and files
    python3 benchmarks/bench_norm.py --device cpu --providers torch --num-tokens 1,8 \
        --hidden-sizes 256                         # CPU smoke test of the real path (times: noise)

Only the op-specific parts live here (ops, bytes model, inputs, providers); timing, exactness,
the sweep and result files are in _harness.py. README.md says what each number means.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
from dataclasses import dataclass
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
VLLM_NS = "_C"
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------- ops and the bytes model
@dataclass(frozen=True)
class Op:
    name: str
    reads: tuple[str, ...]   # tensors the op must read (once)
    writes: tuple[str, ...]  # tensors it must write: also the outputs compared with the reference
    quant: bool = False      # "out" is fp8 e4m3


OPS = {op.name: op for op in [
    Op("rms_norm", ("x", "weight"), ("out",)),
    Op("fused_add_rms_norm", ("x", "residual", "weight"), ("x", "residual")),
    Op("rms_norm_dynamic_per_token_quant", ("x", "weight"), ("out", "scales"), quant=True),
    Op("rms_norm_static_fp8_quant", ("x", "weight", "scale"), ("out",), quant=True),
    Op("fused_add_rms_norm_static_fp8_quant", ("x", "residual", "weight", "scale"),
       ("out", "residual"), quant=True),
]}


def role_shape(role: str, nt: int, h: int) -> tuple[int, ...]:
    return {"weight": (h,), "scales": (nt, 1), "scale": (1,)}.get(role, (nt, h))


def role_dtype(op: Op, role: str, act: str) -> str:
    if role in ("scale", "scales"):
        return "fp32"
    return "fp8" if role == "out" and op.quant else act


def op_bytes(op: Op, nt: int, h: int, act: str = "bf16") -> int:
    """Bytes the op must move: each read tensor once plus each written tensor once."""
    return sum(math.prod(role_shape(r, nt, h)) * ELEM_BYTES[role_dtype(op, r, act)]
               for r in op.reads + op.writes)


def make_inputs(op: Op, nt: int, h: int, act: str, device, seed: int) -> dict:
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
                               dtype=torch.float8_e4m3fn if op.quant else dt)
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
# bind(op, t, eps) -> (call, collect): `call` is the bare callable that is timed; collect(ret)
# maps its return value to {output role: tensor} (for in-place ops: the mutated inputs).
class Loomnb(H.Provider):
    name = "loomnb"

    def setup(self, args, log):
        try:
            import loomnb
        except Exception as e:  # noqa: BLE001
            return f"import loomnb failed: {e!r}"
        self.m = loomnb

    def bind(self, op, t, eps):
        fn = getattr(self.m, op.name, None)
        if fn is None:
            raise H.NotAvailable(f"loomnb has no {op.name}")
        x, w = t["x"], t["weight"]
        inplace = lambda _: {k: t[k] for k in op.writes}  # noqa: E731
        if op.name == "rms_norm":
            return partial(fn, x, w, eps, out=t["out"]), lambda r: {"out": r}
        if op.name == "fused_add_rms_norm":
            return partial(fn, x, t["residual"], w, eps), inplace
        if op.name == "rms_norm_dynamic_per_token_quant":  # preallocated outputs, as vLLM's
            kw = {k: t[k] for k in ("out", "scales") if k in inspect.signature(fn).parameters}
            return partial(fn, x, w, eps, **kw), lambda r: {"out": r[0], "scales": r[1]}
        if op.name == "rms_norm_static_fp8_quant":
            return partial(fn, t["out"], x, w, t["scale"], eps), inplace
        return partial(fn, t["out"], x, t["residual"], w, t["scale"], eps), inplace


# vLLM schema argument name -> keys of the inputs dict (first present wins; "scale" is the
# scales output of the dynamic op and the scale input of the static ones).
VLLM_ALIASES = {"result": ("out",), "out": ("out",), "output": ("out",), "input": ("x",),
                "residual": ("residual",), "weight": ("weight",), "scale": ("scales", "scale"),
                "scales": ("scales", "scale"), "epsilon": ("eps",), "scale_ub": ("scale_ub",)}


class Vllm(H.Provider):
    """vLLM's compiled ops from its .so, loaded without importing vllm; arguments are bound by
    the schema's names (printed at start). Ops already registered in-process (tests) are used
    when no library is given."""
    name = "vllm"

    def setup(self, args, log):
        path = args.vllm_lib or os.environ.get("LOOMNB_VLLM_LIB")
        ns = getattr(torch.ops, VLLM_NS)
        if path:
            if not Path(path).is_file():
                return f"vLLM library not found: {path}"
            try:
                torch.ops.load_library(path)
            except Exception as e:  # noqa: BLE001
                return f"torch.ops.load_library({path}) failed: {e!r}"
            self.lib = str(Path(path).resolve())
        elif hasattr(ns, "rms_norm"):
            self.lib = f"torch.ops.{VLLM_NS} already registered in this process"
        else:
            return "no --vllm-lib given and LOOMNB_VLLM_LIB is unset"
        self.ns, self.schemas, self.bindings, self.log = ns, {}, {}, log
        for name in OPS:
            try:
                self.schemas[name] = str(getattr(ns, name).default._schema)
            except (AttributeError, RuntimeError) as e:
                self.schemas[name] = f"MISSING {name}: {e}"
            log(f"[vllm] schema {self.schemas[name]}")

    def bind(self, op, t, eps):
        try:
            packet = getattr(self.ns, op.name)
        except (AttributeError, RuntimeError) as e:
            raise H.NotAvailable(f"torch.ops.{VLLM_NS}.{op.name} missing: {e}") from e
        args, kwargs, desc = H.bind_schema(packet.default._schema, {**t, "eps": eps},
                                           op.reads + op.writes + ("eps",), VLLM_ALIASES)
        if op.name not in self.bindings:
            self.log(f"[vllm] {op.name}({desc})")
            self.bindings[op.name] = desc
        return partial(packet, *args, **kwargs), lambda _: {k: t[k] for k in op.writes}


class Torch(H.Provider):
    """Eager composites with the same rounding points as vLLM (the functions above)."""
    name = "torch"
    FNS = {"rms_norm": t_rms_norm, "fused_add_rms_norm": t_fused_add,
           "rms_norm_dynamic_per_token_quant": t_dynamic_quant,
           "rms_norm_static_fp8_quant": t_static_quant,
           "fused_add_rms_norm_static_fp8_quant": t_fused_static_quant}

    def fn(self, op):
        return self.FNS[op.name]

    def bind(self, op, t, eps):
        fn, x, w = self.fn(op), t["x"], t["weight"]
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


class TorchCompile(Torch):
    """torch.compile of the composites (default mode, dynamic=False: one specialised kernel per
    shape). The first call compiles; it always happens outside timed regions (the exactness run
    or the warm-up). Any failure is reported as a skip."""
    name = "torch_compile"
    error_status = "skip"

    def setup(self, args, log):
        for knob in ("cache_size_limit", "recompile_limit"):  # one compile per shape per op
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 256)
        self.compiled = {}

    def fn(self, op):
        if op.name not in self.compiled:
            self.compiled[op.name] = torch.compile(self.FNS[op.name], dynamic=False)
        return self.compiled[op.name]


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

    def bind(self, op, t, eps):
        x, w = t["x"], t["weight"]
        if op.name == "rms_norm":
            return partial(self.rms, x, w, eps, 0.0, "llama", None), lambda r: {"out": r[0]}
        return (partial(self.fused, x, t["residual"], w, eps, 0.0, "llama"),
                lambda r: {"x": r[0], "residual": r[1]})


PROVIDERS = {p.name: p for p in (Loomnb, Vllm, Torch, TorchCompile, Liger)}


# ---------------------------------------------------------------- cases and measurement
def make_cases(args) -> list[dict]:
    return [{"op": o, "num_tokens": nt, "hidden_size": h, "dtype": args.dtype, "eps": args.eps,
             "l2": "cold" if args.l2_cold else "warm",
             "bytes": op_bytes(OPS[o], nt, h, args.dtype)}
            for o in args.ops for h in args.hidden_sizes for nt in args.num_tokens]


def case_outputs(args, prov, case) -> dict:
    """One call on fresh inputs (seed args.seed: identical for every provider); cloned outputs."""
    op, nt, h = OPS[case["op"]], case["num_tokens"], case["hidden_size"]
    t = make_inputs(op, nt, h, args.dtype, args.device, args.seed)
    call, collect = prov.bind(op, t, args.eps)
    return {k: v.clone() for k, v in collect(call()).items()}


def case_timing(args, prov, case, pass_i) -> dict:
    op, nt, h = OPS[case["op"]], case["num_tokens"], case["hidden_size"]
    make_call = lambda i: prov.bind(  # noqa: E731
        op, make_inputs(op, nt, h, args.dtype, args.device, args.seed + 1000 + i), args.eps)[0]
    return H.time_case(make_call, case["bytes"], l2_cold=args.l2_cold, l2=args.l2_bytes,
                       target_ms=args.target_ms, repeats=args.repeats, device=args.device)


FAKE = {"loomnb": (2.4, 4300.0), "vllm": (2.6, 4200.0), "torch": (18.0, 2500.0),
        "torch_compile": (3.5, 3900.0), "liger": (4.0, 3800.0)}  # (floor µs, GB/s)


def fake_timing(args, prov, case, pass_i) -> dict:
    """--dry-run: made-up but plausible numbers (and exactness) so the plumbing runs on CPU."""
    floor, bw = FAKE.get(prov.name, (5.0, 3000.0))
    us = (floor + case["bytes"] / (bw * 1e3)) * (1 + 0.02 * pass_i)
    ex = 1.0 if prov.name in ("loomnb", "vllm") else 0.995
    return {"l2_sets": 1, "graph_us": us, "graph_us_min": 0.98 * us, "graph_n": 100,
            "eager_us": us + 9.0, "host_us": 9.0, "eager_n": 100, "timer": "fake",
            "GBps": case["bytes"] / (us * 1e-6) / 1e9,
            "exact": {k: ex for k in OPS[case["op"]].writes}, "exact_min": ex}


# ---------------------------------------------------------------- command line
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="RMSNorm-family benchmark; see benchmarks/README.md")
    a = p.add_argument
    a("--out", type=Path, default=RESULTS_DIR, help="folder for the JSON and CSV (%(default)s)")
    a("--ops", type=H.csv_list(str, OPS), default=list(OPS), help="comma list (default: all)")
    a("--providers", type=H.csv_list(str, PROVIDERS), default=list(PROVIDERS),
      help="comma list, in forward order (default: %(default)s)")
    a("--num-tokens", type=H.csv_list(int),
      help="default 1,8,32,128,1024,16384 (--quick: 1,128,16384)")
    a("--hidden-sizes", type=H.csv_list(int), default=[4096], help="default 4096")
    a("--dtype", choices=list(TORCH_DTYPES), default="bf16")
    a("--eps", type=float, default=1e-6)
    a("--order", choices=["forward", "reverse", "both"], default="both",
      help="provider order of the sweep; both = forward sweep, then reversed (default)")
    a("--l2-cold", action="store_true",
      help="rotate through enough input sets to exceed 2x L2 (default: warm, same buffers)")
    a("--l2-bytes", type=int, help="L2 size for --l2-cold (default: the device's, else 60 MiB)")
    a("--target-ms", type=float, help="GPU time of one graph replay (default 2; --quick 0.5)")
    a("--repeats", type=int, help="timed replays / eager loops per case (default 15; --quick 5)")
    a("--quick", action="store_true", help="fewer shapes and repeats, for smoke tests")
    a("--no-exact", action="store_true", help="skip the byte-exactness runs")
    a("--exact-ref", choices=["vllm", "torch"], default="vllm",
      help="reference for exactness (vllm; falls back to torch, logged, if vLLM is unavailable)")
    a("--vllm-lib", help="vLLM's _C_stable_libtorch.abi3.so (default: $LOOMNB_VLLM_LIB)")
    a("--device", default="cuda", help="cuda, or cpu for a smoke test (wall-clock 'timings')")
    a("--copy-gib", type=float, default=1.0, help="copy-bandwidth buffer size (GiB)")
    a("--seed", type=int, default=0)
    a("--tag", default="", help="appended to the result file names")
    a("--dry-run", action="store_true", help="no GPU: fake timings, real plumbing and files")
    args = p.parse_args(argv)
    args.num_tokens = args.num_tokens or ([1, 128, 16384] if args.quick
                                          else [1, 8, 32, 128, 1024, 16384])
    args.target_ms = args.target_ms or (0.5 if args.quick else 2.0)
    args.repeats = args.repeats or (5 if args.quick else 15)
    if args.dry_run:
        args.device = "cpu"
    elif args.device != "cpu" and not torch.cuda.is_available():
        p.error("no CUDA device: use --dry-run (fake timings) or --device cpu (smoke test)")
    return args


def pick_ref(args, provs: dict, log):
    """The exactness reference provider (vLLM, else torch with a logged note), or None."""
    if args.no_exact:
        return None
    ref = provs.get(args.exact_ref)
    if ref is None:
        ref = PROVIDERS[args.exact_ref]()
        ref.skip = ref.setup(args, log)
    if ref.skip:
        log(f"[exact] reference {ref.name} unavailable ({ref.skip}); comparing with torch")
        ref = provs.get("torch") or Torch()
    return ref


def main(argv=None) -> Path:
    args = parse_args(argv)
    log = H.RunLog()
    passes = H.provider_passes(args.providers, args.order)
    provs = {n: PROVIDERS[n]() for n in args.providers}
    cold = "cold" if args.l2_cold else "warm"
    meta = {"benchmark": "norm", "format": 1, "dry_run": args.dry_run, "l2": cold,
            **H.env_metadata(args.device, packages=("liger-kernel", "loomnb", "vllm", "tqdm")),
            "flags": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "provider_passes": passes, "units": H.UNITS,
            "bytes_model": "every read tensor once + every written tensor once; fp8 1 B/elem, "
                           "scales 4 B/row, static scale 4 B"}
    ref, measure = None, partial(fake_timing, args)
    args.l2_bytes = args.l2_bytes or H.l2_bytes(args.device)
    meta["l2_bytes"] = args.l2_bytes
    if args.dry_run:
        meta["copy_bandwidth"] = {"GBps": 4400.0, "method": "fake (dry run)"}
    else:
        for name, prov in provs.items():
            prov.skip = prov.setup(args, log)
            log(f"[{name}] " + (f"SKIPPED: {prov.skip}" if prov.skip else "ready"))
        ref, measure = pick_ref(args, provs, log), partial(case_timing, args)
        meta["copy_bandwidth"] = H.copy_bandwidth(int(args.copy_gib * 2**30), device=args.device)
        log(f"[copy] {meta['copy_bandwidth']['GBps']:.0f} GB/s (torch.mul, graph-replayed)")
    meta["providers"] = {n: {"skip": p.skip, "about": (type(p).__doc__ or "").strip()}
                         for n, p in provs.items()}
    meta["exact_ref"] = "vllm (fake)" if args.dry_run else ref.name if ref else None
    meta["copy_GBps"] = meta["copy_bandwidth"]["GBps"]
    gpu = (meta.get("gpu") or args.device).replace(" ", "-")
    stem = "_".join(x for x in ("norm", H.timestamp(), gpu, "l2cold" if args.l2_cold else "",
                                "dryrun" if args.dry_run else "", args.tag) if x)
    rows: list[dict] = []

    def checkpoint():
        for r in rows:
            if r.get("GBps"):
                r["pct_copy"] = 100.0 * r["GBps"] / meta["copy_GBps"]
        vllm = ref if ref is not None and ref.name == "vllm" else provs.get("vllm")
        if vllm is not None and not vllm.skip and hasattr(vllm, "schemas"):
            meta["vllm"] = {"lib": vllm.lib, "schemas": vllm.schemas, "bindings": vllm.bindings}
        meta["log"] = log.lines
        return H.write_results(args.out, stem, meta, rows)

    try:
        with torch.inference_mode():  # as in vLLM: no autograd bookkeeping on any path
            H.sweep(make_cases(args), passes, provs, measure=measure, ref=ref, log=log,
                    outputs=partial(case_outputs, args), checkpoint=checkpoint, rows=rows)
        if not args.dry_run:
            end = H.copy_bandwidth(int(args.copy_gib * 2**30), device=args.device)
            meta["copy_bandwidth_end"] = end
            meta["copy_GBps"] = max(meta["copy_GBps"], end["GBps"])  # the achievable roofline
            log(f"[copy] end of run: {end['GBps']:.0f} GB/s")
    except BaseException as e:
        meta["incomplete"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        json_path, csv_path = checkpoint()
        log(f"wrote {json_path} and {csv_path}")
    return json_path


if __name__ == "__main__":
    main()
