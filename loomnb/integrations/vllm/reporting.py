"""What the plug-in did in this process, as data (:func:`report`, what
``benchmarks/bench_vllm_ab.py`` collects from vLLM's worker processes) and as text
(:func:`summary`)."""

import dataclasses

import loomnb

from .counts import custom_op_modes, fallback_counts, routed_counts
from .registration import _STATE, PLUGIN, routes

__all__ = ["report", "summary", "process"]


def report():
    """Routes and counts as plain data (JSON-ready), and which process they are of
    (``process``: :func:`process`). vLLM loads the plug-in in every worker process (one per
    tensor-parallel rank), and each counts its own decisions: collect the report of every rank
    (``LLM.collective_rpc``) to see them all."""
    return {"plugin": PLUGIN, "loomnb_version": loomnb.__version__,
            "vllm_version": _STATE["vllm_version"], "registered": _STATE["registered"],
            "process": process(),
            "routes": [dataclasses.asdict(r) for r in routes()],
            "routed_counts": routed_counts(), "fallback_counts": fallback_counts(),
            "custom_op_modes": custom_op_modes()}


def process():
    """``{"pid", "rank", "world_size", "device"}`` of this process: the rank and world size of
    torch.distributed's default group when it is initialised (as in vLLM's workers, one per
    tensor-parallel rank), else of ``$RANK`` / ``$WORLD_SIZE`` (0 and 1 when unset); the
    current CUDA device (``"cuda:<index>"``) once CUDA is initialised, else None."""
    import os

    import torch

    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    device = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = f"cuda:{torch.cuda.current_device()}"
    return {"pid": os.getpid(), "rank": rank, "world_size": world, "device": device}


def _where() -> str:
    """Which vLLM the plug-in runs in: the one that registered it, else the installed one."""
    if _STATE["vllm_version"] is not None:
        return f"in vLLM {_STATE['vllm_version']}"
    import importlib.metadata

    try:
        installed = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "(vLLM is not installed here)"
    return f"beside vLLM {installed} (not registered by vLLM in this process)"


def summary():
    """:func:`report` as text, one line per route and per count."""
    rep = report()
    pr = rep["process"]
    lines = [f"loomnb {rep['loomnb_version']} {_where()}:",
             f"  process: rank {pr['rank']} of {pr['world_size']}, pid {pr['pid']}, "
             f"{pr['device'] or 'no CUDA device yet'}"]
    for r in rep["routes"]:
        state = "routed" if r["routed"] else "NOT routed"
        lines.append(f"  {r['vllm_op']} -> {r['loomnb_op']} via {r['mechanism']}: {state} "
                     f"({r['reason']}); enable with {r['enable']}")
    for op, n in sorted(rep["routed_counts"].items()):
        lines.append(f"  {op}: {n} decision(s) routed to loomnb")
    for op, per in sorted(rep["fallback_counts"].items()):
        for reason, n in sorted(per.items()):
            lines.append(f"  {op}: {n} decision(s) left to vLLM: {reason}")
    for cls_name, per in sorted(rep["custom_op_modes"].items()):
        lines.append(f"  {cls_name} instances by forward: " +
                     ", ".join(f"{mode} {n}" for mode, n in sorted(per.items())))
    return "\n".join(lines)
