"""What one decode step launches: kernel counts per step and per layer, and a per-kernel
time table.

:func:`step_kernel_counts` runs one eager decode step of a runner and counts what it issues:
on CUDA the kernels ``torch.profiler`` records (activity type CUDA; memcpy/memset counted
apart), on the CPU the calls into the ops backend (torch's own GEMMs and elementwise ops are
not counted there, and the result says so). The per-layer count comes from running the step
again stopped after layer 1 and after layer 2 (``LlamaModel.forward``'s ``on_layer`` hook):
``per_layer = n(2 layers) - n(1 layer)``, the rest of the step is ``outside_layers``.

:func:`kernel_table` profiles a callable (graph replays or eager steps) and sums each kernel
name's calls and device time per step.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .graphs import DecodeGraphs
from .paged_cache import cdiv, compute_slot_mapping

__all__ = ["kernel_events", "kernel_table", "step_kernel_counts"]


class _Stop(Exception):
    """Raised from ``on_layer`` to stop a step after a given layer."""


class _CountingOps:
    """An ops backend that counts the calls made into it (everything else is delegated)."""

    def __init__(self, ops):
        self._ops, self.calls = ops, 0

    def __getattr__(self, name):
        attr = getattr(self._ops, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls += 1
            return attr(*args, **kwargs)

        return counted


def _is_copy(name: str) -> bool:
    return name.startswith(("Memcpy", "Memset", "memcpy", "memset"))


def kernel_events(prof):
    """``(name, device µs)`` of every device activity (activity type CUDA) a finished
    ``torch.profiler.profile`` recorded, from its Kineto results (kernels launched through
    the driver API, as loomnb's are, included)."""
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CUDA and not e.is_user_annotation():
            out.append((e.name(), e.duration_ns() / 1e3))
    return out


def _device_events(fn, device):
    """:func:`kernel_events` of one profiled call of ``fn`` on CUDA ``device`` (synchronised
    before and after, so only ``fn``'s work is in it)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return kernel_events(prof)


def _profiled_count(fn, device):
    events = _device_events(fn, device)
    kernels = sum(not _is_copy(n) for n, _ in events)
    return kernels, len(events) - kernels


def step_kernel_counts(runner, num_seqs: int, context: int = 16) -> dict:
    """Count what one eager decode step of ``num_seqs`` sequences at ``context`` tokens
    issues, padded as :class:`DecodeGraphs` pads it (the graph holds these same kernels).

    Returns a dict: ``what`` (``"CUDA kernels (torch.profiler)"`` or ``"ops-backend calls
    (torch ops not counted)"``), ``per_step``, ``per_layer``, ``outside_layers`` (the
    embedding, the bookkeeping, the final norm, the logits, sampling), ``copies`` (memcpy/
    memset activities per step on CUDA, else None). Writes the cache slots of the step (the
    runner's blocks ``0 .. cdiv(context, block_size) * num_seqs - 1``) and calibrates an FP8
    cache's scales on a first warm-up step."""
    model, dev = runner.model, runner.model.device
    bs = runner.block_size
    blocks = cdiv(context, bs)
    block_tables = torch.arange(num_seqs * blocks, dtype=torch.int32, device=dev).view(num_seqs,
                                                                                        blocks)
    graphs = DecodeGraphs(runner, blocks, 4, use_graphs=False)
    ids = torch.zeros(num_seqs, dtype=torch.long, device=dev)
    positions = torch.full((num_seqs,), context - 1, dtype=torch.long, device=dev)
    graphs.load(ids, positions, block_tables)
    graphs.step()  # warm-up: compiles kernels, calibrates an FP8 cache
    st = graphs._current()

    def step(stop_after=None):  # after a load (outside the counted region)
        def on_layer(n):
            if n == stop_after:
                raise _Stop

        slots = compute_slot_mapping(st.block_tables, st.seq_idx, st.positions, bs)
        try:
            hidden = model.forward(st.input_ids, st.positions, slots, st.block_tables,
                                   (st.positions + 1).to(torch.int32), runner.kv_cache,
                                   runner.ops, on_layer=on_layer, decode=True)
            runner.ops.greedy_sample_logprob(model.compute_logits(hidden))
        except _Stop:
            pass

    num_layers = len(model.layers)
    if dev.type == "cuda":
        what = "CUDA kernels (torch.profiler)"
        counts = []
        for s in (None, 1, 2):
            graphs.load(ids, positions, block_tables)
            counts.append(_profiled_count(lambda s=s: step(s), dev))
        (full, copies), (one, _), (two, _) = counts
    else:
        what = "ops-backend calls (torch ops not counted)"
        counting, saved = _CountingOps(runner.ops), runner.ops
        runner.ops = counting
        try:
            n = []
            for s in (None, 1, 2):
                graphs.load(ids, positions, block_tables)
                counting.calls = 0
                step(s)
                n.append(counting.calls)
        finally:
            runner.ops = saved
        full, one, two = n
        copies = None
    per_layer = two - one if num_layers >= 2 else None
    outside = full - per_layer * num_layers if per_layer is not None else None
    return {"what": what, "per_step": full, "per_layer": per_layer, "outside_layers": outside,
            "copies": copies, "num_seqs": num_seqs, "bucket": graphs.bucket,
            "num_layers": num_layers}


def kernel_table(fn, steps: int, device) -> list[dict]:
    """Profile ``fn`` (``steps`` decode steps: graph replays or eager steps) on CUDA and sum
    the device activities per kernel name: rows ``{"name", "calls_per_step", "us_per_step",
    "share"}`` (share of the summed device time), largest first. Empty if the profiler saw
    no device activity (e.g. graph kernels not traced by this CUPTI)."""
    calls, us = defaultdict(int), defaultdict(float)
    for name, dur in _device_events(fn, device):
        calls[name] += 1
        us[name] += dur
    total = sum(us.values()) or 1.0
    rows = [{"name": n, "calls_per_step": calls[n] / steps, "us_per_step": us[n] / steps,
             "share": us[n] / total} for n in calls]
    return sorted(rows, key=lambda r: -r["us_per_step"])
