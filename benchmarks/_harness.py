"""Generic GPU benchmark harness: timing, copy bandwidth, run metadata, result files.

Operator-agnostic on purpose: each operator family (norms, activations, rope, ...) has its own
``bench_<family>.py`` that builds callables and a bytes model, and uses only what is here.

Timing rules (see README.md):

* ``time_graph`` captures ``n`` back-to-back calls in one ``torch.cuda.CUDAGraph`` and times whole
  replays with CUDA events; per-call time = replay time / n, median over repeats. This is the
  number that matters inside vLLM-style graph-captured decoding.
* ``time_eager`` times a Python loop of ``n`` calls with a host clock, synchronising before and
  after the loop (what a Python user sees), and in the same loop the host-only issue time (clock
  read before the closing synchronise).
* Never a wall clock around one launch.

Every timing function also accepts a list of callables: call ``i`` then runs ``fns[i % len(fns)]``,
which is how the L2-cold mode rotates through distinct buffers (``l2_cold_sets`` says how many).
With ``device="cpu"`` the timers fall back to a wall clock (smoke tests of the code path only).
"""

from __future__ import annotations

import csv
import datetime as _dt
import functools
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

__all__ = [
    "RunLog", "time_graph", "time_eager", "time_case", "copy_bandwidth", "l2_cold_sets",
    "l2_bytes", "Provider", "NotAvailable", "provider_passes", "bind_schema", "compare_bits",
    "exactness", "sweep", "env_metadata", "git_commit", "write_results", "flatten", "csv_list",
]

DEFAULT_L2_BYTES = 60 * 1024 * 1024  # H200 L2 is 60 MB (used when the device does not report one)
UNITS = {"graph_us": "µs per call, CUDA-graph replay of back-to-back calls, median of repeats",
         "eager_us": "µs per call of a Python loop, synchronised before and after the loop",
         "host_us": "µs per call to issue the calls (clock read before the closing sync)",
         "GBps": "1e9 B/s = bytes model / graph_us", "pct_copy": "100 * GBps / copy_GBps",
         "exact": "per output: fraction of bytes equal to the reference's (same fresh inputs)"}


class RunLog:
    """Prints a line (through tqdm.write when a bar is active) and keeps it for the JSON."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, msg: str) -> None:
        self.lines.append(msg)
        try:
            from tqdm import tqdm
            tqdm.write(msg)
        except ImportError:  # pragma: no cover
            print(msg, flush=True)


def _as_list(fn) -> list[Callable]:
    return list(fn) if isinstance(fn, (list, tuple)) else [fn]


def _is_cpu(device) -> bool:
    return torch.device(device).type == "cpu"


def _round_up(n: int, k: int) -> int:
    return max(k, math.ceil(n / k) * k)


def _summary(samples_us: Sequence[float]) -> dict:
    return {"us": statistics.median(samples_us), "us_min": min(samples_us),
            "us_max": max(samples_us), "samples": len(samples_us)}


def _capture(fns: list[Callable], n: int) -> "torch.cuda.CUDAGraph":
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # captures on torch's own side stream
        for i in range(n):
            fns[i % len(fns)]()
    return g


def _replay_us(g: "torch.cuda.CUDAGraph", repeats: int) -> list[float]:
    """Times `repeats` back-to-back replays (GPU never idles between them); µs per replay."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(repeats)]
    for start, end in events:
        start.record()
        g.replay()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in events]


def time_graph(fn, n: int | None = None, *, target_ms: float = 2.0, repeats: int = 15,
               n_min: int = 8, n_max: int = 4096, warmup: int = 3, device="cuda") -> dict:
    """Per-call GPU time of ``fn`` from CUDA-graph replays.

    ``n=None`` picks n adaptively: a first graph of 16 calls gives an estimate, then n is chosen
    so that one replay takes about ``target_ms`` (clamped to [n_min, n_max]). With a list of
    callables n is rounded up to a multiple of its length, so every buffer set is used equally.
    Returns {"us" (median), "us_min", "us_max", "samples", "n", "method"}.
    """
    fns = _as_list(fn)
    if _is_cpu(device):
        return _time_wallclock(fns, n or n_min, repeats, warmup)
    # Warm up (and let lazy compilers/allocators settle) on a side stream, as torch recommends.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(max(warmup, 1)):
            fns[i % len(fns)]()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if n is None:
        g = _capture(fns, 16)
        g.replay()
        est_us = statistics.median(_replay_us(g, 3)) / 16
        del g
        n = int(min(max(target_ms * 1e3 / max(est_us, 1e-3), n_min), n_max))
    n = _round_up(n, len(fns))
    g = _capture(fns, n)
    g.replay()  # first replay uploads the graph; not timed
    torch.cuda.synchronize()
    samples = [us / n for us in _replay_us(g, repeats)]
    del g
    return {**_summary(samples), "n": n, "method": "cuda-graph"}


def time_eager(fn, n: int, *, repeats: int = 15, warmup: int = 3, device="cuda") -> dict:
    """Per-call time of a Python loop of n calls: {"us": host+GPU (synchronised on both ends),
    "host_us": time to issue the calls (clock read before the closing synchronise), ...}.

    host_us is the host-side cost only while the GPU is not the bottleneck (tiny shapes).
    """
    fns = _as_list(fn)
    n = _round_up(max(n, 1), len(fns))
    seq = [fns[i % len(fns)] for i in range(n)]
    sync = (lambda: None) if _is_cpu(device) else torch.cuda.synchronize
    for f in seq[:max(warmup, 1)]:
        f()
    sync()
    total, host = [], []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter_ns()
        for f in seq:
            f()
        t1 = time.perf_counter_ns()
        sync()
        t2 = time.perf_counter_ns()
        host.append((t1 - t0) / n / 1e3)
        total.append((t2 - t0) / n / 1e3)
    return {**_summary(total), "host_us": statistics.median(host), "n": n,
            "method": "host-clock"}


def _time_wallclock(fns: list[Callable], n: int, repeats: int, warmup: int) -> dict:
    """CPU stand-in for time_graph (smoke tests only: the numbers mean nothing)."""
    n = _round_up(n, len(fns))
    for i in range(warmup):
        fns[i % len(fns)]()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for i in range(n):
            fns[i % len(fns)]()
        samples.append((time.perf_counter_ns() - t0) / n / 1e3)
    return {**_summary(samples), "n": n, "method": "cpu-wallclock"}


def copy_bandwidth(nbytes: int = 1 << 30, *, repeats: int = 15, device="cuda") -> dict:
    """Achievable HBM bandwidth with an SM kernel: ``torch.mul(a, 2.0, out=b)`` on ``nbytes`` of
    bf16, graph-replayed; bytes moved = read + write = 2 * nbytes.

    (``b.copy_(a)`` inside a graph becomes a copy-engine memcpy node, which is much slower than
    SM kernels on Hopper, so it would understate the roofline.)
    """
    if _is_cpu(device):
        nbytes = min(nbytes, 64 << 20)
    a = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    t = time_graph(functools.partial(torch.mul, a, 2.0, out=b), 10, repeats=repeats,
                   device=device)
    del a, b
    if not _is_cpu(device):
        torch.cuda.empty_cache()
    return {"GBps": 2 * nbytes / (t["us"] * 1e-6) / 1e9, "bytes_per_call": 2 * nbytes,
            "us": t["us"], "us_min": t["us_min"], "method": t["method"],
            "kernel": "torch.mul(a, 2.0, out=b) bf16"}


def l2_bytes(device="cuda") -> int:
    if _is_cpu(device):
        return DEFAULT_L2_BYTES
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
               or DEFAULT_L2_BYTES)


def l2_cold_sets(bytes_per_call: int, l2: int = DEFAULT_L2_BYTES, factor: float = 2.0,
                 max_sets: int = 8192) -> int:
    """Number of distinct buffer sets whose round-robin working set exceeds factor * L2."""
    return int(min(max(1, math.ceil(factor * l2 / max(bytes_per_call, 1))), max_sets))


def time_case(make_call: Callable[[int], Callable], nbytes: int, *, l2_cold: bool = False,
              l2: int = DEFAULT_L2_BYTES, target_ms: float = 2.0, repeats: int = 15,
              device="cuda") -> dict:
    """Graph and eager timing of one case. ``make_call(i)`` builds the bare callable on buffer
    set ``i`` (fresh inputs); L2-cold mode makes enough sets to exceed 2x L2 and rotates them.
    ``nbytes`` is the bytes model of one call; the result carries the effective bandwidth."""
    k = l2_cold_sets(nbytes, l2) if l2_cold else 1
    calls = [make_call(i) for i in range(k)]
    g = time_graph(calls, target_ms=target_ms, repeats=repeats, device=device)
    e = time_eager(calls, g["n"], repeats=repeats, device=device)
    return {"l2_sets": k, "graph_us": g["us"], "graph_us_min": g["us_min"], "graph_n": g["n"],
            "eager_us": e["us"], "host_us": e["host_us"], "eager_n": e["n"],
            "timer": g["method"], "GBps": nbytes / (g["us"] * 1e-6) / 1e9}


# ---------------------------------------------------------------- providers, binding, exactness
class NotAvailable(Exception):
    """The provider has no such op: the row is 'n/a', not an error."""


class Provider:
    """A family's implementations subclass this. ``skip`` (set by setup) skips every case of the
    provider with that reason; ``unsupported(case)`` marks single cases n/a; ``error_status`` is
    the status of a case whose call raised ("error"; "skip" for e.g. compiler failures)."""
    family = None  # the benchmark Family (set by make_provider)
    name = ""
    skip: str | None = None
    error_status = "error"

    def setup(self, args, log) -> str | None:  # -> reason to skip the whole provider
        return None

    def unsupported(self, case: dict) -> str | None:
        return None

    def fresh(self) -> None:
        """Called before each case binds: drop state an earlier provider's calls could leave."""


def provider_passes(names: Sequence[str], order: str) -> list[tuple[str, list[str]]]:
    """"forward", "reverse" or "both": the provider orders the sweep runs, in sequence."""
    fwd, rev = ("forward", list(names)), ("reverse", list(reversed(names)))
    return {"forward": [fwd], "reverse": [rev], "both": [fwd, rev]}[order]


def bind_schema(schema, values: dict, required: Sequence[str], aliases: dict):
    """(args, kwargs, description) for a torch op, built from the schema's argument NAMES
    (``aliases``: schema name -> candidate keys of ``values``, first present wins), so a
    differing argument order cannot silently swap tensors. Unmatched optional arguments get
    their default or None; a required key that no argument consumes raises."""
    args, kwargs, used, desc = [], {}, set(), []
    for a in schema.arguments:
        key = next((k for k in aliases.get(a.name, (a.name,)) if k in values), None)
        if key is not None:
            val = values[key]
            used.add(key)
        elif a.has_default_value():
            val, key = a.default_value, "default"
        elif isinstance(a.type, torch.OptionalType):
            val, key = None, "None"
        else:
            raise TypeError(f"cannot bind argument {a.name!r} of {schema}")
        if a.kwarg_only:
            kwargs[a.name] = val
        else:
            args.append(val)
        desc.append(f"{a.name}<-{key}")
    missing = set(required) - used
    if missing:
        raise TypeError(f"schema {schema} takes no argument for {sorted(missing)}")
    return args, kwargs, ", ".join(desc)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def compare_bits(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """Fractions of equal bytes and of bit-identical elements, and the max |difference|."""
    if got.dtype != ref.dtype or got.numel() != ref.numel():
        return {"bytes": 0.0, "elems": 0.0, "max_abs_diff": None,
                "note": f"got {got.dtype}{list(got.shape)}, ref {ref.dtype}{list(ref.shape)}"}
    a, b = got.detach().contiguous().reshape(-1), ref.detach().contiguous().reshape(-1)
    if a.numel() == 0:
        return {"bytes": 1.0, "elems": 1.0, "max_abs_diff": 0.0}
    as_int = _INT_OF_SIZE[a.element_size()]
    nbytes = a.numel() * a.element_size()
    return {"bytes": (a.view(torch.uint8) == b.view(torch.uint8)).sum().item() / nbytes,
            "elems": (a.view(as_int) == b.view(as_int)).sum().item() / a.numel(),
            "max_abs_diff": (a.float() - b.float()).abs().max().item()}


def exactness(got: dict, ref: dict) -> dict:
    """Row fields comparing each output tensor (by role name) with the reference's."""
    cmp = {k: compare_bits(got[k], ref[k]) for k in ref}
    return {"exact": {k: c["bytes"] for k, c in cmp.items()},
            "exact_elems": {k: c["elems"] for k, c in cmp.items()},
            "max_abs_diff": {k: c["max_abs_diff"] for k, c in cmp.items()},
            "exact_min": min(c["bytes"] for c in cmp.values())}


def sweep(cases: list[dict], passes, provs: dict, *, measure, outputs=None, ref=None,
          log=print, checkpoint=lambda: None, rows: list | None = None) -> list[dict]:
    """Runs each pass (provider order) over every case and provider; one row each.

    ``measure(prov, case, pass_index)`` -> timing fields; ``outputs(prov, case)`` -> {role:
    tensor} from one call on fresh inputs (same seed for every provider). When ``ref`` is given,
    each provider's outputs are compared with ref's once (first pass) and the fields reused.
    A failing case becomes a row with a status and reason; the sweep goes on. ``checkpoint()``
    runs after each case (all providers), so a killed run keeps what it finished.
    """
    from tqdm import tqdm
    rows = [] if rows is None else rows
    exact_cache: dict = {}
    bar = tqdm(total=len(passes) * len(cases) * len(provs), unit="case", dynamic_ncols=True,
               mininterval=0.5 if os.isatty(2) else 10.0)
    for pass_i, (pass_name, order) in enumerate(passes):
        for case in cases:
            ref_out = None
            for pos, name in enumerate(order):
                prov = provs[name]
                bar.set_description(f"{pass_name} {name} " + " ".join(
                    str(v) for k, v in case.items() if k in ("op", "num_tokens")), refresh=False)
                row = {**case, "provider": name, "pass": pass_name, "position": pos,
                       "status": "ok", "reason": ""}
                key = (json.dumps(case, sort_keys=True, default=str), name)
                try:
                    if prov.unsupported(case):
                        raise NotAvailable(prov.unsupported(case))
                    if prov.skip:
                        row.update(status="skip", reason=prov.skip)
                    else:
                        if ref is not None and key not in exact_cache:
                            if ref_out is None:
                                try:
                                    ref_out = outputs(ref, case)
                                except Exception as e:  # noqa: BLE001
                                    ref_out = f"reference {ref.name} failed: {e!r}"[:500]
                            exact_cache[key] = (exactness(outputs(prov, case), ref_out)
                                                if isinstance(ref_out, dict)
                                                else {"exact_note": ref_out})
                        row.update(measure(prov, case, pass_i), **exact_cache.get(key, {}))
                except NotAvailable as e:
                    row.update(status="n/a", reason=str(e))
                except Exception as e:  # noqa: BLE001 - one failing case must not end the run
                    row.update(status=prov.error_status, reason=f"{type(e).__name__}: {e}"[:2000])
                    log(f"[{row['status']}] {name} {case}: {row['reason'][:300]}")
                rows.append(row)
                bar.update()
            del ref_out
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            checkpoint()
    bar.close()
    return rows


def csv_list(kind=str, choices=None):
    """argparse type: "a,b,c" -> [kind(a), ...], distinct, each in choices (if given)."""
    import argparse

    def parse(text):
        items = [kind(v.strip()) for v in text.split(",") if v.strip()]
        bad = [v for v in items if choices is not None and v not in choices]
        if bad or not items or len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(
                f"{text!r}: want distinct items" + (f" from {list(choices)}" if choices else ""))
        return items
    return parse


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit(path: str | os.PathLike = ".") -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True,
                             text=True, timeout=10)
        commit = out.stdout.strip() if out.returncode == 0 else None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=path, capture_output=True, text=True, timeout=10)
        if commit and dirty.stdout.strip():
            commit += "-dirty"
        return commit
    except (OSError, subprocess.SubprocessError):
        return None


def env_metadata(device="cuda", packages: Sequence[str] = ()) -> dict:
    """GPU, library versions, date, git commit: what a result file must say about its run."""
    pkgs = ["torch", "numba", "numba-cuda", "numpy", "triton", *packages]
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in dict.fromkeys(pkgs)},
        "torch_cuda": torch.version.cuda,
        "git_commit": git_commit(Path(__file__).resolve().parent),
        "device": str(device),
    }
    if not _is_cpu(device) and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(device)
        meta.update(gpu=p.name, gpu_sm_count=p.multi_processor_count,
                    gpu_memory_bytes=p.total_memory, gpu_l2_bytes=l2_bytes(device),
                    gpu_capability=f"{p.major}.{p.minor}")
    else:
        meta["gpu"] = None
    return meta


def flatten(row: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists become JSON strings (for CSV)."""
    out = {}
    for k, v in row.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif isinstance(v, (list, tuple)):
            out[key] = json.dumps(v)
        else:
            out[key] = v
    return out


def write_results(out_dir, stem: str, meta: dict, rows: list[dict]) -> tuple[Path, Path]:
    """Writes ``<stem>.json`` ({"meta", "results"}) and ``<stem>.csv`` (flattened rows)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out_dir / f"{stem}.json", out_dir / f"{stem}.csv"
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "results": rows}, indent=1, default=str) + "\n")
    tmp.replace(json_path)
    flat = [flatten(r) for r in rows]
    fields = list(dict.fromkeys(k for r in flat for k in r))
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(flat)
    return json_path, csv_path


def timestamp() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


# ---------------------------------------------------------------- families: one main for all
# A benchmark family (bench_<family>.py) describes its ops, bytes model, inputs and providers
# in a Family subclass; the command line, the provider setup, the vLLM binding, the exactness
# reference, the sweep, the copy bandwidth and the result files are run() below.
from dataclasses import dataclass, field  # noqa: E402


@dataclass(frozen=True)
class Op:
    """One benchmarked op: the tensors it must read and write (the bytes model; the written
    ones are also the outputs compared with the reference) and its name in vLLM (None: vLLM has
    no such op)."""
    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    vllm_name: str | None = ""  # "" = same as name
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def vllm(self):
        return self.name if self.vllm_name == "" else self.vllm_name


class Family:
    """What a bench_<family>.py supplies. Cases vary ``x_axis`` (num_tokens, say) over
    ``x_default`` for each combination of ``shape_axes``; ``make_inputs`` returns the tensors
    (and scalars) of one call by role name."""
    name = ""
    ops: dict = {}
    providers: dict = {}
    x_axis, x_default, x_quick = "num_tokens", [1, 8, 32, 128, 1024, 16384], [1, 128, 16384]
    shape_axes: list = []  # (flag, case key, default list, help)
    dtypes = ("bf16", "fp16")
    vllm_ns = "_C"
    vllm_aliases: dict = {}
    bytes_model = "every read tensor once + every written tensor once"
    fake = {}  # provider -> (floor µs, GB/s) for --dry-run

    def add_arguments(self, parser):
        pass

    def shape_label(self, case) -> str:
        return ", ".join(f"{k} {case[k]}" for _, k, _, _ in self.shape_axes)

    def op_bytes(self, op, case) -> int:
        raise NotImplementedError

    def make_inputs(self, op, case, device, seed) -> dict:
        raise NotImplementedError

    def scalars(self, case) -> dict:
        """Scalar arguments of every call (eps, group size...), by role name."""
        return {}

    def cases(self, args) -> list[dict]:
        import itertools
        axes = [(k, getattr(args, k)) for _, k, _, _ in self.shape_axes]
        out = []
        for o in args.ops:
            for combo in itertools.product(*(v for _, v in axes)):
                for x in getattr(args, self.x_axis):
                    case = {"op": o, **dict(zip((k for k, _ in axes), combo)), self.x_axis: x,
                            "dtype": args.dtype, "l2": "cold" if args.l2_cold else "warm",
                            **self.scalars_of_args(args)}
                    case["x"] = x
                    case["shape"] = self.shape_label(case)
                    case["bytes"] = self.op_bytes(self.ops[o], case)
                    out.append(case)
        return out

    def scalars_of_args(self, args) -> dict:
        return {}


class LoomnbProvider(Provider):
    """Base of every family's loomnb provider: ``self.m`` is the ``loomnb`` module (a failed
    import skips the provider with its reason); a family writes ``bind``."""
    name = "loomnb"

    def setup(self, args, log):
        try:
            import loomnb
        except Exception as e:  # noqa: BLE001
            return f"import loomnb failed: {e!r}"
        self.m = loomnb

    def fresh(self):
        """Clear loomnb's launch cache: its keys hold the tensors, not the launch constants a
        :class:`TunedProvider` sets, so a later provider on tensors at the same addresses could
        replay a launch remembered under another configuration."""
        self.m.ops.clear_launch_cache()


class TunedProvider:
    """Mixin for a loomnb provider at another launch configuration (``--tune``): ``config``
    maps constants of ``module`` (a ``loomnb.ops`` family module) to values, set around each
    call and restored after, so graph replays measure the configured launches (the launch
    cache is cleared before each case: :meth:`LoomnbProvider.fresh`). Build one with
    :func:`tuned`."""
    module: str = ""
    config: dict = {}

    def setup(self, args, log):
        if not getattr(args, "tune", False):
            return "tuning variant: pass --tune"
        err = super().setup(args, log)
        if err is None:
            import importlib
            self._module = importlib.import_module(self.module)
        return err

    def bind(self, op, t, case):
        call, collect = super().bind(op, t, case)
        mod, cfg = self._module, self.config

        def configured():
            saved = {k: getattr(mod, k) for k in cfg}
            for k, v in cfg.items():
                setattr(mod, k, v)
            try:
                return call()
            finally:
                for k, v in saved.items():
                    setattr(mod, k, v)
        return configured, collect


def tuned(base, module, suffix, **config):
    """Provider class ``<base.name>_<suffix>``: ``base`` with ``module``'s constants ``config``
    (see :class:`TunedProvider`)."""
    for k in config:
        assert k.isupper(), f"{k}: tune a module constant"
    return type(f"{base.__name__}_{suffix}", (TunedProvider, base),
                {"name": f"{base.name}_{suffix}", "module": module, "config": config,
                 "__doc__": f"{base.name} with {module}.{config} (--tune)"})


def load_vllm_library(args):
    """``(path, error)``: vLLM's compiled-ops library from ``--vllm-lib`` or ``LOOMNB_VLLM_LIB``
    loaded into ``torch.ops`` (``path`` None when neither is given; ``error`` a provider's
    skip reason, or None)."""
    path = getattr(args, "vllm_lib", None) or os.environ.get("LOOMNB_VLLM_LIB")
    if not path:
        return None, None
    if not Path(path).is_file():
        return path, f"vLLM library not found: {path}"
    try:
        torch.ops.load_library(path)
    except Exception as e:  # noqa: BLE001
        return path, f"torch.ops.load_library({path}) failed: {e!r}"
    return path, None


class VllmProvider(Provider):
    """vLLM's compiled ops from its .so, loaded without importing vllm; arguments are bound by
    the schema's names (printed at start). Ops already registered in-process (tests) are used
    when no library is given."""
    name = "vllm"
    family: Family = None

    def setup(self, args, log):
        path, err = load_vllm_library(args)
        if err:
            return err
        ns = getattr(torch.ops, self.family.vllm_ns)
        first = next((o.vllm for o in self.family.ops.values() if o.vllm), None)
        if path:
            self.lib = str(Path(path).resolve())
        elif first and hasattr(ns, first):
            self.lib = f"torch.ops.{self.family.vllm_ns} already registered in this process"
        else:
            return "no --vllm-lib given and LOOMNB_VLLM_LIB is unset"
        self.ns, self.schemas, self.bindings, self.log = ns, {}, {}, log
        for op in self.family.ops.values():
            if not op.vllm:
                continue
            try:
                self.schemas[op.name] = str(getattr(ns, op.vllm).default._schema)
            except (AttributeError, RuntimeError) as e:
                self.schemas[op.name] = f"MISSING {op.vllm}: {e}"
            log(f"[vllm] schema {self.schemas[op.name]}")

    def unsupported(self, case):
        if not self.family.ops[case["op"]].vllm:
            return f"vLLM has no {case['op']}"

    def bind(self, op, t, case):
        try:
            packet = getattr(self.ns, op.vllm)
        except (AttributeError, RuntimeError) as e:
            raise NotAvailable(f"torch.ops.{self.family.vllm_ns}.{op.vllm} missing: {e}") from e
        scalars = tuple(self.family.scalars(case))
        args, kwargs, desc = bind_schema(packet.default._schema, {**t, **self.family.scalars(case)},
                                         op.reads + op.writes + scalars, self.family.vllm_aliases)
        if op.name not in self.bindings:
            self.log(f"[vllm] {op.name}({desc})")
            self.bindings[op.name] = desc
        return functools.partial(packet, *args, **kwargs), lambda _: {k: t[k] for k in op.writes}


def compiled(torch_provider):
    """The torch.compile twin of a provider of torch composites (its ``fn(op)`` gives the
    composite): default mode, dynamic=False (one specialised kernel per shape). The first call
    compiles, always outside timed regions; any failure is reported as a skip."""
    class TorchCompile(torch_provider):
        name = "torch_compile"
        error_status = "skip"

        def setup(self, args, log):
            for knob in ("cache_size_limit", "recompile_limit"):  # one compile per shape per op
                if hasattr(torch._dynamo.config, knob):
                    setattr(torch._dynamo.config, knob, 256)
            self.compiled = {}
            return super().setup(args, log)

        def fn(self, op):
            if op.name not in self.compiled:
                self.compiled[op.name] = torch.compile(super().fn(op), dynamic=False)
            return self.compiled[op.name]

    TorchCompile.__doc__ = compiled.__doc__
    return TorchCompile


RESULTS_DIR = Path(__file__).resolve().parent / "results"  # real runs' results (committed)
# --dry-run's default --out: fake numbers never land among the committed results
DRY_RUN_DIR = Path(tempfile.gettempdir()) / "loomnb-dry-run"


def default_out(dry_run: bool) -> Path:
    """Where a run writes without ``--out``: :data:`RESULTS_DIR`, or :data:`DRY_RUN_DIR` for
    ``--dry-run``."""
    return DRY_RUN_DIR if dry_run else RESULTS_DIR


def parse_args(family: Family, argv=None):
    import argparse
    p = argparse.ArgumentParser(description=f"{family.name} benchmark; see benchmarks/README.md")
    a = p.add_argument
    a("--out", type=Path, default=None,
      help=f"folder for the JSON and CSV (default: {RESULTS_DIR}; with --dry-run "
           f"{DRY_RUN_DIR}, outside the repository)")
    a("--ops", type=csv_list(str, family.ops), default=list(family.ops), help="comma list (default: all)")
    a("--providers", type=csv_list(str, family.providers),
      default=[n for n, p in family.providers.items() if not issubclass(p, TunedProvider)],
      help="comma list, in forward order (default: %(default)s; the --tune variants only "
           "when named)")
    a("--" + family.x_axis.replace("_", "-"), type=csv_list(int),
      help=f"default {','.join(map(str, family.x_default))} (--quick: {','.join(map(str, family.x_quick))})")
    for flag, key, default, help_ in family.shape_axes:
        a(flag, dest=key, type=csv_list(int), default=default, help=help_)
    a("--dtype", choices=list(family.dtypes), default=family.dtypes[0])
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
    a("--tune", action="store_true",
      help="also run the family's loomnb_* tuning variants (other launch constants)")
    family.add_arguments(p)
    args = p.parse_args(argv)
    if args.out is None:
        args.out = default_out(args.dry_run)
    if getattr(args, family.x_axis) is None:
        setattr(args, family.x_axis, family.x_quick if args.quick else family.x_default)
    args.target_ms = args.target_ms or (0.5 if args.quick else 2.0)
    args.repeats = args.repeats or (5 if args.quick else 15)
    if args.dry_run:
        args.device = "cpu"
    elif args.device != "cpu" and not torch.cuda.is_available():
        p.error("no CUDA device: use --dry-run (fake timings) or --device cpu (smoke test)")
    return args


def make_provider(family, name):
    prov = family.providers[name]()
    prov.family = family
    return prov


def pick_ref(family, args, provs: dict, log):
    """The exactness reference provider (vLLM, else torch with a logged note), or None."""
    if args.no_exact:
        return None
    ref = provs.get(args.exact_ref)
    if ref is None and args.exact_ref in family.providers:
        ref = make_provider(family, args.exact_ref)
        ref.skip = ref.setup(args, log)
    if ref is None or ref.skip:
        log(f"[exact] reference {args.exact_ref} unavailable ({ref.skip if ref else 'no provider'}); "
            "comparing with torch")
        ref = provs.get("torch") or make_provider(family, "torch")
    return ref


def run(family: Family, argv=None) -> Path:
    """The benchmark command of ``family``: parse, set up providers, sweep both provider
    orders, write JSON + CSV after every case (a killed run keeps what it finished)."""
    args = parse_args(family, argv)
    log = RunLog()
    passes = provider_passes(args.providers, args.order)
    provs = {n: make_provider(family, n) for n in args.providers}
    cold = "cold" if args.l2_cold else "warm"
    meta = {"benchmark": family.name, "format": 2, "dry_run": args.dry_run, "l2": cold,
            "x_axis": family.x_axis,
            **env_metadata(args.device, packages=("liger-kernel", "loomnb", "vllm", "tqdm",
                                                  "flashinfer-python")),
            "flags": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "provider_passes": passes, "units": UNITS, "bytes_model": family.bytes_model}
    ref = None
    measure = functools.partial(_fake_timing, family)
    args.l2_bytes = args.l2_bytes or l2_bytes(args.device)
    meta["l2_bytes"] = args.l2_bytes
    if args.dry_run:
        meta["copy_bandwidth"] = {"GBps": 4400.0, "method": "fake (dry run)"}
    else:
        for name, prov in provs.items():
            prov.skip = prov.setup(args, log)
            log(f"[{name}] " + (f"SKIPPED: {prov.skip}" if prov.skip else "ready"))
        ref = pick_ref(family, args, provs, log)
        measure = functools.partial(_case_timing, family, args)
        meta["copy_bandwidth"] = copy_bandwidth(int(args.copy_gib * 2**30), device=args.device)
        log(f"[copy] {meta['copy_bandwidth']['GBps']:.0f} GB/s (torch.mul, graph-replayed)")
    meta["providers"] = {n: {"skip": p.skip, "about": (type(p).__doc__ or "").strip()}
                         for n, p in provs.items()}
    meta["exact_ref"] = "vllm (fake)" if args.dry_run else ref.name if ref else None
    meta["copy_GBps"] = meta["copy_bandwidth"]["GBps"]
    gpu = (meta.get("gpu") or args.device).replace(" ", "-")
    stem = "_".join(x for x in (family.name, timestamp(), gpu, "l2cold" if args.l2_cold else "",
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
        return write_results(args.out, stem, meta, rows)

    try:
        with torch.inference_mode():  # as in vLLM: no autograd bookkeeping on any path
            sweep(family.cases(args), passes, provs, measure=measure, ref=ref, log=log,
                  outputs=functools.partial(_case_outputs, family, args), checkpoint=checkpoint,
                  rows=rows)
        if not args.dry_run:
            end = copy_bandwidth(int(args.copy_gib * 2**30), device=args.device)
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


def _case_outputs(family, args, prov, case) -> dict:
    """One call on fresh inputs (seed args.seed: identical for every provider); cloned outputs."""
    op = family.ops[case["op"]]
    t = family.make_inputs(op, case, args.device, args.seed)
    prov.fresh()
    call, collect = prov.bind(op, t, case)
    return {k: v.clone() for k, v in collect(call()).items()}


def _case_timing(family, args, prov, case, pass_i) -> dict:
    op = family.ops[case["op"]]
    prov.fresh()
    make_call = lambda i: prov.bind(  # noqa: E731
        op, family.make_inputs(op, case, args.device, args.seed + 1000 + i), case)[0]
    return time_case(make_call, case["bytes"], l2_cold=args.l2_cold, l2=args.l2_bytes,
                     target_ms=args.target_ms, repeats=args.repeats, device=args.device)


def _fake_timing(family, prov, case, pass_i) -> dict:
    """--dry-run: made-up but plausible numbers (and exactness) so the plumbing runs on CPU."""
    floor, bw = family.fake.get(prov.name, (5.0, 3000.0))
    us = (floor + case["bytes"] / (bw * 1e3)) * (1 + 0.02 * pass_i)
    ex = 1.0 if prov.name in ("loomnb", "vllm") else 0.995
    return {"l2_sets": 1, "graph_us": us, "graph_us_min": 0.98 * us, "graph_n": 100,
            "eager_us": us + 9.0, "host_us": 9.0, "eager_n": 100, "timer": "fake",
            "GBps": case["bytes"] / (us * 1e-6) / 1e9,
            "exact": {k: ex for k in family.ops[case["op"]].writes}, "exact_min": ex}


# ---------------------------------------------------------------- for the benchmark tests
_MOCK_LIBS: dict = {}


def register_mock_ops(ns: str, schemas: dict, impls: dict, dispatch: str = "CPU") -> None:
    """Register ``impls[name]`` under ``ns::name`` with ``schemas[name]`` (once per namespace):
    the benchmark tests' stand-ins for vLLM's compiled ops, so binding by schema names,
    exactness and the sweep run on a CPU."""
    if ns in _MOCK_LIBS:
        return
    lib = torch.library.Library(ns, "FRAGMENT")
    for name, schema in schemas.items():
        lib.define(name + schema)
        lib.impl(name, impls[name], dispatch)
    _MOCK_LIBS[ns] = lib


def ready_providers(family: Family, argv=("--quick",), names=None):
    """(args, {name: provider set up}) for a family's pytest-benchmark GPU cases (``names``:
    a subset of its providers)."""
    args = parse_args(family, list(argv))
    log = RunLog()
    provs = {n: make_provider(family, n) for n in (names or family.providers)}
    for p in provs.values():
        p.skip = p.setup(args, log)
    return args, provs


def benchmark_graph(benchmark, call, nbytes: int, *, rounds: int = 20, warmup_rounds: int = 2) -> None:
    """A pytest-benchmark GPU case: back-to-back calls captured in one CUDA graph (as many as
    ``time_graph`` picks), pytest-benchmark timing whole replays + a sync; ``extra_info``
    carries the per-call graph time from CUDA events, the calls per replay and the GB/s."""
    res = time_graph(call, target_ms=1.0, repeats=10)
    benchmark.extra_info.update(graph_us_per_call=res["us"], calls_per_replay=res["n"],
                                bytes=nbytes, GBps=nbytes / (res["us"] * 1e-6) / 1e9)
    g = _capture([call], res["n"])
    benchmark.pedantic(lambda: (g.replay(), torch.cuda.synchronize()), rounds=rounds,
                       warmup_rounds=warmup_rounds, iterations=1)
