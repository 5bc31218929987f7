"""Sampler-family benchmark: loomnb's seeded samplers, renormalisations and penalties
(``loomnb.ops.sampler``) against FlashInfer 0.6.12's ops of the same names, vLLM 0.24's sampler
(its torch path and its compiled ``apply_repetition_penalties_``), torch eager and torch.compile,
in one process, both provider orders.

    python3 benchmarks/bench_sampler.py                    # fp32, V = 49,152/128,256/151,936, 1..512 rows
    python3 benchmarks/bench_sampler.py --dtype bf16 --ops top_k_top_p_sampling_from_logits,sampling_from_logits
    python3 benchmarks/bench_sampler.py --quick            # V = 151,936, 1/32/128 rows, 5 repeats
    python3 benchmarks/bench_sampler.py --vllm-lib "$LOOMNB_VLLM_LIB" --ops apply_penalties_
    python3 benchmarks/bench_sampler.py --dry-run          # no GPU: fake timings, real plumbing and files

Ops (``R`` rows of a vocabulary ``V``; logits ``N(0, 3^2)``, probabilities their softmax):

* ``top_k_top_p_sampling_from_logits``: top_k = 50, top_p = 0.9, fp32 or bf16 logits;
* ``min_p_sampling_from_probs``: min_p = 0.1;
* ``sampling_from_logits``: temperature 0.7, fp32 or bf16 logits;
* ``top_k_renorm_probs`` (k = 50) and ``top_p_renorm_probs`` (p = 0.9);
* ``apply_penalties_``: fp32 logits in place, a prompt mask (bool, about 1% set), output counts
  (int32, about 1% nonzero, 1-3), repetition 1.1, frequency 0.2, presence 0.3 (``[R]`` fp32).

The parameters are scalars (``--per-row``: ``[R]`` tensors, for loomnb and FlashInfer; the torch
composites always take tensors, as vLLM holds them). Probabilities and the penalties' logits
are fp32 only: those ops' bf16 rows are n/a.

Providers:

* ``loomnb``: one launch per call, preallocated outputs, an int ``seed`` and ``offset`` (a graph
  replays the same draw; a decode loop would advance a device offset), penalties in place;
* ``flashinfer``: ``flashinfer.sampling``'s op of the same name, ``deterministic=True`` and the
  same int seed and offset where the function takes them (so it never reads torch's generator
  on the host while a graph is captured). Its ``sampling_from_logits`` takes no temperature: it
  is given ``logits / 0.7``, divided inside the timed call (vLLM's sampler divides before it
  samples too). JIT-compiled in setup, outside the timed regions; an op whose build or first
  call fails has error rows with that reason. No penalties op (n/a);
* ``vllm``: vLLM 0.24's compiled ``torch.ops._C.apply_repetition_penalties_`` (``--vllm-lib`` /
  ``$LOOMNB_VLLM_LIB``, loaded without importing vllm, bound by its schema's argument names,
  printed and stored in ``meta.vllm``), then the two in-place subtractions of vLLM's
  ``apply_penalties`` (``model_executor/layers/utils.py``). Its bin counting is not timed: the
  counts and their ``counts > 0`` mask are inputs. vLLM has no compiled op for the others (n/a);
* ``vllm_torch``: vLLM's own sampler functions imported from an installed vllm
  (``vllm.v1.sample.ops.topk_topp_sampler``: ``apply_top_k_top_p_pytorch`` where the module has
  it, else ``apply_top_k_top_p``, then ``softmax(fp32)`` and ``random_sample``; logged), for the
  two logits samplers, on ``logits.float()`` as vLLM's sampler does (fp32 logits are filtered in
  place, as vLLM does: over the replays the kept set shrinks, the sort's cost does not);
  temperature divides out of place. Skipped, logged, when vllm does not import (it pulls in
  vLLM's engine); ``torch`` is the same path restated;
* ``torch``: eager composites (functions below) -- vLLM's torch path restated (sort ascending,
  top-k by the gathered ``k``-th value, top-p by the cumulative softmax of the sorted logits,
  scattered into a new tensor rather than into the logits, then the exponential race
  ``probs.div_(q.exponential_()).argmax(-1)``); min-p: mask ``p < p_max * min_p``,
  renormalise, race; ``softmax(logits / T)``, race; the renormalisations as loomnb defines them
  (top-p in the 2^-32 fixed point of the row's largest with exact integer sums, the kept mass
  summed in float64), so they compare bit for bit; the penalties as vLLM's formulas
  (``where(seen, where(x > 0, x / r, x * r), x)``, ``x - f * counts``, ``x - p * (counts > 0)``);
* ``torch_compile``: the same composites through ``torch.compile`` (default mode, automatic
  dynamic shapes: a recompile when the rows or the vocabulary change, not one per case;
  ``--compile-static``: ``dynamic=False``, one compile per shape), compiled outside the timed
  regions; a failure is a skip;
* ``loomnb_t256``, ``loomnb_t1024`` (threads of a row block) and ``loomnb_pt512`` (threads of
  a penalty block) (``--tune``): loomnb with ``loomnb.ops.sampler``'s launch constants changed.

Bytes model: a sample reads the row once (``R * V * b``) and writes 4 B/row (int32 ids); loomnb's
row kernel reads a row several times (1 + 4 per filter + 1 passes; from L2 after the first when
the rows fit), counted once. A renormalisation reads and writes ``R * V * 4``. The penalties
read and write the logits (8 B), read the mask (1 B) and the counts (4 B) per element, and 12
B/row of penalties (vLLM's path also reads its bool output mask: not counted). ``--per-row``
adds 4 B/row for each parameter tensor.

Exactness: a sampler's tokens cannot be compared with a peer's (each draws its own random
numbers: loomnb Philox counters, FlashInfer a cuRAND state, torch its generator). The output
compared for a sampling op is ``in_support``: whether each row's token lies in the row's kept
set (top-k, then top-p of that set's renormalised mass, in float64, on the same fresh inputs;
min-p ``p >= p_max * min_p``; every token for plain sampling) -- a fraction below 1 is a token
the filters should have dropped. loomnb's tokens against its oracle and their distribution are
the GPU tests' (``tests/test_sampler_gpu.py``). Renormalised probabilities and penalised logits
are compared byte for byte (FlashInfer sums in fp32: within about an ulp). The reference is
``vllm`` where it has the op (the penalties, bit for bit with vLLM's path), else the torch
composite (logged); without vLLM's library the torch composites throughout (logged,
``meta.exact_ref``). Only the family's parts are here; the command line, timing, exactness and
files are ``_harness.run``.
"""

from __future__ import annotations

import inspect
import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
import torch  # noqa: E402

ELEM_BYTES = {"fp32": 4, "bf16": 2}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VOCABS = [49152, 128256, 151936]       # SmolLM2, Llama 3, Qwen2.5
LOGIT_SCALE = 3.0                      # N(0, 3^2) logits: a peaked softmax, as a model's
TOP_K, TOP_P, MIN_P, TEMPERATURE = 50, 0.9, 0.1, 0.7
REPETITION, FREQUENCY, PRESENCE = 1.1, 0.2, 0.3
MASK_FRACTION = 0.01                   # prompt tokens / output tokens of a row
SEED, OFFSET = 1234, 0                 # the int Philox stream of loomnb (and FlashInfer)
MASS_SCALE = 2.0 ** 32                 # loomnb's fixed point of a token's mass (top-p)
DEFAULTS = ["--target-ms", "1", "--repeats", "9"]  # a lean default sweep (the sorts are slow)


def _op(name, source, writes, kind, params=(), vllm_name=None):
    return H.Op(name, (source,), writes, vllm_name=vllm_name,
                extra={"kind": kind, "params": params})


OPS = {op.name: op for op in [
    _op("top_k_top_p_sampling_from_logits", "logits", ("in_support",), "sample",
        ("top_k", "top_p")),
    _op("min_p_sampling_from_probs", "probs", ("in_support",), "sample", ("min_p",)),
    _op("sampling_from_logits", "logits", ("in_support",), "sample", ("temperature",)),
    _op("top_k_renorm_probs", "probs", ("renorm_probs",), "renorm", ("top_k",)),
    _op("top_p_renorm_probs", "probs", ("renorm_probs",), "renorm", ("top_p",)),
    _op("apply_penalties_", "logits", ("logits",), "penalties",
        vllm_name="apply_repetition_penalties_"),
]}


def fp32_only(op) -> bool:
    return op.reads[0] == "probs" or op.extra["kind"] == "penalties"


def op_bytes(op, rows: int, vocab: int, dtype: str = "fp32", per_row: bool = False) -> int:
    """Bytes the op must move (module docstring): a sample ``R*V*b + 4R``, a renormalisation
    ``8RV``, the penalties ``13RV + 12R``; ``--per-row`` adds ``4R`` per parameter tensor."""
    kind = op.extra["kind"]
    if kind == "penalties":
        return rows * vocab * (4 + 4 + 1 + 4) + 12 * rows
    params = 4 * rows * len(op.extra["params"]) if per_row else 0
    if kind == "renorm":
        return 2 * rows * vocab * 4 + params
    b = 4 if fp32_only(op) else ELEM_BYTES[dtype]
    return rows * vocab * b + 4 * rows + params


def make_inputs(op, rows: int, vocab: int, dtype: str, device, seed: int) -> dict:
    """Fresh inputs of one call by role name (the same seed gives every provider the same
    values), the per-row parameter tensors and loomnb's preallocated outputs."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g, device=device) * LOGIT_SCALE

    def full(v):
        return torch.full((rows,), v, dtype=torch.float32, device=device)
    if op.extra["kind"] == "penalties":
        prompt = torch.rand(rows, vocab, generator=g, device=device) < MASK_FRACTION
        hit = torch.rand(rows, vocab, generator=g, device=device) < MASK_FRACTION
        n = torch.randint(1, 4, (rows, vocab), generator=g, device=device, dtype=torch.int32)
        counts = torch.where(hit, n, 0)
        return {"logits": x, "prompt_mask": prompt, "output_token_counts": counts,
                "output_mask": counts > 0, "repetition_penalties": full(REPETITION),
                "frequency_penalties": full(FREQUENCY), "presence_penalties": full(PRESENCE)}
    t = {"probs": x.softmax(-1)} if op.reads[0] == "probs" else {
        "logits": x.to(TORCH_DTYPES[dtype])}
    t.update(top_k=torch.full((rows,), TOP_K, dtype=torch.int32, device=device),
             top_p=full(TOP_P), min_p=full(MIN_P), temperature=full(TEMPERATURE))
    if op.extra["kind"] == "sample":
        t["samples"] = torch.empty(rows, dtype=torch.int32, device=device)
    else:
        t["renorm_probs"] = torch.empty(rows, vocab, dtype=torch.float32, device=device)
    return t


# ---------------------------------------------------------------- torch composites
def _race(probs):
    """vLLM's ``random_sample``: ``argmax(p / q)``, ``q ~ Exp(1)`` (a draw from ``p``)."""
    q = torch.empty_like(probs).exponential_()
    return probs.div_(q).argmax(dim=-1)


def t_top_k_top_p(logits, k, p):
    """vLLM 0.24's torch path (``apply_top_k_top_p``, then softmax and ``random_sample``) on
    fp32 logits (vLLM's sampler converts them first); the filtered logits are scattered into a
    new tensor (vLLM scatters into the logits) and the cumulative sum is not taken in place."""
    x = logits.float()
    logits_sort, logits_idx = x.sort(dim=-1, descending=False)
    top_k_mask = logits_sort.size(1) - k.to(torch.long)
    top_k_mask = logits_sort.gather(1, top_k_mask.unsqueeze(dim=1))
    top_k_mask = logits_sort < top_k_mask
    logits_sort.masked_fill_(top_k_mask, -float("inf"))
    probs_sort = logits_sort.softmax(dim=-1)
    probs_sum = probs_sort.cumsum(dim=-1)
    top_p_mask = probs_sum <= 1 - p.unsqueeze(dim=1)
    top_p_mask[:, -1] = False  # at least one
    logits_sort.masked_fill_(top_p_mask, -float("inf"))
    x = torch.empty_like(x).scatter_(dim=-1, index=logits_idx, src=logits_sort)
    return _race(x.softmax(dim=-1, dtype=torch.float32))


def t_min_p(probs, min_p):
    """Min-p on probabilities: drop ``p < p_max * min_p``, renormalise, exponential race."""
    thr = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(dim=1)
    kept = probs.masked_fill(probs < thr, 0.0)
    return _race(kept / kept.sum(dim=-1, keepdim=True))


def t_sampling_from_logits(logits, temperature):
    """``softmax(logits / T)`` (fp32), exponential race."""
    return _race((logits.float() / temperature.unsqueeze(dim=1)).softmax(dim=-1))


def _renorm(probs, keep):
    """``r32(p / r32(S))`` on the kept tokens (``S`` their float64 sum), 0 elsewhere."""
    s = torch.where(keep, probs, 0.0).sum(dim=-1, keepdim=True, dtype=torch.float64).float()
    return torch.where(keep, probs / s, 0.0)


def t_top_k_renorm(probs, k: int):
    """Keep ``p >=`` the row's ``k``-th largest (ties kept), renormalise."""
    if 0 < k < probs.shape[1]:
        keep = probs >= probs.topk(k, dim=-1).values[:, -1:]
    else:
        keep = ~probs.isnan()
    return _renorm(probs, keep)


def t_top_p_renorm(probs, p: float):
    """loomnb's top-p in torch: masses ``W = floor(r32(p_i * r32(1 / p_max)) * 2^32)`` (int64),
    the first value going down whose inclusive mass reaches ``r32(top_p) * sum(W)`` is the
    threshold (ties kept), renormalise."""
    if p >= 1:
        return _renorm(probs, ~probs.isnan())
    pmax = probs.amax(dim=-1, keepdim=True)
    w = probs * torch.where(pmax > 0, 1.0 / pmax, 0.0)
    mass = (w * MASS_SCALE).double().floor().long()
    vals, idx = probs.sort(dim=-1, descending=True)
    cum = mass.gather(1, idx).cumsum(dim=-1)
    target = float(np.float32(p)) * mass.sum(dim=-1, keepdim=True).double()
    first = (cum.double() >= target).to(torch.int8).argmax(dim=-1, keepdim=True)
    return _renorm(probs, probs >= vals.gather(1, first))


def t_penalties(logits, prompt_mask, counts, rep, freq, pres):
    """vLLM's three penalties in its order, fp32: repetition on the tokens seen in the prompt
    or the output, then ``x - f * count`` and ``x - p * (count > 0)`` (a new tensor)."""
    seen = prompt_mask | (counts > 0)
    r = rep.unsqueeze(dim=1)
    x = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    x = x - freq.unsqueeze(dim=1) * counts
    return x - pres.unsqueeze(dim=1) * (counts > 0)


COMPOSITES = {"top_k_top_p_sampling_from_logits": t_top_k_top_p,
              "min_p_sampling_from_probs": t_min_p,
              "sampling_from_logits": t_sampling_from_logits,
              "top_k_renorm_probs": t_top_k_renorm, "top_p_renorm_probs": t_top_p_renorm,
              "apply_penalties_": t_penalties}


def torch_call(op, t, fn):
    """The call of composite ``fn`` (eager or compiled) of ``op`` on ``t``."""
    name = op.name
    if name == "top_k_top_p_sampling_from_logits":
        return partial(fn, t["logits"], t["top_k"], t["top_p"])
    if name == "min_p_sampling_from_probs":
        return partial(fn, t["probs"], t["min_p"])
    if name == "sampling_from_logits":
        return partial(fn, t["logits"], t["temperature"])
    if name == "top_k_renorm_probs":
        return partial(fn, t["probs"], TOP_K)
    if name == "top_p_renorm_probs":
        return partial(fn, t["probs"], TOP_P)
    if name == "apply_penalties_":
        return partial(fn, t["logits"], t["prompt_mask"], t["output_token_counts"],
                       t["repetition_penalties"], t["frequency_penalties"],
                       t["presence_penalties"])
    raise KeyError(name)


# ---------------------------------------------------------------- outputs compared
def support(op, t):
    """``[R, V]`` bool: the tokens a sampling op may draw (module docstring), in float64."""
    if op.name == "min_p_sampling_from_probs":
        p = t["probs"]
        return p >= p.amax(dim=-1, keepdim=True) * MIN_P
    x = t["logits"].double()
    if op.name == "sampling_from_logits":
        return ~x.isnan()
    if 0 < TOP_K < x.shape[1]:
        x = x.masked_fill(x < x.topk(TOP_K, dim=-1).values[:, -1:], -float("inf"))
    ps, idx = x.softmax(dim=-1).sort(dim=-1, descending=True)
    keep = (ps.cumsum(dim=-1) - ps) < TOP_P  # the mass above it is below top_p
    return torch.zeros_like(keep).scatter_(1, idx, keep) & (x > -float("inf"))


def in_support(op, t, ids):
    """``[R]`` bool: each row's token is a token id of the row's support."""
    keep = support(op, t)
    ids = ids.reshape(-1).long()
    V = keep.shape[1]
    return keep.gather(1, ids.clamp(0, V - 1)[:, None])[:, 0] & (ids >= 0) & (ids < V)


def collect(op, t, src=None):
    """``result -> {role: tensor}``: ``in_support`` of a sample (its support from ``src``, the
    inputs as they were before the call, default ``t``), the renormalised probabilities, the
    penalised logits (the result, or the logits mutated in place)."""
    kind = op.extra["kind"]
    if kind == "sample":
        return lambda r: {"in_support": in_support(op, src or t, t["samples"] if r is None else r)}
    if kind == "renorm":
        return lambda r: {"renorm_probs": t["renorm_probs"] if r is None else r}
    return lambda r: {"logits": t["logits"] if r is None else r}


# ---------------------------------------------------------------- providers
class _Base(H.Provider):
    def unsupported(self, case):
        if fp32_only(OPS[case["op"]]) and case["dtype"] != "fp32":
            return "probabilities and the penalties' logits are fp32 (vLLM's sampler runs on fp32)"


def _param(t, case, name, scalar):
    """A per-row parameter: the scalar, or its ``[R]`` tensor with ``--per-row``."""
    return t[name] if case.get("params") == "per_row" else scalar


class Loomnb(_Base, H.LoomnbProvider):
    """loomnb's ops: preallocated outputs, an int seed and offset, penalties in place."""
    name = "loomnb"

    def bind(self, op, t, case):
        m, name = self.m, op.name
        seeded = {"seed": SEED, "offset": OFFSET}
        if name == "top_k_top_p_sampling_from_logits":
            call = partial(m.top_k_top_p_sampling_from_logits, t["logits"],
                           _param(t, case, "top_k", TOP_K), _param(t, case, "top_p", TOP_P),
                           **seeded, out=t["samples"])
        elif name == "min_p_sampling_from_probs":
            call = partial(m.min_p_sampling_from_probs, t["probs"],
                           _param(t, case, "min_p", MIN_P), **seeded, out=t["samples"])
        elif name == "sampling_from_logits":
            call = partial(m.sampling_from_logits, t["logits"],
                           temperature=_param(t, case, "temperature", TEMPERATURE), **seeded,
                           out=t["samples"])
        elif name == "top_k_renorm_probs":
            call = partial(m.top_k_renorm_probs, t["probs"], _param(t, case, "top_k", TOP_K),
                           out=t["renorm_probs"])
        elif name == "top_p_renorm_probs":
            call = partial(m.top_p_renorm_probs, t["probs"], _param(t, case, "top_p", TOP_P),
                           out=t["renorm_probs"])
        else:
            call = partial(m.apply_penalties_, t["logits"], t["prompt_mask"],
                           t["output_token_counts"], t["repetition_penalties"],
                           t["frequency_penalties"], t["presence_penalties"])
        return call, collect(op, t)


class FlashInfer(_Base):
    """FlashInfer 0.6.12's ``flashinfer.sampling`` ops of the same names (``deterministic=True``,
    the int seed and offset where the function takes them; ``sampling_from_logits`` on
    ``logits / T`` divided in the call), JIT-compiled in setup."""
    name = "flashinfer"
    NAMES = tuple(n for n in OPS if n != "apply_penalties_")

    def setup(self, args, log):
        try:
            import flashinfer.sampling as fs
        except Exception as e:  # noqa: BLE001
            return f"import flashinfer failed: {e!r}"[:300]
        self.fs, self.broken, self.seeded = fs, {}, {}
        for name in self.NAMES:
            fn = getattr(fs, name, None)
            if fn is None:
                self.broken[name] = f"flashinfer.sampling has no {name}"
                continue
            if OPS[name].extra["kind"] != "sample":
                continue
            try:
                params = inspect.signature(fn).parameters
            except (TypeError, ValueError):
                params = {}
            self.seeded[name] = ("seed" in params and "offset" in params) or any(
                p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        log(f"[flashinfer] seed and offset passed to: "
            f"{', '.join(n for n, s in self.seeded.items() if s) or 'none'}")
        for name in args.ops:  # build each module now: a failure is its rows' reason
            if name not in self.NAMES or name in self.broken:
                continue
            op = OPS[name]
            try:
                t = make_inputs(op, 2, 4096, "fp32", args.device, 0)
                self.bind(op, t, {"op": name, "dtype": "fp32"})[0]()
                if torch.device(args.device).type == "cuda":
                    torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                self.broken[name] = f"flashinfer {name}: build or first call failed: {e!r}"[:500]
                log(f"[flashinfer] {self.broken[name]}")

    def unsupported(self, case):
        if case["op"] == "apply_penalties_":
            return "FlashInfer 0.6.12 has no penalties op"
        return super().unsupported(case)

    def bind(self, op, t, case):
        name = op.name
        if name in getattr(self, "broken", {}):
            raise RuntimeError(self.broken[name])
        fn = getattr(self.fs, name)
        seeded = {"seed": SEED, "offset": OFFSET} if self.seeded.get(name) else {}
        if name == "top_k_top_p_sampling_from_logits":
            call = partial(fn, t["logits"], _param(t, case, "top_k", TOP_K),
                           _param(t, case, "top_p", TOP_P), deterministic=True, **seeded)
        elif name == "min_p_sampling_from_probs":
            call = partial(fn, t["probs"], _param(t, case, "min_p", MIN_P), deterministic=True,
                           **seeded)
        elif name == "sampling_from_logits":
            x = t["logits"]
            temp = t["temperature"].unsqueeze(1) if case.get("params") == "per_row" else TEMPERATURE

            def call():
                return fn(x / temp, deterministic=True, **seeded)
        elif name == "top_k_renorm_probs":
            call = partial(fn, t["probs"], _param(t, case, "top_k", TOP_K))
        else:
            call = partial(fn, t["probs"], _param(t, case, "top_p", TOP_P))
        return call, collect(op, t)


class Torch(_Base):
    """Eager torch composites (functions above): vLLM's torch sampling path, min-p, the
    temperature softmax, the renormalisations as loomnb defines them, vLLM's penalty formulas.
    They return new tensors."""
    name = "torch"

    def fn(self, op):
        return COMPOSITES[op.name]

    def bind(self, op, t, case):
        return torch_call(op, t, self.fn(op)), collect(op, t)


class TorchCompile(Torch):
    """torch.compile of the composites: default mode, automatic dynamic shapes (a recompile
    when the rows or the vocabulary change; ``--compile-static``: ``dynamic=False``, one per
    shape); compiled by the first call, outside the timed regions; a failure is a skip."""
    name = "torch_compile"
    error_status = "skip"

    def setup(self, args, log):
        for knob in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 256)
        self.dynamic = False if getattr(args, "compile_static", False) else None
        self.compiled = {}
        return super().setup(args, log)

    def fn(self, op):
        if op.name not in self.compiled:
            self.compiled[op.name] = torch.compile(COMPOSITES[op.name], dynamic=self.dynamic)
        return self.compiled[op.name]


class Vllm(_Base):
    """vLLM 0.24's compiled ``apply_repetition_penalties_`` (``torch.ops._C``, from ``--vllm-lib``
    / ``$LOOMNB_VLLM_LIB``), bound by its schema's argument names, then vLLM's in-place
    subtractions ``logits -= f * counts`` and ``logits -= p * output_mask`` (its
    ``apply_penalties`` less the bin counting). For the other ops its rows are n/a and, as
    the exactness reference, the torch composite stands in (logged)."""
    name = "vllm"
    namespaces = ("_C",)
    OP = "apply_repetition_penalties_"
    REQUIRED = ("logits", "prompt_mask", "output_mask", "repetition_penalties")

    def setup(self, args, log):
        path, err = H.load_vllm_library(args)
        if err:
            return err
        self.schemas, self.bindings, self.log, self.fallbacks_logged = {}, {}, log, set()
        for ns in self.namespaces:
            try:
                packet = getattr(getattr(torch.ops, ns), self.OP)
                schema = packet.default._schema
            except (AttributeError, RuntimeError):
                continue
            self.packet = packet
            self.schemas["apply_penalties_"] = str(schema)
            log(f"[vllm] schema {schema}")
            break
        else:
            where = ", ".join(f"torch.ops.{ns}" for ns in self.namespaces)
            return ("no --vllm-lib given and LOOMNB_VLLM_LIB is unset" if not path
                    else f"{path} registers no {self.OP} (looked in {where})")
        self.lib = (str(Path(path).resolve()) if path
                    else f"torch.ops.{ns} already registered in this process")

    def unsupported(self, case):
        if case["op"] != "apply_penalties_":
            return (f"vLLM 0.24 has no compiled op for {case['op']} (its sampler is torch, "
                    "Triton or FlashInfer)")
        return super().unsupported(case)

    def bind(self, op, t, case):
        if op.name != "apply_penalties_":  # only the exactness reference gets here
            if op.name not in self.fallbacks_logged:
                self.fallbacks_logged.add(op.name)
                self.log(f"[exact] {op.name}: vLLM has no compiled op; the torch composite is "
                         "its reference")
            return torch_call(op, t, COMPOSITES[op.name]), collect(op, t)
        args, kwargs, desc = H.bind_schema(self.packet.default._schema, t, self.REQUIRED, {})
        if op.name not in self.bindings:
            self.log(f"[vllm] {self.OP}({desc})")
            self.bindings[op.name] = desc
        repetition = partial(self.packet, *args, **kwargs)
        x, counts, mask = t["logits"], t["output_token_counts"], t["output_mask"]
        freq, pres = t["frequency_penalties"], t["presence_penalties"]

        def call():
            repetition()
            x.sub_(freq.unsqueeze(dim=1) * counts)
            x.sub_(pres.unsqueeze(dim=1) * mask)
        return call, collect(op, t)


class VllmTorch(_Base):
    """vLLM's own sampler functions (``vllm.v1.sample.ops.topk_topp_sampler``:
    ``apply_top_k_top_p_pytorch`` or ``apply_top_k_top_p``, then ``softmax(fp32)`` and
    ``random_sample``) imported from an installed vllm, on ``logits.float()``; skipped when
    vllm does not import here."""
    name = "vllm_torch"
    NAMES = ("top_k_top_p_sampling_from_logits", "sampling_from_logits")

    def setup(self, args, log):
        try:
            from vllm.v1.sample.ops import topk_topp_sampler as m
            self.filt = getattr(m, "apply_top_k_top_p_pytorch", None) or m.apply_top_k_top_p
            self.sample = m.random_sample
        except Exception as e:  # noqa: BLE001
            return f"vLLM's sampler does not import here: {e!r}"[:300]
        log(f"[vllm_torch] {m.__name__}.{self.filt.__name__}, softmax(fp32), random_sample")

    def unsupported(self, case):
        if case["op"] not in self.NAMES:
            return ("vLLM's torch path is the logits samplers' (its min-p is a logits "
                    "processor; renormalisation and penalties are other ops)")
        return super().unsupported(case)

    def bind(self, op, t, case):
        x, filt, sample = t["logits"], self.filt, self.sample
        if op.name == "top_k_top_p_sampling_from_logits":
            k, p = t["top_k"], t["top_p"]

            def call():
                return sample(filt(x.float(), k, p).softmax(dim=-1, dtype=torch.float32), {})
        else:
            temp = t["temperature"].unsqueeze(dim=1)

            def call():
                return sample((x.float() / temp).softmax(dim=-1, dtype=torch.float32), {})
        # fp32 logits are filtered in place: the support comes from a copy made now
        return call, collect(op, t, src={**t, "logits": x.clone()})


_S = "loomnb.ops.sampler"
TUNED = [H.tuned(Loomnb, _S, "t256", THREADS=256), H.tuned(Loomnb, _S, "t1024", THREADS=1024),
         H.tuned(Loomnb, _S, "pt512", PENALTY_THREADS=512)]
PROVIDERS = {p.name: p for p in (Loomnb, FlashInfer, Vllm, VllmTorch, Torch, TorchCompile,
                                 *TUNED)}


class SamplerFamily(H.Family):
    name = "sampler"
    ops = OPS
    providers = PROVIDERS
    x_axis, x_default, x_quick = "num_rows", [1, 8, 32, 128, 512], [1, 32, 128]
    shape_axes = [("--vocab-sizes", "vocab_size", VOCABS,
                   "default 49152,128256,151936 (SmolLM2, Llama 3, Qwen2.5; --quick: 151936)")]
    dtypes = ("fp32", "bf16")
    bytes_model = ("sample: the row once (R * V * elem) + 4 B/row of int32 ids (loomnb reads a "
                   "row several times, from L2); renorm: R * V * 4 read + written; penalties: "
                   "logits read + written, mask 1 B and counts 4 B per element, 12 B/row of "
                   "penalties; --per-row: + 4 B/row per parameter tensor")
    fake = {"loomnb": (5.0, 3000.0), "flashinfer": (20.0, 1500.0), "vllm": (6.0, 2500.0),
            "vllm_torch": (120.0, 150.0), "torch": (100.0, 200.0),
            "torch_compile": (60.0, 400.0),
            **{p.name: (5.0, 2900.0) for p in TUNED}}  # (floor µs, GB/s) for --dry-run

    def add_arguments(self, p):
        p.add_argument("--per-row", action="store_true",
                       help="top_k, top_p, min_p and temperature as [num_rows] tensors for "
                            "loomnb and FlashInfer (default: scalars; the torch composites "
                            "always take tensors)")
        p.add_argument("--compile-static", action="store_true",
                       help="torch_compile with dynamic=False: one compile per shape "
                            "(default: automatic dynamic shapes)")

    def scalars_of_args(self, args):
        return {"params": "per_row" if args.per_row else "scalar"}

    def shape_label(self, case):
        per_row = ", per-row parameters" if case.get("params") == "per_row" else ""
        return f"vocab {case['vocab_size']}{per_row}"

    def op_bytes(self, op, case):
        return op_bytes(op, case["num_rows"], case["vocab_size"], case["dtype"],
                        case.get("params") == "per_row")

    def make_inputs(self, op, case, device, seed):
        dtype = "fp32" if fp32_only(op) else case["dtype"]
        return make_inputs(op, case["num_rows"], case["vocab_size"], dtype, device, seed)


FAMILY = SamplerFamily()


def _argv(argv):
    """The family's defaults on top of the harness's: ``--quick`` also means V = 151,936 only;
    otherwise timing takes 9 repeats of 1 ms replays unless ``--repeats`` / ``--target-ms`` say
    otherwise (the torch sorts of 512 rows take milliseconds a call)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    quick = "--quick" in argv
    if quick and "--vocab-sizes" not in argv:
        argv += ["--vocab-sizes", "151936"]
    for flag, value in zip(DEFAULTS[::2], DEFAULTS[1::2]):
        if flag not in argv and not quick:
            argv += [flag, value]
    return argv


def parse_args(argv=None):
    return H.parse_args(FAMILY, _argv(argv))


def main(argv=None) -> Path:
    return H.run(FAMILY, _argv(argv))


if __name__ == "__main__":
    main()
