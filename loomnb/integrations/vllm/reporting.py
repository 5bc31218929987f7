"""What the plug-in did in this process, as data (:func:`report`, what
``benchmarks/bench_vllm_ab.py`` collects from vLLM's worker processes) and as text
(:func:`summary`)."""

import dataclasses

import loomnb

from .counts import custom_op_modes, fallback_counts, routed_counts
from .registration import _STATE, PLUGIN, routes

__all__ = ["report", "summary"]


def report():
    """Routes and counts as plain data (JSON-ready)."""
    return {"plugin": PLUGIN, "loomnb_version": loomnb.__version__,
            "vllm_version": _STATE["vllm_version"], "registered": _STATE["registered"],
            "routes": [dataclasses.asdict(r) for r in routes()],
            "routed_counts": routed_counts(), "fallback_counts": fallback_counts(),
            "custom_op_modes": custom_op_modes()}


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
    lines = [f"loomnb {rep['loomnb_version']} {_where()}:"]
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
