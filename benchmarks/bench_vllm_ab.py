#!/usr/bin/env python3
"""Same-model A/B inside vLLM 0.24: the engine with and without loomnb, tokens compared.

Three configurations of one model (SmolLM2-135M bf16 by default), each in a **fresh process**,
run in both orders (a, b, c then c, b, a):

* (a) ``default``  -- vLLM's default: torch.compile, Inductor-generated kernels for the norms,
  SiLU-and-mul and RoPE; full CUDA graphs for decode;
* (b) ``vllm_ops`` -- vLLM's own CUDA ops: IR priority ``vllm_c`` for ``rms_norm`` and
  ``fused_add_rms_norm``, ``custom_ops = ["none", "+silu_and_mul", "+rotary_embedding"]``;
* (c) ``loomnb``   -- (b) with loomnb's plug-in loaded (``VLLM_PLUGINS=loomnb``) and first:
  IR priority ``["loomnb", "vllm_c", "native"]``, ``"+SiluAndMul"``/``"+RotaryEmbedding"`` for
  the ops this loomnb has (``loomnb.integrations.vllm.engine_kwargs``).

Each process reports, with greedy decoding (temperature 0) and EOS ignored:

* **tokens**: 8 prompts x 32 tokens; the parent compares every pair of configurations in each
  order (identical, or per prompt the first divergence with both runs' logprobs of both tokens
  -- vLLM's raw logprobs, ``logit - logsumexp``, so the gap between two tokens is their logit
  gap) and each configuration with itself across the two orders;
* **TPOT and tokens/s** at batch 1, 8 and 64, 256 output tokens: TPOT = (t(256 tokens) - t(1
  token)) / 255 from the medians of ``--reps`` ``LLM.generate`` wall times (each many steps,
  never one launch), tokens/s = batch x 256 / t(256 tokens);
* **init time**: ``LLM(...)`` construction (model load, torch.compile, CUDA-graph capture, and
  for (c) numba's compilation of loomnb's kernels); vLLM's compile cache is disabled unless
  ``--compile-cache``, so every process compiles from scratch and the two orders compare;
* **launches per decode step**: torch.profiler in the worker process (through
  ``LLM.collective_rpc``) over two generations of 8 and 24 tokens; the difference divided by 16
  counts the CUDA kernels of one step -- all of them, loomnb's (numba names them
  ``_ZN6loomnb...``), and each kernel's count and device time per step (kernels replayed
  inside CUDA graphs included), which is what explains a TPOT difference;
* the plug-in's routes and routing counts from every worker (``loomnb.integrations.vllm.report``,
  one per tensor-parallel rank, each naming its rank and device; kernel counts are rank 0's).

``--tensor-parallel-size N`` runs every configuration with vLLM's ``tensor_parallel_size=N``
(NCCL with NVLink multicast off, ``NCCL_NVLS_ENABLE=0``); the targets then include the plug-in
loaded in all N workers (``plugin_in_every_rank``).

``--configs`` may add ``loomnb_norms``, ``loomnb_silu`` and ``loomnb_rope``: (b) with one op
family given to loomnb (``engine_kwargs("loomnb", ops=...)``), tokens only, each compared with
(b) -- which op a (c)-vs-(b) token difference comes from -- and three RoPE controls (tokens only,
through a second plug-in entry point, ``register_control``): ``vllm_rope_copy`` (vLLM's RoPE on
contiguous copies of q and k), ``rope_check`` (loomnb's RoPE, each call compared on the
device with vLLM's on copies; the counts in the run's ``rope_check``) and ``rope_plain``
(loomnb's RoPE alone, through the control plug-in).

The parent writes one JSON to ``benchmarks/results/vllm_ab_<stamp>_<gpu>.json`` with every
run, the comparisons and the targets: tokens of (c) identical to (b); TPOT of (c) >= 1.0x the
faster of (a) and (b) at each batch, in both orders.

Needs (GPU machine): vLLM 0.24.0 importable from ``PYTHONPATH`` (vLLM re-imports itself in its
subprocesses), ``VLLM_USE_FLASHINFER_SAMPLER=0`` (set here when unset), and a bf16
Hugging Face folder of the model (``--model``, default ``$LOOMNB_VLLM_MODEL`` or
``/tmp/smollm2-hf``). loomnb need not be installed: the parent puts the repository and a
generated ``.dist-info`` holding the ``vllm.general_plugins`` entry point on (c)'s
``PYTHONPATH``. Each process sets ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` so that the
profiler and report functions can be sent to the worker.

    python3 benchmarks/bench_vllm_ab.py --model /tmp/smollm2-hf           # the full A/B
    python3 benchmarks/bench_vllm_ab.py --model /tmp/smollm2-hf --quick   # fewer reps/tokens
    python3 benchmarks/bench_vllm_ab.py --dry-run      # CPU: a fake engine, same plumbing

Where one command may run only so long, run one order per command and merge::

    python3 benchmarks/bench_vllm_ab.py --model M --orders forward --out /tmp/ab_f.json
    python3 benchmarks/bench_vllm_ab.py --model M --orders reversed --out /tmp/ab_r.json
    python3 benchmarks/bench_vllm_ab.py --merge /tmp/ab_f.json /tmp/ab_r.json

``--dry-run`` runs every step with a deterministic fake engine (no vLLM, no GPU, no torch in the
children) and writes its JSON to a temporary folder unless ``--out`` is given.
"""

import argparse
import datetime
import hashlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
CONFIGS = ("default", "vllm_ops", "loomnb")
# (c) with one op family at a time given to loomnb, the rest to vLLM's own CUDA ops: token
# check only (no timing), to trace a (c)-vs-(b) token difference to an op
ISOLATED = {"loomnb_norms": ("rms_norm", "fused_add_rms_norm"),
            "loomnb_silu": ("SiluAndMul",),
            "loomnb_rope": ("RotaryEmbedding",)}
# control: vLLM's own in-place RoPE kernel on contiguous copies of q and k -- the memory layout
# of loomnb's out-of-place RoPE (new q/k buffers) with vLLM's bits (tokens only)
# rope_check: loomnb's out-of-place RoPE (its result used), each call also compared on the
# device with vLLM's kernel on copies of the same q and k; the counts come back in the JSON
# rope_plain: loomnb's out-of-place RoPE through the control plug-in, nothing else (what
# loomnb_rope does, without the loomnb plug-in; with rope_check: do the comparison's extra
# kernels change the tokens?)
CONTROLS = ("vllm_rope_copy", "rope_check", "rope_plain")
ALL_CONFIGS = CONFIGS + tuple(ISOLATED) + CONTROLS
LABELS = {"default": "(a) vLLM default (Inductor-generated kernels)",
          "vllm_ops": "(b) vLLM with its CUDA custom ops",
          "loomnb": "(c) vLLM + loomnb",
          "loomnb_norms": "(b) with only the norms given to loomnb (tokens only)",
          "loomnb_silu": "(b) with only SiLU-and-mul given to loomnb (tokens only)",
          "loomnb_rope": "(b) with only RoPE given to loomnb (tokens only)",
          "vllm_rope_copy": "(b) with vLLM's RoPE on contiguous copies of q and k (tokens only)",
          "rope_check": "(b) with loomnb's RoPE, each call compared with vLLM's on copies (tokens only)",
          "rope_plain": "(b) with loomnb's RoPE through the control plug-in (tokens only)"}
ORDERS = {"forward": ALL_CONFIGS, "reversed": tuple(reversed(ALL_CONFIGS))}
PLUGIN_ENTRY = "loomnb = loomnb.integrations.vllm:register"
CONTROL_ENTRY = "loomnb_ab_control = benchmarks.bench_vllm_ab:register_control"


_ROPE_NE = None  # (in the worker) int64 [2] on the GPU: 16-bit values that differed, compared


def _count_ne(a, b):
    """Add to ``_ROPE_NE`` how many 16-bit values of ``a`` and ``b`` differ (NaN equal to NaN)
    and how many were compared: device work only, so it runs inside CUDA graphs."""
    global _ROPE_NE
    import torch
    if _ROPE_NE is None:
        _ROPE_NE = torch.zeros(2, dtype=torch.int64, device=a.device)
    ne = (a.view(torch.int16) != b.view(torch.int16)) & ~(a.isnan() & b.isnan())
    _ROPE_NE[0] += ne.sum()
    _ROPE_NE[1] += a.numel()


_OPS = {}


def _count_ne_op():
    """``torch.ops.loomnb_ab.count_ne(a, b)``: :func:`_count_ne` as a custom op that nominally
    mutates ``a`` (so that torch.compile keeps it); defined once per process."""
    if "count_ne" not in _OPS:
        import torch

        @torch.library.custom_op("loomnb_ab::count_ne", mutates_args=("a",))
        def count_ne(a: torch.Tensor, b: torch.Tensor) -> None:
            _count_ne(a, b)

        _OPS["count_ne"] = count_ne
    return _OPS["count_ne"]


def register_control():
    """vLLM general plug-in of the control runs (``LOOMNB_AB_CONTROL`` names which):

    * ``vllm_rope_copy``: ``RotaryEmbedding`` whose CUDA forward is vLLM's own (in-place
      ``_C.rotary_embedding``) applied to contiguous copies of the query and key, so the rotated
      q and k live in new buffers as with loomnb's out-of-place RoPE;
    * ``rope_check``: loomnb's ``apply_rope_with_cos_sin_cache`` (its result is used), and on
      every call vLLM's op on copies of the same query and key, compared on the device
      (``loomnb_ab::count_ne``, a custom op that nominally mutates loomnb's output so that
      nothing removes it); ``_rpc_rope_check`` reads the counts;
    * ``rope_plain``: loomnb's ``apply_rope_with_cos_sin_cache`` alone (``loomnb_rope``'s route
      without the loomnb plug-in, and ``rope_check`` without its comparison)."""
    import torch
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    which = os.environ.get("LOOMNB_AB_CONTROL", "vllm_rope_copy")

    class CopyThenVllmRope(RotaryEmbedding):
        def forward_cuda(self, positions, query, key=None):
            query = query.clone(memory_format=torch.contiguous_format)
            key = None if key is None else key.clone(memory_format=torch.contiguous_format)
            return super().forward_cuda(positions, query, key)

    if which == "vllm_rope_copy":
        RotaryEmbedding.register_oot(CopyThenVllmRope)
        return
    import loomnb

    def loomnb_rope(op, positions, query, key):
        return loomnb.apply_rope_with_cos_sin_cache(positions, query, key, op.head_size,
                                                    op._match_cos_sin_cache_dtype(query),
                                                    op.is_neox_style)

    if which == "rope_plain":
        class PlainLoomnbRope(RotaryEmbedding):
            def forward_cuda(self, positions, query, key=None):
                return loomnb_rope(self, positions, query, key)

        RotaryEmbedding.register_oot(PlainLoomnbRope)
        return

    count_ne = _count_ne_op()

    class CheckedLoomnbRope(CopyThenVllmRope):
        def forward_cuda(self, positions, query, key=None):
            qo, ko = loomnb_rope(self, positions, query, key)
            qv, kv = super().forward_cuda(positions, query, key)  # vLLM's, on copies
            count_ne(qo, qv)
            count_ne(ko, kv)
            return qo, ko

    RotaryEmbedding.register_oot(CheckedLoomnbRope)


def _rpc_rope_check(worker, reset=False):
    """(In the worker.) ``[differing, compared]`` 16-bit values of the ``rope_check`` run so far
    (``reset``: zero them first, after vLLM's warm-up and capture runs on made-up inputs)."""
    import sys as _sys
    m = _sys.modules.get("benchmarks.bench_vllm_ab")
    if m is None or m._ROPE_NE is None:
        return None
    if reset:
        import torch
        with torch.inference_mode():  # the counter was made inside vLLM's inference mode
            m._ROPE_NE.zero_()
        return [0, 0]
    return m._ROPE_NE.tolist()


CHECK_PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain in one paragraph why the sky is blue.",
    "List three prime numbers greater than 100:",
    "def fibonacci(n):",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "Once upon a time, in a village at the edge of a forest,",
    "The three laws of thermodynamics are",
]
ENV_KEYS = ("VLLM_PLUGINS", "VLLM_USE_FLASHINFER_SAMPLER", "VLLM_ALLOW_INSECURE_SERIALIZATION",
            "VLLM_DISABLE_COMPILE_CACHE", "NCCL_NVLS_ENABLE", "PYTHONPATH")
LOOMNB_KERNEL = "loomnb"  # numba's mangled kernel names start _ZN6loomnb...


def timing_prompts(batch):
    """``batch`` distinct prompts (distinct from their first token, so prefix caching shares
    nothing between them)."""
    return [f"Story {i}: {CHECK_PROMPTS[i % len(CHECK_PROMPTS)]}" for i in range(batch)]


def make_plan(args):
    quick = args.quick
    return {"model": args.model, "check_prompts": len(CHECK_PROMPTS), "check_tokens": 32,
            "logprobs": 5, "batches": [int(b) for b in args.batches.split(",")],
            "tokens": 128 if quick else args.tokens, "reps": 1 if quick else args.reps,
            "profile_batches": [1] if quick else [1, 64], "profile_steps": [8, 24],
            "max_model_len": args.max_model_len, "seed": 0,
            "tensor_parallel_size": args.tensor_parallel_size,
            "gpu_memory_utilization": args.gpu_memory_utilization}


# ============================================================================================
# Child: one configuration in a fresh process
def _rpc_profile_start(worker):
    """(In vLLM's worker process.) Start a CUDA-activity profiler kept on the worker object."""
    import torch
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    prof.start()
    worker._loomnb_ab_profiler = prof
    return True


def _rpc_profile_stop(worker):
    """(In the worker.) Stop it: ``{kernel name: [count, device microseconds]}``."""
    import torch
    from torch.autograd import DeviceType
    prof = worker._loomnb_ab_profiler
    torch.cuda.synchronize()
    prof.stop()
    out = {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        n, us = out.get(e.name, (0, 0.0))
        out[e.name] = (n + 1, us + e.time_range.elapsed_us())
    return {k: [n, us] for k, (n, us) in out.items()}


def _rpc_plugin_report(worker):
    """(In the worker.) The loomnb plug-in's routes and counts, if vLLM loaded it there."""
    import sys as _sys
    m = _sys.modules.get("loomnb.integrations.vllm")
    if m is None:
        return {"loaded": False}
    return dict(m.report(), loaded=True)


def _rpc_device(worker):
    import torch
    return torch.cuda.get_device_name()


class VllmEngine:
    """vLLM's offline ``LLM`` with one configuration's engine arguments."""

    def __init__(self, config, plan, kwargs):
        self.config, self.plan, self.kwargs = config, plan, kwargs
        self.clock = time.perf_counter

    def start(self):
        from vllm import LLM, SamplingParams
        self.SamplingParams = SamplingParams
        p = self.plan
        self.llm = LLM(model=p["model"], dtype="bfloat16", seed=p["seed"],
                       max_model_len=p["max_model_len"],
                       tensor_parallel_size=p.get("tensor_parallel_size", 1),
                       gpu_memory_utilization=p["gpu_memory_utilization"], **self.kwargs)

    def generate(self, prompts, max_tokens, logprobs=None):
        sp = self.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                 logprobs=logprobs)
        outs = self.llm.generate(prompts, sp, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        lps = None
        if logprobs:
            lps = [[{str(t): float(lp.logprob) for t, lp in (pos or {}).items()}
                    for pos in o.outputs[0].logprobs] for o in outs]
        return tokens, lps

    def finish(self):
        pass  # vLLM shuts down at exit; the parent's timeout covers a shutdown that hangs

    def profile(self, prompts, max_tokens):
        self.llm.collective_rpc(_rpc_profile_start)
        self.generate(prompts, max_tokens)
        return self.llm.collective_rpc(_rpc_profile_stop)[0]

    def plugin_report(self):
        """The plug-in's report from every worker (one per tensor-parallel rank)."""
        return self.llm.collective_rpc(_rpc_plugin_report)

    def rope_check(self, reset=False):
        return self.llm.collective_rpc(_rpc_rope_check, kwargs={"reset": reset})[0]

    def describe(self):
        import torch
        import vllm
        d = {"vllm_version": vllm.__version__, "torch_version": torch.__version__}
        try:
            d["gpu"] = self.llm.collective_rpc(_rpc_device)[0]
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            d["gpu"] = f"unknown ({type(e).__name__}: {e})"
        try:
            cfg = self.llm.llm_engine.vllm_config
            d["custom_ops"] = list(cfg.compilation_config.custom_ops)
            d["ir_op_priority"] = str(cfg.kernel_config.ir_op_priority)
            d["compilation_mode"] = str(cfg.compilation_config.mode)
            d["cudagraph_mode"] = str(cfg.compilation_config.cudagraph_mode)
        except Exception as e:  # noqa: BLE001
            d["config_error"] = f"{type(e).__name__}: {e}"
        return d


class FakeEngine:
    """A deterministic stand-in with ``VllmEngine``'s interface, for ``--dry-run`` and the CPU
    tests: tokens from a hash of (prompt, position); one configuration diverges where
    ``LOOMNB_FAKE_DIVERGE=<config>:<prompt index>:<position>`` says; a virtual clock that each
    generation advances by 1 ms plus 40 us per token times the configuration's fake speed (so
    TPOT is 0.040 / 0.038 / 0.036 ms exactly); made-up kernel counts. ``LOOMNB_FAKE_FAIL=<config>``
    fails that start and ``LOOMNB_FAKE_HANG=<config>`` hangs after the results are written (the
    parent's failure and timeout paths)."""

    SPEED = {"default": 1.0, "vllm_ops": 0.95, "loomnb": 0.9,
             **{c: 0.9 for c in (*ISOLATED, *CONTROLS)}}
    VOCAB = 49152

    def __init__(self, config, plan, kwargs):
        self.config, self.plan, self.kwargs = config, plan, kwargs
        self.now = 0.0
        spec = os.environ.get("LOOMNB_FAKE_DIVERGE", "")
        self.diverge = None
        if spec:
            cfg, prompt, pos = spec.split(":")
            if cfg == config:
                self.diverge = (CHECK_PROMPTS[int(prompt)], int(pos))

    def start(self):
        if os.environ.get("LOOMNB_FAKE_FAIL") == self.config:
            raise RuntimeError(f"fake engine: {self.config} fails to start (LOOMNB_FAKE_FAIL)")
        self.now += 0.5

    def clock(self):
        return self.now

    def finish(self):
        if os.environ.get("LOOMNB_FAKE_HANG") == self.config:  # a shutdown that never ends
            time.sleep(3600)

    def _token(self, prompt, i):
        t = int(hashlib.sha256(f"{prompt}|{i}".encode()).hexdigest()[:8], 16) % self.VOCAB
        if self.diverge and prompt == self.diverge[0] and i >= self.diverge[1]:
            t = (t + 1) % self.VOCAB
        return t

    def generate(self, prompts, max_tokens, logprobs=None):
        self.now += 1e-3 + max_tokens * 4e-5 * self.SPEED[self.config]
        tokens = [[self._token(p, i) for i in range(max_tokens)] for p in prompts]
        lps = None
        if logprobs:
            v = self.VOCAB  # each position: its token and both neighbours
            lps = [[{str(t): -0.25, str((t + 1) % v): -1.75, str((t - 1) % v): -2.5} for t in toks]
                   for toks in tokens]
        return tokens, lps

    def profile(self, prompts, max_tokens):
        steps = max_tokens
        counts = {"void vllm::other_kernel<float>(float*)": [40 * steps + 7, 80.0 * steps]}
        if self.config == "loomnb":
            counts["_ZN6loomnb3ops13_norm_kernels_fake"] = [61 * steps, 61 * 1.5 * steps]
        else:
            counts["void vllm::rms_norm_kernel<c10::BFloat16>"] = [61 * steps, 61 * 1.6 * steps]
        return counts

    def rope_check(self, reset=False):
        return [0, 0] if reset else [0, 1000]

    def plugin_report(self):
        ranks = range(self.plan.get("tensor_parallel_size", 1))
        if not self.config.startswith("loomnb"):
            return [{"loaded": False} for _ in ranks]
        return [{"loaded": True, "plugin": "loomnb.integrations.vllm (fake engine)",
                 "process": {"pid": os.getpid(), "rank": r, "world_size": len(ranks),
                             "device": f"cuda:{r}"},
                 "routes": [], "routed_counts": {"rms_norm": 1, "fused_add_rms_norm": 60},
                 "fallback_counts": {}} for r in ranks]

    def describe(self):
        return {"vllm_version": "fake", "torch_version": "fake", "gpu": "fake-engine",
                "custom_ops": self.kwargs.get("compilation_config", {}).get("custom_ops", []),
                "ir_op_priority": str(self.kwargs.get("ir_op_priority", {}))}


def _entry_points():
    """The ``vllm.general_plugins`` entry points this process can see (what vLLM would load)."""
    from importlib.metadata import entry_points
    return sorted({f"{e.name} = {e.value}" for e in entry_points(group="vllm.general_plugins")})


def launches(engine, prompts, steps):
    """Kernels per decode step from two profiled generations of ``steps[0]`` and ``steps[1]``
    tokens: (second - first) / (steps[1] - steps[0]), which cancels the prefill step."""
    try:
        a, b = (engine.profile(prompts, s) for s in steps)
    except Exception as e:  # noqa: BLE001 - recorded in the JSON, the rest of the run goes on
        return {"steps": steps, "error": f"{type(e).__name__}: {e}"}
    d = steps[1] - steps[0]
    per = {}
    for name in set(a) | set(b):
        (na, ua), (nb, ub) = a.get(name, (0, 0.0)), b.get(name, (0, 0.0))
        per[name] = ((nb - na) / d, (ub - ua) / d)
    kernels = {k: v for k, v in per.items() if not k.startswith(("Memcpy", "Memset"))}
    ours = {k: v for k, v in kernels.items() if LOOMNB_KERNEL in k}
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]
    return {"steps": steps, "error": None,
            "loomnb_per_step": round(sum(n for n, _ in ours.values()), 3),
            "kernels_per_step": round(sum(n for n, _ in kernels.values()), 3),
            "loomnb_us_per_step": round(sum(u for _, u in ours.values()), 3),
            "device_us_per_step": round(sum(u for _, u in kernels.values()), 3),
            "top_kernels": [{"name": k[:160], "per_step": round(n, 3), "us_per_step": round(u, 3)}
                            for k, (n, u) in top]}


def run_child(args):
    plan, kwargs = json.loads(args.plan), json.loads(args.engine_kwargs)
    out = {"config": args.config, "label": LABELS[args.config], "order": args.order,
           "position": args.position, "pid": os.getpid(), "engine": args.engine, "engine_kwargs": kwargs,
           "env": {k: os.environ.get(k) for k in ENV_KEYS}, "entry_points": _entry_points()}
    engine = (FakeEngine if args.engine == "fake" else VllmEngine)(args.config, plan, kwargs)
    clock = engine.clock  # the fake engine's is virtual
    t0 = clock()
    engine.start()
    out["init_s"] = clock() - t0
    out.update(engine.describe())
    if args.config == "rope_check":
        engine.rope_check(reset=True)
    tokens, lps = engine.generate(CHECK_PROMPTS[:plan["check_prompts"]], plan["check_tokens"],
                                  logprobs=plan["logprobs"])
    if args.config == "rope_check":  # [16-bit values that differed, compared] in the check
        out["rope_check"] = engine.rope_check()
        print(f"rope_check: {out['rope_check']}", flush=True)
    out["check"] = {"prompts": CHECK_PROMPTS[:plan["check_prompts"]], "tokens": tokens,
                    "logprobs": lps}
    out["timing"] = {}
    n = plan["tokens"]
    for batch in plan["batches"] if args.config in CONFIGS else ():  # the others: tokens only
        prompts = timing_prompts(batch)
        engine.generate(prompts, 8)  # warm-up at this batch size
        full, first = [], []
        for _ in range(plan["reps"]):
            t = clock()
            toks, _ = engine.generate(prompts, n)
            full.append(clock() - t)
            if any(len(x) != n for x in toks):
                raise RuntimeError(f"batch {batch}: expected {n} tokens per prompt (EOS ignored), "
                                   f"got {sorted({len(x) for x in toks})}")
            t = clock()
            engine.generate(prompts, 1)
            first.append(clock() - t)
        tf, t1 = statistics.median(full), statistics.median(first)
        out["timing"][str(batch)] = {"t_full_s": full, "t_first_s": first,
                                     "tpot_ms": (tf - t1) / (n - 1) * 1e3,
                                     "tokens_per_s": batch * n / tf}
    out["launches"] = {str(b): launches(engine, timing_prompts(b), plan["profile_steps"])
                       for b in (plan["profile_batches"] if args.config in CONFIGS else ())}
    per_rank = engine.plugin_report()
    out["plugin"], out["plugin_per_rank"] = per_rank[0], per_rank  # rank 0's, and every rank's
    Path(args.child_out).write_text(json.dumps(out, indent=1))
    engine.finish()
    return 0


# ============================================================================================
# Parent: fresh processes, both orders, comparisons
def write_entry_point(folder):
    """A minimal ``.dist-info`` declaring loomnb's ``vllm.general_plugins`` entry point, so a
    checkout that is not pip-installed is found by vLLM's plug-in loader (``importlib.metadata``
    reads every ``*.dist-info`` on ``sys.path``). Returns the folder to put on ``PYTHONPATH``."""
    d = Path(folder) / "site" / "loomnb_vllm_plugin-0.1.0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: loomnb-vllm-plugin\nVersion: 0.1.0\n")
    (d / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN_ENTRY}\n{CONTROL_ENTRY}\n")
    return str(d.parent)


def child_env(config, plugin_site, compile_cache):
    env = dict(os.environ)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if not compile_cache:
        env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    env["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off (tensor parallelism)
    # (a)/(b): no general plug-in at all; (c) and the ISOLATED ones: loomnb's only; the
    # CONTROLS: the A/B's control plug-in only
    ours = config.startswith("loomnb") or config in CONTROLS
    env["VLLM_PLUGINS"] = ("loomnb_ab_control" if config in CONTROLS
                           else "loomnb" if ours else "")
    if config in CONTROLS:
        env["LOOMNB_AB_CONTROL"] = config
    paths = [str(REPO)] + ([plugin_site] if ours else [])
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run_one(args, plan, config, kwargs, order, position, plugin_site, tmp):
    tag = f"{order}-{position}-{config}"
    child_out, log = Path(tmp) / f"{tag}.json", Path(tmp) / f"{tag}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--config", config,
           "--order", order, "--position", str(position), "--engine", args.engine,
           "--plan", json.dumps(plan), "--engine-kwargs", json.dumps(kwargs),
           "--child-out", str(child_out)]
    print(f"[{tag}] {LABELS[config]}: starting a fresh process", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        # its own process group: a timeout ends vLLM's engine-core process with it
        proc = subprocess.Popen(cmd, env=child_env(config, plugin_site, args.compile_cache),
                                stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    wall = time.perf_counter() - t0
    if not child_out.exists():  # results are written before vLLM shuts down
        tail = log.read_text(errors="replace").splitlines()[-40:]
        print(f"[{tag}] FAILED ({rc}) after {wall:.0f} s; last lines:\n  " + "\n  ".join(tail),
              flush=True)
        return {"config": config, "order": order, "position": position,
                "error": f"child exited {rc}", "log_tail": tail, "wall_s": wall}
    res = json.loads(child_out.read_text())
    res["wall_s"], res["exit"] = wall, rc  # non-zero: it failed after writing, e.g. at shutdown
    print(f"[{tag}] done in {wall:.0f} s (init {res['init_s']:.1f} s)", flush=True)
    return res


def compare_tokens(a, b):
    """Greedy tokens of runs ``a`` and ``b``: identical, or per prompt the first divergence
    with each run's logprobs of both tokens (None where a token is outside a run's top-k)."""
    ta, tb = a["check"]["tokens"], b["check"]["tokens"]
    la, lb = a["check"].get("logprobs"), b["check"].get("logprobs")
    na, nb = f"{a['config']}/{a['order']}", f"{b['config']}/{b['order']}"
    divs = []
    for p, (xa, xb) in enumerate(zip(ta, tb)):
        pos = next((i for i, (u, v) in enumerate(zip(xa, xb)) if u != v), None)
        if pos is None:
            if len(xa) == len(xb):
                continue
            pos = min(len(xa), len(xb))
        ua = xa[pos] if pos < len(xa) else None
        ub = xb[pos] if pos < len(xb) else None

        def lp(lps, tok, p=p, pos=pos):
            if lps is None or tok is None or pos >= len(lps[p]):
                return None
            return lps[p][pos].get(str(tok))

        divs.append({"prompt": p, "position": pos, "tokens": {na: ua, nb: ub},
                     "logprobs": {na: {str(ua): lp(la, ua), str(ub): lp(la, ub)},
                                  nb: {str(ua): lp(lb, ua), str(ub): lp(lb, ub)}}})
    return {"a": na, "b": nb, "identical": not divs and len(ta) == len(tb),
            "prompts": len(ta), "prompts_identical": len(ta) - len(divs),
            "tokens_per_prompt": max((len(x) for x in ta), default=0), "first_divergences": divs}


CUSTOM_OP_CLASSES = ("SiluAndMul", "RotaryEmbedding")


def run_forwards(run):
    """``{"seen": {class: {forward: instances}}, "want": {class: forward}, "as_configured":
    bool}`` for a loomnb run: which forward each CustomOp instance got (the plug-in's
    ``custom_op_modes``) against what the configuration asks for -- loomnb's for the classes
    it gives loomnb, vLLM's own CUDA op for the others. None when the plug-in did not report."""
    seen = (run.get("plugin") or {}).get("custom_op_modes")
    if seen is None:
        return None
    given = CUSTOM_OP_CLASSES if run["config"] == "loomnb" else ISOLATED[run["config"]]
    want = {c: "loomnb" if c in given else "vllm" for c in CUSTOM_OP_CLASSES}
    ok = all(set(seen.get(c, {})) <= {want[c]} for c in CUSTOM_OP_CLASSES)
    return {"seen": seen, "want": want, "as_configured": ok}


def plugin_ranks(runs, plan):
    """``{"<config>/<order>": {"ranks", "devices", "loaded_in_every_rank", "routed_counts",
    "fallback_counts"}}`` for the runs that load the plug-in (lists: one entry per worker): the
    ranks that reported (each worker's ``process``: torch.distributed's global rank, which is
    the tensor-parallel rank while there is no pipeline or data parallelism) against the plan's
    tensor-parallel size."""
    tp = plan.get("tensor_parallel_size", 1)
    out = {}
    for r in runs:
        if not (r["config"].startswith("loomnb") and "plugin_per_rank" in r):
            continue
        reps = r["plugin_per_rank"]
        got = [(p.get("process") or {}).get("rank") for p in reps]
        out[f"{r['config']}/{r['order']}"] = {
            "ranks": got, "devices": [(p.get("process") or {}).get("device") for p in reps],
            "loaded_in_every_rank": (len(reps) == tp and all(p.get("loaded") for p in reps)
                                     and sorted(got) == list(range(tp))),
            "routed_counts": [p.get("routed_counts") for p in reps],
            "fallback_counts": [p.get("fallback_counts") for p in reps]}
    return out


def analyse(runs, plan):
    ok = [r for r in runs if "error" not in r]
    by = {(r["order"], r["config"]): r for r in ok}
    orders = sorted({r["order"] for r in runs}, key=list(ORDERS).index)
    tokens, tpot, init, launch = [], {}, {}, {}
    for order in orders:
        pairs = [("loomnb", "vllm_ops"), ("loomnb", "default"), ("vllm_ops", "default")]
        pairs += [(c, "vllm_ops") for c in (*ISOLATED, *CONTROLS)]
        for x, y in pairs + [("loomnb_rope", "vllm_rope_copy"), ("rope_check", "loomnb_rope"),
                             ("rope_plain", "loomnb_rope"), ("rope_plain", "rope_check")]:
            if (order, x) in by and (order, y) in by:
                tokens.append(compare_tokens(by[(order, x)], by[(order, y)]))
        tpot[order] = {}
        for batch in (str(b) for b in plan["batches"]):
            row = {c: by[(order, c)]["timing"][batch]["tpot_ms"] for c in CONFIGS
                   if (order, c) in by}
            tps = {c: by[(order, c)]["timing"][batch]["tokens_per_s"] for c in CONFIGS
                   if (order, c) in by}
            peers = [row[c] for c in ("default", "vllm_ops") if c in row]
            ratio = min(peers) / row["loomnb"] if peers and row.get("loomnb") else None
            tpot[order][batch] = {"tpot_ms": row, "tokens_per_s": tps,
                                  "loomnb_speedup_vs_faster_peer": ratio}
        init[order] = {c: by[(order, c)]["init_s"] for c in CONFIGS if (order, c) in by}
        launch[order] = {c: {b: {k: v.get(k) for k in ("loomnb_per_step", "kernels_per_step",
                                                         "loomnb_us_per_step", "device_us_per_step",
                                                         "error")}
                             for b, v in by[(order, c)]["launches"].items()}
                         for c in CONFIGS if (order, c) in by}
    across = [compare_tokens(by[(orders[0], c)], by[(orders[1], c)]) for c in ALL_CONFIGS
              if len(orders) > 1 and (orders[0], c) in by and (orders[1], c) in by]
    c_vs_b = [t for t in tokens if t["a"].startswith("loomnb/") and t["b"].startswith("vllm_ops/")]
    ratios = [v["loomnb_speedup_vs_faster_peer"] for o in tpot.values() for v in o.values()]
    by_op = {}
    for t in tokens:
        c = t["a"].split("/")[0]
        if c in ISOLATED and t["b"].startswith("vllm_ops/"):
            by_op[c] = by_op.get(c, True) and t["identical"]
    forwards = {f"{r['config']}/{r['order']}": run_forwards(r) for r in ok
                if r["config"] == "loomnb" or r["config"] in ISOLATED}
    ranks = plugin_ranks(ok, plan)
    targets = {
        "tokens_c_identical_to_b": bool(c_vs_b) and all(t["identical"] for t in c_vs_b),
        "tokens_identical_to_b_with_only": by_op,
        "tpot_c_vs_faster_of_a_b": {o: {b: v["loomnb_speedup_vs_faster_peer"]
                                        for b, v in rows.items()} for o, rows in tpot.items()},
        "tpot_target_met": bool(ratios) and all(r is not None and r >= 1.0 for r in ratios),
        "all_runs_completed": len(ok) == len(runs),
        # every loomnb run's CustomOps ran the forward its configuration asks for (None: a run
        # whose plug-in did not report it)
        "custom_op_forwards_as_configured": (None if any(v is None for v in forwards.values())
                                             else all(v["as_configured"] for v in forwards.values())),
        # every run that loads the plug-in loaded it in every worker (tensor-parallel rank),
        # each reporting its own rank
        # (None: no run loads the plug-in)
        "plugin_in_every_rank": (all(v["loaded_in_every_rank"] for v in ranks.values())
                                 if ranks else None),
    }
    return {"targets": targets, "tokens": tokens, "tokens_across_orders": across,
            "custom_op_forwards": forwards, "plugin_per_rank": ranks,
            "tpot": tpot, "init_s": init, "launches_per_decode_step": launch}


def print_summary(result):
    a = result["analysis"]
    print("\nTPOT (ms) and loomnb's speed-up over the faster of (a)/(b):")
    for order, rows in a["tpot"].items():
        for batch, v in rows.items():
            t = v["tpot_ms"]
            r = v["loomnb_speedup_vs_faster_peer"]
            cells = "  ".join(f"{c} {t[c]:.3f}" for c in CONFIGS if c in t)
            print(f"  {order:8s} batch {batch:>3s}: {cells}  ->  "
                  + (f"{r:.3f}x" if r is not None else "n/a"))
    for t in a["tokens"] + a["tokens_across_orders"]:
        state = "identical" if t["identical"] else (
            f"{t['prompts_identical']}/{t['prompts']} prompts identical; first divergence "
            f"{t['first_divergences'][0]['prompt']}@{t['first_divergences'][0]['position']}")
        print(f"  tokens {t['a']} vs {t['b']}: {state}")
    for order, per in a["launches_per_decode_step"].items():
        for c, rows in per.items():
            for b, v in rows.items():
                print(f"  launches/step {order} {c} batch {b}: loomnb {v['loomnb_per_step']}, "
                      f"all {v['kernels_per_step']}" + (f" (error {v['error']})" if v["error"] else ""))
    for run, f in a.get("custom_op_forwards", {}).items():
        if f is not None and not f["as_configured"]:
            print(f"  WARNING {run}: CustomOp forwards {f['seen']}, configured {f['want']}")
    print("  targets:", json.dumps(a["targets"]))


def write_result(result, out_arg, tmp, engine):
    gpu = next((r.get("gpu") for r in result["runs"] if r.get("gpu")), "unknown")
    if out_arg:
        out = Path(out_arg)
    elif engine == "fake":
        out = Path(tmp) / "vllm_ab_dry_run.json"
    else:
        stamp = datetime.datetime.fromisoformat(result["started"]).strftime("%Y%m%d-%H%M%S")
        out = RESULTS / f"vllm_ab_{stamp}_{re.sub(r'[^A-Za-z0-9]+', '-', gpu).strip('-')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print_summary(result)
    print(f"\nwrote {out}")
    return 0 if result["analysis"]["targets"]["all_runs_completed"] else 1


def run_merge(args):
    """One result from several (an order per GPU command, say): runs concatenated, analysed
    again. The plans must agree."""
    parts = [json.loads(Path(p).read_text()) for p in args.merge]
    plans = {json.dumps(p["plan"], sort_keys=True) for p in parts}
    if len(plans) != 1:
        sys.exit("--merge: the results were made with different plans")
    runs = [r for p in parts for r in p["runs"]]
    result = dict(parts[0], runs=runs, merged_from=[str(p) for p in args.merge],
                  analysis=analyse(runs, parts[0]["plan"]))
    return write_result(result, args.out, tempfile.mkdtemp(prefix="loomnb_vllm_ab_"),
                        parts[0]["engine"])


def run_parent(args):
    if args.merge:
        return run_merge(args)
    plan = make_plan(args)
    configs = [c for c in args.configs.split(",") if c]
    orders = [o for o in args.orders.split(",") if o]
    for c in configs:
        if c not in ALL_CONFIGS:
            sys.exit(f"--configs: unknown configuration {c!r}; known: {', '.join(ALL_CONFIGS)}")
    for o in orders:
        if o not in ORDERS:
            sys.exit(f"--orders: unknown order {o!r}; known: {', '.join(ORDERS)}")
    if args.engine == "vllm" and not Path(args.model).is_dir():
        sys.exit(f"--model: {args.model} is not a folder (a bf16 Hugging Face folder of the model)")
    sys.path.insert(0, str(REPO))
    from loomnb.integrations.vllm import engine_kwargs  # the exact settings the children get
    kwargs = {c: engine_kwargs(c) for c in CONFIGS}
    kwargs.update({c: engine_kwargs("loomnb", ops=ops) for c, ops in ISOLATED.items()})
    for c in CONTROLS:  # the same switches as loomnb_rope; the control plug-in swaps the class
        kwargs[c] = engine_kwargs("loomnb", ops=("RotaryEmbedding",))
    tmp = tempfile.mkdtemp(prefix="loomnb_vllm_ab_")
    plugin_site = write_entry_point(tmp)
    started = datetime.datetime.now()
    runs = []
    for order in orders:
        for position, config in enumerate(c for c in ORDERS[order] if c in configs):
            runs.append(run_one(args, plan, config, kwargs[config], order, position,
                                plugin_site, tmp))
    result = {"benchmark": "vllm_ab", "started": started.isoformat(timespec="seconds"),
              "engine": args.engine, "parent_pid": os.getpid(), "plan": plan,
              "engine_kwargs": kwargs, "labels": LABELS, "runs": runs,
              "analysis": analyse(runs, plan)}
    return write_result(result, args.out, tmp, args.engine)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=os.environ.get("LOOMNB_VLLM_MODEL", "/tmp/smollm2-hf"),
                    help="bf16 Hugging Face folder of the model")
    ap.add_argument("--batches", default="1,8,64", help="batch sizes timed")
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per timed request")
    ap.add_argument("--reps", type=int, default=3, help="timed generations per batch (median)")
    ap.add_argument("--quick", action="store_true",
                    help="1 rep of 128 tokens, launches profiled at batch 1 only")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="configurations to run: " + ", ".join(ALL_CONFIGS) + " (all but the "
                         "first three: token checks only, see the module docstring)")
    ap.add_argument("--orders", default="forward,reversed", help="orders to run them in")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="vLLM's tensor_parallel_size (the plug-in loads in every worker; its "
                         "report is collected from each rank)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--compile-cache", action="store_true",
                    help="keep vLLM's compile cache (init times then depend on the order)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    ap.add_argument("--dry-run", action="store_true",
                    help="the fake engine: the whole plumbing on a CPU, no vLLM")
    ap.add_argument("--out", help="result JSON (default: benchmarks/results/vllm_ab_<stamp>_<gpu>.json)")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="combine earlier results (e.g. one per order) into one, analysed again")
    # internal: one configuration in a child process
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", default=None, choices=("vllm", "fake"), help=argparse.SUPPRESS)
    ap.add_argument("--config", choices=ALL_CONFIGS, help=argparse.SUPPRESS)
    ap.add_argument("--order", help=argparse.SUPPRESS)
    ap.add_argument("--position", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    ap.add_argument("--engine-kwargs", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine is None:
        args.engine = "fake" if args.dry_run else "vllm"
    if args.child:
        return run_child(args)
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
