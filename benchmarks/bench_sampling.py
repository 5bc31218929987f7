"""Sampling-family benchmark: the logprob tail (greedy token + logprob + rank) and Min-P, for
vLLM 0.24's V1 and V2 samplers, loomnb vs the torch composites vLLM runs and torch.compile.

    python3 benchmarks/bench_sampling.py                          # fp32, V = 151,936, 1..512 rows
    python3 benchmarks/bench_sampling.py --dtype bf16 --ops greedy_logprob_rank_v1,greedy_logprob_rank_v2
    python3 benchmarks/bench_sampling.py --vocab-sizes 49152,128256,151936 --quick
    python3 benchmarks/bench_sampling.py --dry-run                # no GPU: fake timings, real files

Providers:

* ``loomnb``: one kernel launch per call (two for Min-P), preallocated outputs;
* ``torch``: eager composites exactly as vLLM runs them -- V1: ``log_softmax(fp32)``,
  ``argmax``, ``gather``, ``(logprobs >= lp_t).sum()``; V1 Min-P ``softmax < amax * min_p``;
  V2 (its Triton kernels' math, ``vllm/v1/worker/gpu/sample/``): ``x - max - log(sum(exp(x - max)))``,
  ``(logits >= x_t).sum()`` plus the ``-inf`` padding lanes, Min-P ``x < max + log(min_p)``;
* ``torch_compile``: the same composites through ``torch.compile`` (default mode);
* ``vllm_triton``: vLLM's own V2 Triton kernels (``compute_topk_logprobs``, ``apply_min_p``)
  when ``vllm`` imports on this machine (it needs vLLM's engine; otherwise skipped, logged);
* ``vllm``: vLLM's compiled ops by schema -- vLLM 0.24 has none for these ops (its sampler is
  torch and Triton), so every row says n/a;
* ``loomnb_b4``, ``loomnb_b8``, ``loomnb_b16`` (blocks per SM the row split aims at),
  ``loomnb_t256`` (threads per block), ``loomnb_u8`` (16-byte units a thread reads before a row
  is split further) and two combinations (``--tune``): loomnb with ``loomnb.ops.sampling``'s
  launch constants changed, to tune them.

Bytes model: the logits once (``R * V * b``), plus 20 B/row of outputs; Min-P reads and writes
the logits (the mask is written where it applies; counted whole) plus 4 B/row of ``min_p``.
Min-P runs on vLLM's fp32 processed logits: its bf16 rows are n/a. Only the family's parts are
here; the command line, timing, exactness and files are ``_harness.run``.
"""

from __future__ import annotations

import math
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
import torch  # noqa: E402

ELEM_BYTES = {"fp32": 4, "bf16": 2}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIN_P = 0.05   # a typical Min-P: masks most of a 150k vocabulary
V2_BLOCK = 8192


def _op(name, reads, writes, kind, sampler):
    return H.Op(name, reads, writes, vllm_name=None, extra={"kind": kind, "sampler": sampler})


OPS = {op.name: op for op in [
    _op("greedy_logprob_rank_v1", ("logits",), ("token_ids", "logprobs", "ranks"), "greedy", "v1"),
    _op("greedy_logprob_rank_v2", ("logits",), ("token_ids", "logprobs", "ranks"), "greedy", "v2"),
    _op("min_p_v1", ("logits", "min_p"), ("logits",), "min_p", "v1"),
    _op("min_p_v2", ("logits", "min_p"), ("logits",), "min_p", "v2"),
]}
ROLE_BYTES = {"token_ids": 8, "logprobs": 4, "ranks": 8, "min_p": 4}


def op_bytes(op, rows: int, vocab: int, dtype: str = "fp32") -> int:
    """Bytes the op must move: the logits once per read and once per write, 20 B of outputs
    (or 4 B of min_p) per row."""
    total = 0
    for role in op.reads + op.writes:
        total += rows * (vocab * ELEM_BYTES[dtype] if role == "logits" else ROLE_BYTES[role])
    return total


def make_inputs(op, rows: int, vocab: int, dtype: str, device, seed: int) -> dict:
    """Fresh logits (normal, scale 3: a peaked softmax as a model's), ``min_p`` and
    preallocated outputs."""
    g = torch.Generator(device=device).manual_seed(seed)
    t = {"logits": (torch.randn(rows, vocab, generator=g, device=device) * 3).to(TORCH_DTYPES[dtype])}
    if op.extra["kind"] == "min_p":
        t["min_p"] = torch.full((rows,), MIN_P, device=device)
    else:
        t["token_ids"] = torch.empty(rows, dtype=torch.int64, device=device)
        t["logprobs"] = torch.empty(rows, dtype=torch.float32, device=device)
        t["ranks"] = torch.empty(rows, dtype=torch.int64, device=device)
    return t


# ---------------------------------------------------------------- torch composites (vLLM's math)
def t_greedy_v1(logits):
    """vLLM V1: raw logprobs = log_softmax(fp32); greedy = argmax of the fp32 logits;
    gather_logprobs counts logprobs >= the token's."""
    lp = logits.log_softmax(-1, dtype=torch.float32)
    tok = logits.float().argmax(-1)
    lpt = lp.gather(-1, tok[:, None])
    return tok, lpt[:, 0], (lp >= lpt).sum(-1)


def t_greedy_v2(logits):
    """vLLM V2's Triton math in torch: x - max - log(sum(exp(x - max))) at the token, rank over
    raw logits with the -inf padding of 8192-wide blocks."""
    x = logits.float()
    m = x.amax(-1, keepdim=True)
    lse = (x - m).exp().sum(-1, keepdim=True).log()
    tok = x.argmax(-1)
    xt = x.gather(-1, tok[:, None])
    pad = -(-x.shape[1] // V2_BLOCK) * V2_BLOCK - x.shape[1]
    rank = (x >= xt).sum(-1) + torch.where(xt[:, 0] == -math.inf, pad, 0)
    return tok, (xt - m - lse)[:, 0], rank


def t_min_p_v1(logits, min_p):
    """vLLM V1 ``MinPLogitsProcessor.apply``: softmax, threshold = max prob * min_p, mask."""
    p = logits.softmax(-1)
    thr = p.amax(-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill_(p < thr, -math.inf)


def t_min_p_v2(logits, min_p):
    """vLLM V2 ``_min_p_kernel`` in torch: mask x < max + log(min_p); rows with min_p 0 kept."""
    thr = logits.amax(-1, keepdim=True) + min_p.log()[:, None]
    return logits.masked_fill_((logits < thr) & (min_p != 0)[:, None], -math.inf)


COMPOSITES = {"greedy_logprob_rank_v1": t_greedy_v1, "greedy_logprob_rank_v2": t_greedy_v2,
              "min_p_v1": t_min_p_v1, "min_p_v2": t_min_p_v2}


def _greedy_out(r):
    return {"token_ids": r[0], "logprobs": r[1], "ranks": r[2]}


# ---------------------------------------------------------------- providers
class _Base(H.Provider):
    def unsupported(self, case):
        if self.family.ops[case["op"]].extra["kind"] == "min_p" and case["dtype"] != "fp32":
            return "Min-P runs on vLLM's fp32 processed logits"


class Loomnb(_Base, H.LoomnbProvider):
    """loomnb's ops with preallocated outputs (Min-P in place)."""
    name = "loomnb"

    def bind(self, op, t, case):
        s = op.extra["sampler"]
        if op.extra["kind"] == "min_p":
            return partial(self.m.min_p_filter_, t["logits"], t["min_p"], s), lambda r: {"logits": r}
        return (partial(self.m.greedy_sample_logprob, t["logits"], s, token_ids=t["token_ids"],
                        logprobs=t["logprobs"], ranks=t["ranks"]), _greedy_out)


class Torch(_Base):
    """Eager torch composites of vLLM's V1 sampler and of V2's Triton math (functions above)."""
    name = "torch"

    def fn(self, op):
        return COMPOSITES[op.name]

    def bind(self, op, t, case):
        fn = self.fn(op)
        if op.extra["kind"] == "min_p":
            return partial(fn, t["logits"], t["min_p"]), lambda r: {"logits": t["logits"]}
        return partial(fn, t["logits"]), _greedy_out


class VllmTriton(_Base):
    """vLLM 0.24's own V2 Triton kernels (``vllm.v1.worker.gpu.sample``), imported from an
    installed vllm; skipped when it does not import (it pulls in vLLM's engine)."""
    name = "vllm_triton"

    def setup(self, args, log):
        try:
            from vllm.v1.worker.gpu.sample.logprob import compute_topk_logprobs
            from vllm.v1.worker.gpu.sample.min_p import apply_min_p
        except Exception as e:  # noqa: BLE001
            return f"vLLM's V2 Triton kernels do not import here: {e!r}"[:300]
        self.topk, self.min_p = compute_topk_logprobs, apply_min_p

    def unsupported(self, case):
        if self.family.ops[case["op"]].extra["sampler"] != "v2":
            return "vLLM's Triton kernels are the V2 sampler's"
        return super().unsupported(case)

    def bind(self, op, t, case):
        x = t["logits"]
        if op.extra["kind"] == "min_p":
            idx = torch.arange(x.shape[0], device=x.device, dtype=torch.int32)
            return partial(self.min_p, x, idx, t["min_p"]), lambda r: {"logits": x}
        def call():
            tok = x.float().argmax(-1)  # V2's gumbel_sample at temperature 0 is an argmax
            lt = self.topk(x, 0, tok)
            return tok, lt.logprobs[:, 0], lt.selected_token_ranks
        return call, _greedy_out


class Vllm(H.VllmProvider):
    pass


_S = "loomnb.ops.sampling"
TUNED = [H.tuned(Loomnb, _S, "b4", BLOCKS_PER_SM=4), H.tuned(Loomnb, _S, "b8", BLOCKS_PER_SM=8),
         H.tuned(Loomnb, _S, "b16", BLOCKS_PER_SM=16), H.tuned(Loomnb, _S, "t256", THREADS=256),
         H.tuned(Loomnb, _S, "b8_t256", BLOCKS_PER_SM=8, THREADS=256),
         H.tuned(Loomnb, _S, "u8", UNITS_PER_THREAD=8), H.tuned(Loomnb, _S, "b8_u8", BLOCKS_PER_SM=8, UNITS_PER_THREAD=8)]
PROVIDERS = {p.name: p for p in (Loomnb, Torch, H.compiled(Torch), VllmTriton, Vllm, *TUNED)}


class SamplingFamily(H.Family):
    name = "sampling"
    ops = OPS
    providers = PROVIDERS
    x_axis, x_default, x_quick = "num_rows", [1, 8, 32, 128, 512], [1, 32, 128]
    shape_axes = [("--vocab-sizes", "vocab_size", [151936],
                   "default 151936 (Qwen2.5); 49152 SmolLM2, 128256 Llama 3")]
    dtypes = ("fp32", "bf16")
    bytes_model = ("logits once per read and per write (R * V * elem), + 20 B/row of outputs "
                   "(token int64, logprob fp32, rank int64) or 4 B/row of min_p")
    fake = {"loomnb": (4.0, 3800.0), "torch": (55.0, 500.0), "torch_compile": (35.0, 900.0),
            "vllm_triton": (20.0, 1500.0),
            **{p.name: (4.0, 3700.0) for p in TUNED}}  # (floor µs, GB/s) for --dry-run

    def shape_label(self, case):
        return f"vocab {case['vocab_size']}"

    def op_bytes(self, op, case):
        return op_bytes(op, case["num_rows"], case["vocab_size"], case["dtype"])

    def make_inputs(self, op, case, device, seed):
        dtype = "fp32" if op.extra["kind"] == "min_p" else case["dtype"]
        return make_inputs(op, case["num_rows"], case["vocab_size"], dtype, device, seed)


FAMILY = SamplingFamily()


def _argv(argv):
    """vLLM has no compiled op for these: the exactness reference is the torch composite
    (vLLM's own math) unless ``--exact-ref`` says otherwise."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return argv if "--exact-ref" in argv else ["--exact-ref", "torch", *argv]


def parse_args(argv=None):
    return H.parse_args(FAMILY, _argv(argv))


def main(argv=None) -> Path:
    return H.run(FAMILY, _argv(argv))


if __name__ == "__main__":
    main()
