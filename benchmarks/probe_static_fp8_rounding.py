"""Which rounding vLLM's compiled static FP8 norms use: vLLM 0.24's ``rms_norm_static_fp8_quant``
and ``fused_add_rms_norm_static_fp8_quant`` against three forms emulated in torch, on bf16 and
fp16 rows (the fraction of FP8 codes each form gets equal; ``inv`` is torch's float32 rsqrt):

* ``fp32``: ``e4m3(f(x) * inv * f(w) * (1/scale))`` -- no rounding to the activation dtype T;
* ``once``: ``e4m3(f(r(f(x) * inv * f(w))) * (1/scale))`` -- the norm rounded to T once;
* ``twice``: ``e4m3(f(r(f(r(f(x) * inv)) * f(w))) * (1/scale))``.

    python3 benchmarks/probe_static_fp8_rounding.py --vllm-lib $LOOMNB_VLLM_LIB
"""
import argparse

import torch


def forms(x, w, scale, eps):
    s = x.float()
    inv = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    wf, inv_s = w.float(), 1.0 / scale.float()
    q = lambda n: (n * inv_s).clamp(-448, 448).to(torch.float8_e4m3fn)  # noqa: E731
    return {"fp32": q(s * inv * wf), "once": q((s * inv * wf).to(x.dtype).float()),
            "twice": q(((s * inv).to(x.dtype).float() * wf).to(x.dtype).float())}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--vllm-lib", required=True)
    a = p.parse_args()
    torch.ops.load_library(a.vllm_lib)
    g = torch.Generator(device="cuda").manual_seed(0)
    for dt in (torch.bfloat16, torch.float16):
        for T, H in ((129, 8192), (7, 576)):
            x = (torch.randn(T, H, generator=g, device="cuda") * 2).to(dt)
            r = torch.randn(T, H, generator=g, device="cuda").to(dt)
            w = (1 + 0.1 * torch.randn(H, generator=g, device="cuda")).to(dt)
            scale = torch.tensor([0.013], device="cuda")
            want = torch.empty(T, H, dtype=torch.float8_e4m3fn, device="cuda")
            torch.ops._C.rms_norm_static_fp8_quant(want, x, w, scale, 1e-6)
            wf, rv = torch.empty_like(want), r.clone()
            torch.ops._C.fused_add_rms_norm_static_fp8_quant(wf, x.clone(), rv, w, scale, 1e-6)
            for name, ref, inp in (("rms_norm_static", want, x), ("fused_add_static", wf, rv)):
                eq = {k: (v.view(torch.uint8) == ref.view(torch.uint8)).float().mean().item()
                      for k, v in forms(inp, w, scale, 1e-6).items()}
                print(f"{name} {str(dt)[6:]} {T}x{H}: " + "  ".join(f"{k} {v:.4%}" for k, v in eq.items()))


if __name__ == "__main__":
    main()
