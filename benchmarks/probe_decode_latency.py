"""Why are loomnb's small kernels slower than Inductor's at decode? A probe, not a benchmark.

In the vLLM A/B (``bench_vllm_ab.py``) at batch 1, loomnb's RMSNorm, RoPE and SiLU-and-mul
kernels take 1.85-2.07 µs each (CUPTI durations inside vLLM's CUDA graph), vLLM's CUDA kernels
1.66-1.98 µs and Inductor's Triton kernels 1.13-1.47 µs. This times, at SmolLM2-135M's decode
shapes (hidden 576, intermediate 1536, 9/3 heads of 64, bf16), each op's providers in one
process, in a CUDA graph where every call follows the GEMM that produces its input (as in the
engine), two ways: graph time per (GEMM + op) iteration, and the CUPTI duration of the op's
kernels (``torch.profiler`` over graph replays: the A/B's measure). Beside them, floors: an
empty numba kernel with one parameter and with 110 (ten 3-D arrays' worth), an empty Triton
kernel, a copy of the SiLU's two halves (numba and Triton), and SiLU-and-mul with vLLM's numerics
(libdevice ``expf``, IEEE division) written minimally in numba with 8, 4 or 2 outputs a thread
and in Triton with 2, 4 or 8 (``BLOCK`` 256, 512, 1024 over 4 warps), plus numba's fast-math
form; the SASS size of each kernel it compiled (``code_bytes``). Kernels also run back to back
without the GEMM (``cupti_us_op_alone``) for the SiLU cases. (The three JSONs of 2026-12-01
count two ``torch.ones`` kernels, about 0.9 µs each, in vLLM's ``rope+cache``: its scale
arguments were made in the call then; they are made once now.)

    python3 benchmarks/probe_decode_latency.py --out $OUT [--vllm-lib PATH] [--tokens 1,8,64]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from numba import cuda, float32

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402

import loomnb  # noqa: E402
from loomnb import _adapter as ad  # noqa: E402
from loomnb._numba_internals import FastKernel  # noqa: E402
from loomnb.ops import _launch as L  # noqa: E402
from loomnb.ops._vector import CODECS, load_u32x2, load_u32x4, store_u32x2, store_u32x4  # noqa: E402

HIDDEN, INTER, NH, NKV, HD, EPS = 576, 1536, 9, 3, 64, 1e-5
unpack, pack = CODECS["bf16"].unpack, CODECS["bf16"].pack


# ---------------------------------------------------------------- floors (numba, Triton)
def _empty1(n):
    if n < 0:
        pass


def _empty_arrays(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, n):
    if n < 0:
        a0[0, 0, 0] = 0


def _mini_copy(out, x, d):
    """The memory round trip of ``mini_silu_e(8)``: both halves loaded, their XOR stored."""
    u = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    row = cuda.blockIdx.y
    if u < (d >> 3):
        g = load_u32x4(x[row], u * 4)
        m = load_u32x4(x[row], (d >> 1) + u * 4)
        store_u32x4(out[row], u * 4, (g[0] ^ m[0], g[1] ^ m[1], g[2] ^ m[2], g[3] ^ m[3]))


def _silu2(g, m):
    """One word of output: silu-and-mul of the two bf16 of gate word g and up word m."""
    g0, g1 = unpack(g)
    m0, m1 = unpack(m)
    a0, a1 = unpack(pack(g1 / (float32(1) + cuda.libdevice.expf(-g1)),
                         g0 / (float32(1) + cuda.libdevice.expf(-g0))))
    return pack(a1 * m1, a0 * m0)


def mini_silu_e(E, fastmath=False):
    """``out[row, e] = silu(x[row, e]) * x[row, d + e]`` with vLLM's numerics (libdevice
    ``expf``, IEEE division, the activation rounded before the product) and nothing else: E
    outputs a thread (2: one word; 4: ``ld.v2``; 8: ``ld.v4``), the row from ``blockIdx.y``."""
    W = E // 2
    silu2 = cuda.jit(device=True, fastmath=fastmath)(_silu2)

    def kernel(out, x, d):
        u = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        row = cuda.blockIdx.y
        if u < d // E:
            xr = x[row]
            orow = out[row]
            if W == 1:
                orow[u] = silu2(xr[u], xr[(d >> 1) + u])
            elif W == 2:
                g = load_u32x2(xr, u * 2)
                m = load_u32x2(xr, (d >> 1) + u * 2)
                store_u32x2(orow, u * 2, (silu2(g[0], m[0]), silu2(g[1], m[1])))
            else:
                g = load_u32x4(xr, u * 4)
                m = load_u32x4(xr, (d >> 1) + u * 4)
                store_u32x4(orow, u * 4, (silu2(g[0], m[0]), silu2(g[1], m[1]),
                                          silu2(g[2], m[2]), silu2(g[3], m[3])))

    kernel.__name__ = f"mini_silu_e{E}"
    return kernel


CODE_SIZES = {}  # kernel label -> bytes of SASS (.text sections of its cubin)


def text_bytes(cubin):
    """Bytes of the ``.text.*`` sections of an ELF64 cubin (the kernel's code, and any
    subroutines it calls)."""
    import struct
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    secs = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    stroff = secs[shstrndx][4]
    total = 0
    for name_off, _, _, _, _, size in secs:
        end = cubin.index(b"\0", stroff + name_off)
        if cubin[stroff + name_off:end].startswith(b".text."):
            total += size
    return total


def numba_launcher(pyfunc, params, grid, block, label=None, **jit):
    fk = FastKernel(cuda.jit(**jit)(pyfunc), L.argtypes(params), pyfunc.__name__)
    prepared = fk.prepare(torch.cuda.current_device(), grid, block,
                          [v for p in params for v in p.gpu_values()])
    try:
        k = fk.dispatcher.overloads[fk.argtypes]
        cub = k._codelibrary.get_cubin(cc=(9, 0))
        CODE_SIZES[label or pyfunc.__name__] = text_bytes(bytes(getattr(cub, "code", cub)))
    except Exception as e:  # noqa: BLE001
        CODE_SIZES[label or pyfunc.__name__] = repr(e)[:100]
    return lambda: prepared.launch(torch.cuda.current_stream().cuda_stream)


def triton_kernels():
    """A Triton copy and a Triton SiLU-and-mul with vLLM's numerics (libdevice expf, IEEE
    division, the activation rounded to bf16 before the product): (copy, silu_exact)."""
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _copy(o, x, d, BLOCK: tl.constexpr):
        row = tl.program_id(1)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < d
        g = tl.load(x + row * 2 * d + i, mask=m)
        u = tl.load(x + row * 2 * d + d + i, mask=m)
        tl.store(o + row * d + i, (g.to(tl.int16, bitcast=True) ^ u.to(tl.int16, bitcast=True)).to(tl.bfloat16, bitcast=True), mask=m)

    @triton.jit
    def _silu(o, x, d, BLOCK: tl.constexpr):
        row = tl.program_id(1)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < d
        g = tl.load(x + row * 2 * d + i, mask=m).to(tl.float32)
        u = tl.load(x + row * 2 * d + d + i, mask=m).to(tl.float32)
        a = tl.math.div_rn(g, 1.0 + libdevice.exp(-g)).to(tl.bfloat16).to(tl.float32)
        tl.store(o + row * d + i, (a * u).to(tl.bfloat16), mask=m)

    return _copy, _silu


def triton_launcher(kern, out, x, d, label, block=512):
    T = x.shape[0]
    grid = (-(-d // block), T)
    c = kern[grid](out, x, d, BLOCK=block)
    try:
        CODE_SIZES[label] = text_bytes(c.asm["cubin"])
    except Exception as e:  # noqa: BLE001
        CODE_SIZES[label] = repr(e)[:100]
    return lambda: kern[grid](out, x, d, BLOCK=block)


def triton_empty():
    import triton
    import triton.language as tl

    @triton.jit
    def _k(p, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(p + i, tl.zeros([BLOCK], tl.float32), mask=i < n)

    buf = torch.empty(1, device="cuda")
    return lambda: _k[(1,)](buf, 0, BLOCK=128)


# ---------------------------------------------------------------- the torch composites
def native_rms(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


def native_add_rms(x, r, w):
    r2 = (x.float() + r.float()).to(x.dtype)
    xf = r2.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w, r2


def native_silu(x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def native_rope(positions, qkv, cos_sin):
    q, k, _ = qkv.split([NH * HD, NKV * HD, NKV * HD], dim=-1)
    cs = cos_sin.index_select(0, positions)
    cos, sin = cs.chunk(2, dim=-1)

    def rot(t, nh):
        t = t.view(t.shape[0], nh, HD)
        c, s = cos.unsqueeze(-2).to(t.dtype), sin.unsqueeze(-2).to(t.dtype)
        x1, x2 = torch.chunk(t, 2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(1)

    return rot(q, NH), rot(k, NKV)


# ---------------------------------------------------------------- measuring
def cupti_us(fns, n, skip_names=()):
    """Per-iteration CUPTI device time of the kernels of one graph of ``n`` iterations of
    ``fns``, by kernel name, excluding names containing any of ``skip_names``."""
    for f in fns * 2:  # warm-up: cuBLAS handles, compilations
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            for f in fns:
                f()
    g.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t <= 0 or e.key.startswith(("cudaGraph", "Memcpy", "Memset")):
            continue
        if any(s in e.key for s in skip_names):
            continue
        out[e.key[:120]] = (t / (3 * n), e.count / (3 * n))
    del g
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--tokens", default="1,8,64")
    p.add_argument("--vllm-lib", default=os.environ.get("LOOMNB_VLLM_LIB"))
    p.add_argument("--n", type=int, default=200)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    dev = "cuda"
    vllm = False
    if args.vllm_lib:
        try:
            torch.ops.load_library(args.vllm_lib)
            vllm = True
        except Exception as e:  # noqa: BLE001
            print("vLLM library not loaded:", repr(e)[:300])
    bf = torch.bfloat16
    copy = H.copy_bandwidth(1 << 30)
    print(f"copy bandwidth {copy['GBps']:.0f} GB/s; vLLM ops: {vllm}")
    comp = {name: torch.compile(f, dynamic=False) for name, f in
            (("rms", native_rms), ("add_rms", native_add_rms), ("silu", native_silu),
             ("rope", native_rope))}
    results = []
    for T in [int(v) for v in args.tokens.split(",")]:
        h = torch.randn(T, HIDDEN, device=dev, dtype=bf) * 0.5
        w_h = torch.randn(HIDDEN, HIDDEN, device=dev, dtype=bf) * 0.05
        w_gu = torch.randn(HIDDEN, 2 * INTER, device=dev, dtype=bf) * 0.05
        w_qkv = torch.randn(HIDDEN, (NH + 2 * NKV) * HD, device=dev, dtype=bf) * 0.05
        x = torch.empty(T, HIDDEN, device=dev, dtype=bf)
        res = torch.randn(T, HIDDEN, device=dev, dtype=bf)
        nw = (1 + 0.1 * torch.randn(HIDDEN, device=dev)).to(bf)
        out = torch.empty_like(x)
        gu = torch.empty(T, 2 * INTER, device=dev, dtype=bf)
        act = torch.empty(T, INTER, device=dev, dtype=bf)
        qkv = torch.empty(T, (NH + 2 * NKV) * HD, device=dev, dtype=bf)
        q, k, v = qkv.split([NH * HD, NKV * HD, NKV * HD], dim=-1)
        qo, ko = torch.empty(T, NH * HD, device=dev, dtype=bf), torch.empty(T, NKV * HD, device=dev, dtype=bf)
        positions = torch.randint(0, 2048, (T,), device=dev)
        inv = 1.0 / (10000 ** (torch.arange(0, HD, 2, device=dev).float() / HD))
        f = torch.outer(torch.arange(2048, device=dev).float(), inv)
        cos_sin = torch.cat((f.cos(), f.sin()), dim=-1).to(bf)
        nblocks = 64
        kc = torch.zeros(nblocks, 16, NKV, HD, device=dev, dtype=bf)
        vc = torch.zeros_like(kc)
        slots = torch.randperm(nblocks * 16, device=dev)[:T]
        prod = {"x": lambda: torch.mm(h, w_h, out=x), "gu": lambda: torch.mm(h, w_gu, out=gu),
                "qkv": lambda: torch.mm(h, w_qkv, out=qkv)}
        cases = {
            ("rms_norm", "loomnb"): ("x", lambda: loomnb.rms_norm(x, nw, EPS, out=out, rounding="once")),
            ("rms_norm", "inductor"): ("x", lambda: comp["rms"](x, nw)),
            ("fused_add_rms_norm", "loomnb"): ("x", lambda: loomnb.fused_add_rms_norm(x, res, nw, EPS, rounding="once")),
            ("fused_add_rms_norm", "inductor"): ("x", lambda: comp["add_rms"](x, res, nw)),
            ("silu_and_mul", "loomnb"): ("gu", lambda: loomnb.silu_and_mul(gu, out=act)),
            ("silu_and_mul", "inductor"): ("gu", lambda: comp["silu"](gu)),
            ("rope", "loomnb"): ("qkv", lambda: loomnb.apply_rope_with_cos_sin_cache(
                positions, q, k, HD, cos_sin, True, query_out=qo, key_out=ko)),
            ("rope", "inductor"): ("qkv", lambda: comp["rope"](positions, qkv, cos_sin)),
            ("rope+cache", "loomnb"): ("qkv", lambda: loomnb.rotary_embedding_and_cache(
                positions, q, k, v, kc, vc, slots, HD, cos_sin, True)),
        }
        if vllm:
            C, CC = torch.ops._C, torch.ops._C_cache_ops
            one = torch.ones((), device=dev)
            cases.update({
                ("rms_norm", "vllm"): ("x", lambda: C.rms_norm(out, x, nw, EPS)),
                ("fused_add_rms_norm", "vllm"): ("x", lambda: C.fused_add_rms_norm(x, res, nw, EPS)),
                ("silu_and_mul", "vllm"): ("gu", lambda: C.silu_and_mul(act, gu)),
                ("rope", "vllm"): ("qkv", lambda: C.rotary_embedding(positions, q, k, HD, cos_sin, True)),
                ("rope+cache", "vllm"): ("qkv", lambda: (
                    C.rotary_embedding(positions, q, k, HD, cos_sin, True),
                    CC.reshape_and_cache_flash(k.view(T, NKV, HD), v.view(T, NKV, HD), kc, vc,
                                               slots, "auto", one, one))),
            })
        # floors
        xa = ad.wrap("probe", "x", gu)
        oa = ad.wrap("probe", "out", act)
        cases[("floor_empty_1param", "numba")] = ("x", numba_launcher(_empty1, [L.i64(1)], 1, 32))
        arrs = [L.array(ad.wrap("probe", "x", gu.view(T, 1, -1)), words=True)] * 10
        cases[("floor_empty_110params", "numba")] = ("x", numba_launcher(_empty_arrays, arrs + [L.i64(1)], 1, 32))
        cases[("floor_empty", "triton")] = ("x", triton_empty())
        cases[("silu_and_mul", "numba_minimal")] = ("gu", numba_launcher(
            mini_silu_e(8), [L.array(oa, words=True), L.array(xa, words=True), L.i64(INTER)],
            (math.ceil(INTER / 8 / 64), T), 64, label="_mini_silu"))
        cases[("silu_and_mul", "numba_minimal_fastmath")] = ("gu", numba_launcher(
            mini_silu_e(8, fastmath=True), [L.array(oa, words=True), L.array(xa, words=True),
                                            L.i64(INTER)],
            (math.ceil(INTER / 8 / 64), T), 64, label="mini_silu_fastmath", fastmath=True))
        for E, nt in ((8, 64), (8, 128), (4, 128), (2, 128), (2, 256)):
            cases[("silu_and_mul", f"numba_e{E}_t{nt}")] = ("gu", numba_launcher(
                mini_silu_e(E), [L.array(oa, words=True), L.array(xa, words=True), L.i64(INTER)],
                (math.ceil(INTER / E / nt), T), nt, label=f"mini_silu_e{E}"))
        cases[("copy", "numba_minimal")] = ("gu", numba_launcher(
            _mini_copy, [L.array(oa, words=True), L.array(xa, words=True), L.i64(INTER)],
            (math.ceil(INTER / 8 / 64), T), 64))
        try:
            tcopy, tsilu = triton_kernels()
            cases[("copy", "triton")] = ("gu", triton_launcher(tcopy, act, gu, INTER, "triton_copy"))
            cases[("silu_and_mul", "triton_exact")] = ("gu", triton_launcher(tsilu, act, gu, INTER, "triton_silu_exact"))
            for blk in (256, 1024):  # 2 and 8 outputs a thread (4 warps)
                cases[("silu_and_mul", f"triton_exact_b{blk}")] = ("gu", triton_launcher(
                    tsilu, act, gu, INTER, f"triton_silu_exact_b{blk}", block=blk))
        except Exception as e:  # noqa: BLE001
            print("triton variants unavailable:", repr(e)[:300])
        alone = {("silu_and_mul", "loomnb"), ("silu_and_mul", "inductor"), ("silu_and_mul", "vllm"),
                 ("silu_and_mul", "numba_minimal"), ("copy", "numba_minimal"), ("copy", "triton")}
        gemm_names = set()
        for pn, pf in prod.items():
            gemm_names |= set(cupti_us([pf], 20))
        keys = list(cases)
        for order in ("forward", "reversed"):
            for key in (keys if order == "forward" else keys[::-1]):
                pname, fn = cases[key]
                try:
                    fns = [prod[pname], fn]
                    for f_ in fns * 3:
                        f_()
                    torch.cuda.synchronize()
                    t_pair = H.time_graph(fns, n=2 * args.n, repeats=9)["us"] * 2
                    t_prod = H.time_graph([prod[pname]], n=args.n, repeats=9)["us"]
                    kern = cupti_us(fns, args.n, skip_names=tuple(gemm_names))
                    row = {"tokens": T, "op": key[0], "provider": key[1], "order": order,
                           "graph_us_with_gemm": round(t_pair, 3), "graph_us_gemm_alone": round(t_prod, 3),
                           "graph_us_op": round(t_pair - t_prod, 3),
                           "cupti_us_op": round(sum(v[0] for v in kern.values()), 3),
                           "kernels": {k_: [round(a, 3), round(c, 2)] for k_, (a, c) in kern.items()}}
                    if key in alone:  # the op alone, graph-replayed back to back (no GEMM between)
                        ka = cupti_us([fn], args.n)
                        row["cupti_us_op_alone"] = round(sum(v[0] for v in ka.values()), 3)
                except Exception as e:  # noqa: BLE001
                    row = {"tokens": T, "op": key[0], "provider": key[1], "order": order,
                           "error": repr(e)[:400]}
                results.append(row)
                print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "kernels"}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"probe_decode_latency_{time.strftime('%Y%m%d-%H%M%S')}.json"
    import glob
    import tempfile
    for f in glob.glob(os.path.join(tempfile.gettempdir(), "torchinductor_*", "**", "*.cubin"),
                       recursive=True):
        try:
            CODE_SIZES["inductor:" + Path(f).stem[:60]] = text_bytes(Path(f).read_bytes())
        except Exception:  # noqa: BLE001
            pass
    print("SASS bytes (.text) per kernel:", json.dumps(CODE_SIZES))
    path.write_text(json.dumps({"meta": H.env_metadata("cuda"), "copy_GBps": copy["GBps"],
                                "code_bytes": CODE_SIZES, "results": results}, indent=1))
    print(f"\n{'op':22s}{'provider':24s}{'T':>4s}{'cupti fwd':>10s}{'rev':>7s}{'graph fwd':>10s}{'rev':>7s}{'alone':>7s}")
    rows = {}
    for r in results:
        if "error" not in r:
            rows.setdefault((r["op"], r["provider"], r["tokens"]), {})[r["order"]] = r
    for (op, prov, T), d in rows.items():
        f_, r_ = d.get("forward", {}), d.get("reversed", {})
        print(f"{op:22s}{prov:24s}{T:4d}{f_.get('cupti_us_op', 0):10.2f}{r_.get('cupti_us_op', 0):7.2f}"
              f"{f_.get('graph_us_op', 0):10.2f}{r_.get('graph_us_op', 0):7.2f}{f_.get('cupti_us_op_alone', 0):7.2f}")
    errs = [r for r in results if "error" in r]
    for e in errs[:6]:
        print("error:", e)
    print("wrote", path)


if __name__ == "__main__":
    main()
