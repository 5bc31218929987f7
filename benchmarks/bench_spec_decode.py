"""Speculative-verification benchmark: loomnb's greedy verification vs vLLM's rejection sampler
rule, torch eager and torch.compile. (The decode loop with and without prompt lookup, formerly
``--loop`` here, is ``benchmarks/bench_decode.py --speculative``.)

    python3 benchmarks/bench_spec_decode.py            # batches 1..256 x drafts 1..16, V 49,152/151,936
    python3 benchmarks/bench_spec_decode.py --quick    # batches 1/32/256 x drafts 1/4/16, V 151,936
    python3 benchmarks/bench_spec_decode.py --dry-run  # no GPU: fake timings, real plumbing and files

Ops (``R`` requests of ``k`` drafts each, ``N = R*k``, ``max_spec_len = k``; drafts follow the
target for a random prefix, then miss):

* ``rejection_greedy_sample``: drafts and ``torch.argmax``'s int64 targets in, vLLM's padded
  ``[R, k + 1]`` rows out;
* ``greedy_verify``: the fp32 (``--dtype bf16``: bf16) target logits ``[N, V]`` in; the rows, the
  emitted counts, the packed emitted ids and their offsets out.

Providers:

* ``loomnb``: one launch (``rejection_greedy_sample``) or two (``greedy_verify``: the split
  argmax, then verification and compaction), preallocated outputs;
* ``loomnb_unfused`` (``greedy_verify`` only): ``torch.argmax`` then loomnb's
  ``rejection_greedy_sample`` -- the "argmax + unfused op" the fused form must beat (its
  compaction, computed outside the timed call, only feeds the exactness check);
* ``vllm``: vLLM 0.24's Triton ``rejection_greedy_sample_kernel`` (after its ``torch.full(-1)``)
  when ``vllm`` imports here; otherwise a faithful copy of that kernel's rule in torch -- the
  ``torch.full``, then its loop over the ``max_spec_len`` positions, each step vectorised over
  the requests (``draft != target`` rejects; the bonus where nothing did). Which one ran is
  logged and in ``meta.log``. For ``greedy_verify``: ``logits.argmax(-1)`` first; vLLM compacts
  on the host after a device-to-host copy (``parse_output``), which is not timed;
* ``torch``: an eager torch implementation without a Python loop over positions (scatter-min of
  the first mismatch, ``index_put`` of the rows; compaction by cumulative sums), no host sync;
* ``torch_compile``: the same functions through ``torch.compile(dynamic=True)`` -- one compile
  per op rather than per shape, which keeps the default sweep within a few minutes.

Bytes model: each read and written tensor once (drafts 4 B, targets 8 B, logits ``V`` x 4 (or 2)
B per row, counts/offsets/ids 4 B). Only the family's parts are here; the command line,
timing, exactness and files are ``_harness.run``. The result files keep the family's first
name: ``spec_<time>_<gpu>.json``.
"""

from __future__ import annotations

import itertools
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
import torch  # noqa: E402

ELEM_BYTES = {"fp32": 4, "bf16": 2}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ACCEPT = 0.8  # probability that a draft equals its target (while the request's run lasts)
OUTPUTS = ("output_token_ids", "num_emitted", "emitted_token_ids", "cu_num_emitted")


def _op(name, reads, writes, fused):
    return H.Op(name, reads, writes, vllm_name=None, extra={"fused": fused})


OPS = {op.name: op for op in [
    _op("rejection_greedy_sample",
        ("draft_token_ids", "cu_num_draft_tokens", "target_argmax", "bonus_token_ids"),
        ("output_token_ids",), False),
    _op("greedy_verify",
        ("draft_token_ids", "cu_num_draft_tokens", "target_logits", "bonus_token_ids"), OUTPUTS, True),
]}


def role_bytes(role, R, k, V, dtype="fp32"):
    N = R * k
    return {"draft_token_ids": 4 * N, "cu_num_draft_tokens": 4 * R, "target_argmax": 8 * N,
            "target_logits": N * V * ELEM_BYTES[dtype], "bonus_token_ids": 4 * R,
            "output_token_ids": 4 * R * (k + 1), "num_emitted": 4 * R,
            "emitted_token_ids": 4 * (N + R), "cu_num_emitted": 4 * (R + 1)}[role]


def op_bytes(op, R, k, V, dtype="fp32") -> int:
    """Bytes the op must move: every read and written tensor once."""
    return sum(role_bytes(r, R, k, V, dtype) for r in op.reads + op.writes)


def make_inputs(op, R, k, V, dtype, device, seed) -> dict:
    """One call's tensors: ``R`` requests of ``k`` drafts; each request's drafts equal the
    target while a coin (ACCEPT) keeps landing heads, then differ; preallocated outputs.
    ``greedy_verify`` gets normal fp32 (or bf16) logits, the unfused op int64 targets."""
    g = torch.Generator(device=device).manual_seed(seed)
    N = R * k
    V = V or 151936  # the unfused op's targets: token ids of a 151,936 vocabulary
    i32 = dict(dtype=torch.int32, device=device)
    t = {"cu_num_draft_tokens": (torch.arange(1, R + 1, device=device) * k).to(torch.int32),
         "bonus_token_ids": torch.randint(0, V, (R, 1), generator=g, device=device).to(torch.int32)}
    if op.extra["fused"]:
        t["target_logits"] = torch.randn(N, V, generator=g, device=device).to(TORCH_DTYPES[dtype])
        target = t["target_logits"].argmax(-1)
    else:
        target = torch.randint(0, V, (N,), generator=g, device=device)
        t["target_argmax"] = target
    miss = torch.rand(R, k, generator=g, device=device) >= ACCEPT
    run_ok = (torch.cumsum(miss.int(), 1) == 0).reshape(-1)  # before the request's first miss
    wrong = torch.randint(1, V, (N,), generator=g, device=device)
    t["draft_token_ids"] = torch.where(run_ok, target, (target + wrong) % V).to(torch.int32)
    t["output_token_ids"] = torch.empty(R, k + 1, **i32)
    if op.extra["fused"]:
        t["num_emitted"] = torch.empty(R, **i32)
        t["emitted_token_ids"] = torch.empty(N + R, **i32)
        t["cu_num_emitted"] = torch.empty(R + 1, **i32)
    return t


# ---------------------------------------------------------------- torch implementations
def t_rejection_greedy_sample(draft, cu, target, bonus, max_spec_len):
    """The rule in eager torch, no Python loop over positions and no host sync: each draft's
    request and position, the first mismatch per request by a scatter-min, the rows written
    by one ``index_put`` (a scratch column takes the bonus of rejected requests)."""
    R, N, L = cu.shape[0], draft.shape[0], max_spec_len
    dev = draft.device
    counts = torch.diff(cu.long(), prepend=cu.new_zeros(1).long())
    req = torch.repeat_interleave(torch.arange(R, device=dev), counts, output_size=N)
    pos = torch.arange(N, device=dev) - (cu.long() - counts)[req]
    miss = ~((draft >= 0) & (draft.long() == target.long()))
    first = counts.scatter_reduce(0, req, torch.where(miss, pos, counts[req]), "amin")
    out = torch.full((R, L + 2), -1, dtype=torch.int32, device=dev)
    out[req, pos] = torch.where(pos <= first[req], target.to(torch.int32), -1)
    col = torch.where(first == counts, counts, L + 1)
    out[torch.arange(R, device=dev), col] = bonus.view(-1)
    return out[:, :L + 1]


def t_parse_output(rows, vocab_size, capacity):
    """vLLM's ``parse_output`` on the device: (num_emitted, packed ids, cu_num_emitted)."""
    R = rows.shape[0]
    keep = (rows != -1) & (rows < vocab_size)
    num = keep.sum(1, dtype=torch.int32)
    cu = torch.cat([num.new_zeros(1), torch.cumsum(num, 0, dtype=torch.int32)])
    dest = torch.where(keep, cu[:-1, None] + torch.cumsum(keep, 1) - 1, capacity)
    packed = torch.full((capacity + 1,), -1, dtype=torch.int32, device=rows.device)
    packed.scatter_(0, dest.reshape(-1).long(), rows.reshape(-1))
    return num, packed[:capacity], cu[: R + 1]


def t_greedy_verify(draft, cu, logits, bonus, max_spec_len):
    rows = t_rejection_greedy_sample(draft, cu, logits.argmax(-1), bonus, max_spec_len)
    return (rows, *t_parse_output(rows, logits.shape[-1], draft.shape[0] + cu.shape[0]))


def vllm_rule_torch(draft, cu, target, bonus, max_spec_len):
    """vLLM's ``rejection_greedy_sample_kernel`` transcribed into torch: ``torch.full(-1)``, then
    the kernel's loop over positions (``pos < num_draft_tokens`` and not yet rejected: store
    the target; ``draft != target`` rejects), vectorised over requests, then the bonus token
    where nothing was rejected."""
    R, L = cu.shape[0], max_spec_len
    dev = draft.device
    out = torch.full((R, L + 1), -1, dtype=torch.int32, device=dev)
    end = cu.long()
    start = torch.cat([end.new_zeros(1), end[:-1]])
    n = end - start
    active = torch.ones(R, dtype=torch.bool, device=dev)
    last = max(draft.shape[0] - 1, 0)
    for pos in range(L):
        live = active & (pos < n)
        idx = (start + pos).clamp(max=last)
        d, t = draft[idx], target[idx]
        out[:, pos] = torch.where(live, t.to(torch.int32), out[:, pos])
        active = active & ~(live & (d.long() != t.long()))
    rows = torch.arange(R, device=dev)
    col = n.clamp(max=L)
    out[rows, col] = torch.where(active, bonus.view(-1), out[rows, col])
    return out


def _rows_out(r):
    return {"output_token_ids": r}


def _verify_out(r):
    return dict(zip(OUTPUTS, r))


def _verify_args(t, case):
    return (t["draft_token_ids"], t["cu_num_draft_tokens"], t["target_logits"],
            t["bonus_token_ids"], case["draft_len"])


def _rows_args(t, case):
    return (t["draft_token_ids"], t["cu_num_draft_tokens"], t["target_argmax"],
            t["bonus_token_ids"], case["draft_len"])


# ---------------------------------------------------------------- providers
class Loomnb(H.LoomnbProvider):
    """loomnb's ops with preallocated outputs."""

    def bind(self, op, t, case):
        if op.extra["fused"]:
            outs = {o: t[o] for o in OUTPUTS}
            return partial(self.m.greedy_verify, *_verify_args(t, case), **outs), _verify_out
        return (partial(self.m.rejection_greedy_sample, *_rows_args(t, case),
                        out=t["output_token_ids"]), _rows_out)


class LoomnbUnfused(Loomnb):
    """``torch.argmax`` of the logits, then loomnb's ``rejection_greedy_sample``: the unfused
    pair the fused ``greedy_verify`` is measured against (compaction not timed)."""
    name = "loomnb_unfused"

    def unsupported(self, case):
        if not self.family.ops[case["op"]].extra["fused"]:
            return "the unfused pair is a baseline for greedy_verify"

    def bind(self, op, t, case):
        d, cu, logits, bonus, k = _verify_args(t, case)
        out = t["output_token_ids"]

        def call():
            return self.m.rejection_greedy_sample(d, cu, logits.argmax(-1), bonus, k, out=out)

        return call, lambda r: _verify_out((r, *t_parse_output(r, logits.shape[-1],
                                                                d.shape[0] + cu.shape[0])))


class Vllm(H.Provider):
    """vLLM 0.24's Triton ``rejection_greedy_sample_kernel`` (grid = requests, num_warps=1) after
    ``torch.full(-1)`` when vllm imports; else the kernel's rule transcribed into torch
    (``vllm_rule_torch``). ``greedy_verify``: ``argmax`` first; vLLM's compaction runs on the
    host (``parse_output``) and is not timed."""
    name = "vllm"

    def setup(self, args, log):
        self.kernel = None
        try:
            from vllm.v1.sample.rejection_sampler import rejection_greedy_sample_kernel
            self.kernel = rejection_greedy_sample_kernel
            self.params = list(getattr(self.kernel, "params", []))
            log(f"[vllm] vLLM's Triton rejection_greedy_sample_kernel{self.kernel.arg_names}")
        except Exception as e:  # noqa: BLE001
            log(f"[vllm] vLLM's Triton kernel does not import here ({e!r}"[:240] + "): "
                "timing the torch transcription of its rule (vllm_rule_torch)")

    def _triton(self, d, cu, target, bonus, k, out):
        vals = {"output_token_ids_ptr": out, "cu_num_draft_tokens_ptr": cu,
                "draft_token_ids_ptr": d, "target_argmax_ptr": target,
                "bonus_token_ids_ptr": bonus, "is_greedy_ptr": None, "max_spec_len": k}
        args = []
        for name in self.kernel.arg_names:
            p = next((p for p in self.params if getattr(p, "name", None) == name), None)
            if name in vals:
                args.append(vals[name])
            elif getattr(p, "is_constexpr", False):
                args.append(False)  # SYNTHETIC_MODE and the like: off
            elif name.endswith("_ptr"):
                args.append(None)   # optional pointers of other modes
            else:
                raise H.NotAvailable(f"cannot bind vLLM kernel argument {name!r}")
        R = cu.shape[0]

        def call():
            out.fill_(-1)  # vLLM's torch.full(..., PLACEHOLDER_TOKEN_ID)
            self.kernel[(R,)](*args, num_warps=1)
            return out

        return call

    def bind(self, op, t, case):
        if not op.extra["fused"]:
            d, cu, target, bonus, k = _rows_args(t, case)
            if self.kernel is not None:
                return self._triton(d, cu, target, bonus, k, t["output_token_ids"]), _rows_out
            return partial(vllm_rule_torch, d, cu, target, bonus, k), _rows_out
        d, cu, logits, bonus, k = _verify_args(t, case)
        cap = d.shape[0] + cu.shape[0]
        collect = lambda r: _verify_out((r, *t_parse_output(r, logits.shape[-1], cap)))  # noqa: E731
        if self.kernel is not None:
            target = torch.empty(d.shape[0], dtype=torch.int64, device=d.device)
            run = self._triton(d, cu, target, bonus, k, t["output_token_ids"])

            def call():
                torch.argmax(logits, -1, out=target)
                return run()

            return call, collect
        return (lambda: vllm_rule_torch(d, cu, logits.argmax(-1), bonus, k)), collect


class Torch(H.Provider):
    """Eager torch: ``t_rejection_greedy_sample`` / ``t_greedy_verify`` (above)."""
    name = "torch"
    FNS = {"rejection_greedy_sample": t_rejection_greedy_sample, "greedy_verify": t_greedy_verify}

    def fn(self, op):
        return self.FNS[op.name]

    def bind(self, op, t, case):
        if op.extra["fused"]:
            return partial(self.fn(op), *_verify_args(t, case)), _verify_out
        return partial(self.fn(op), *_rows_args(t, case)), _rows_out


class TorchCompile(Torch):
    """The torch functions through ``torch.compile(dynamic=True)``: one compile per op (first
    call, outside timed regions); a failure is reported as a skip."""
    name = "torch_compile"
    error_status = "skip"

    def setup(self, args, log):
        for knob in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 64)
        self.compiled = {}

    def fn(self, op):
        if op.name not in self.compiled:
            self.compiled[op.name] = torch.compile(super().fn(op), dynamic=True)
        return self.compiled[op.name]


PROVIDERS = {p.name: p for p in (Loomnb, LoomnbUnfused, Vllm, Torch, TorchCompile)}


class SpecFamily(H.Family):
    name = "spec"  # the result files' prefix (spec_<time>_<gpu>.json), kept
    ops = OPS
    providers = PROVIDERS
    x_axis, x_default, x_quick = "num_reqs", [1, 8, 32, 128, 256], [1, 32, 256]
    shape_axes = [("--draft-lens", "draft_len", [1, 4, 8, 16], "draft tokens per request "
                   "(= max_spec_len); default 1,4,8,16 (--quick: 1,4,16)"),
                  ("--vocab-sizes", "vocab_size", [49152, 151936],
                   "greedy_verify's vocabulary; default 49152 (SmolLM2), 151936 (Qwen2.5)")]
    dtypes = ("fp32", "bf16")
    bytes_model = ("every read and written tensor once: drafts/ids/counts 4 B, int64 targets "
                   "8 B, logits V x 4 B (bf16: 2 B) per draft row")
    fake = {"loomnb": (2.5, 3900.0), "loomnb_unfused": (7.0, 2500.0), "vllm": (6.0, 2500.0),
            "torch": (40.0, 1500.0), "torch_compile": (12.0, 2500.0)}  # (floor µs, GB/s)

    def shape_label(self, case):
        v = f", V {case['vocab_size']}" if case["vocab_size"] else ""
        return f"k {case['draft_len']}{v}"

    def op_bytes(self, op, case):
        return op_bytes(op, case["num_reqs"], case["draft_len"], case["vocab_size"], case["dtype"])

    def make_inputs(self, op, case, device, seed):
        return make_inputs(op, case["num_reqs"], case["draft_len"], case["vocab_size"],
                           case["dtype"], device, seed)

    def cases(self, args):
        """Batches x draft lengths for both ops; the vocabulary axis only for greedy_verify."""
        out = []
        for o in args.ops:
            vocabs = args.vocab_size if self.ops[o].extra["fused"] else [0]
            for k, V, R in itertools.product(args.draft_len, vocabs, args.num_reqs):
                case = {"op": o, "draft_len": k, "vocab_size": V, "num_reqs": R, "dtype": args.dtype,
                        "l2": "cold" if args.l2_cold else "warm", "x": R}
                case["shape"] = self.shape_label(case)
                case["bytes"] = self.op_bytes(self.ops[o], case)
                out.append(case)
        return out


FAMILY = SpecFamily()


def _argv(argv):
    """The family's defaults on top of the harness's: the exactness reference is the ``vllm``
    provider (its Triton kernel, or the transcription of its rule; the harness default);
    ``--quick`` also trims the draft lengths and vocabularies; timing takes 7 repeats of
    1 ms replays unless ``--repeats`` / ``--target-ms`` say otherwise (these ops are a few
    microseconds: that is thousands of calls per case, and it keeps the 60-case default sweep
    to a few minutes)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--quick" in argv and "--draft-lens" not in argv:
        argv += ["--draft-lens", "1,4,16"]
        if "--vocab-sizes" not in argv:
            argv += ["--vocab-sizes", "151936"]
    if "--repeats" not in argv and "--quick" not in argv:
        argv += ["--repeats", "7"]
    if "--target-ms" not in argv and "--quick" not in argv:
        argv += ["--target-ms", "1"]
    return argv


def parse_args(argv=None):
    return H.parse_args(FAMILY, _argv(argv))


def main(argv=None) -> Path:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--loop" in argv:
        sys.exit("bench_spec_decode.py: the decode loop with and without speculation is "
                 "`python3 benchmarks/bench_decode.py --speculative` (same options)")
    return H.run(FAMILY, _argv(argv))


if __name__ == "__main__":
    main()
