"""Decode steps at bucketed batch sizes, one CUDA graph per bucket (eager on the CPU).

Engines capture the decode step once per batch size of a fixed list and pad each batch up to
the smallest captured size (vLLM's ``cudagraph_capture_sizes``). :class:`DecodeGraphs` does
that for :class:`~loomnb.models.llama.ModelRunner`: a batch of ``num_seqs`` sequences runs in
bucket ``B = bucket_size(num_seqs)`` (1, 2, 4, 8, 16, 32, 64), rows ``num_seqs .. B - 1``
padded. A padded row is harmless by construction:

* its ``seq_idx`` is -1, so its ``slot_mapping`` entry is ``PAD_SLOT_ID`` (-1): loomnb's
  cache writes skip it, the torch write sends it to the scratch block's last row;
* its block-table row is all scratch block (``PagedKVCache.scratch_block``, never handed
  out) and its position stays 0, so ``seq_lens`` is 1 and attention reads one row of the
  scratch block, inside the cache;
* its sampled tokens are never returned.

Rows are independent in every op of the step, so the real rows' tokens are those of the
unpadded batch; the GEMMs see ``B`` rows instead of ``num_seqs``, which on a GPU may pick
another kernel and move a bf16 logit by an ulp (a near-tie may flip; see
:func:`~loomnb.models.llama.compare_greedy`). The graph and the eager run of the same bucket
compute the same thing on the same shapes.

One step is the whole decode step on static buffers, bookkeeping included, so a replay is
the only host work per token::

    input_ids = forced[:, step] if teacher forcing else input_ids
    slot_mapping = block_tables[seq_idx, positions // block_size] * block_size
                   + positions % block_size          (-1 where seq_idx < 0)
    seq_lens = positions + 1                          (int32)
    logits = runner.decode_logits(...);  ids, logprob, rank = ops.greedy_sample_logprob(logits)
                     (sampled: sampler.sample(ops, logits); sampler.advance())
    tokens[:, step], logprobs[:, step], ranks[:, step] = ids, logprob, rank
    input_ids = ids;  positions += valid;  step += 1

On CUDA (``use_graphs=True``) each bucket's step (and, separately, its teacher-forced step) is
captured at its first :meth:`step` (or
:meth:`capture`) after a :meth:`load`: one warm-up run on a side stream (it compiles
loomnb's kernels and computes this very step), the state reset, the capture, the state reset
again; replays then recompute that step. On the CPU the same buffers and padding run eagerly.
"""

from __future__ import annotations

import time

import torch

from .paged_cache import compute_slot_mapping

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
__all__ = ["DECODE_BUCKETS", "DecodeGraphs", "bucket_size"]


def bucket_size(num_seqs: int, buckets=DECODE_BUCKETS) -> int:
    """The smallest bucket ``>= num_seqs``. Raises ``ValueError`` for ``num_seqs < 1`` or
    more sequences than the largest bucket."""
    if num_seqs < 1:
        raise ValueError(f"num_seqs must be >= 1; got {num_seqs}")
    for b in sorted(buckets):
        if b >= num_seqs:
            return b
    raise ValueError(f"{num_seqs} sequences exceed the largest decode bucket {max(buckets)}; "
                     f"buckets: {tuple(sorted(buckets))}")


class _Bucket:
    """Static buffers of one bucket (``rows`` sequences, ``max_blocks`` blocks each, ``steps``
    recorded steps), all on ``device``."""

    def __init__(self, rows, max_blocks, steps, num_top_logits, device):
        long = dict(dtype=torch.long, device=device)
        self.rows = rows
        self.input_ids = torch.zeros(rows, **long)
        self.positions = torch.zeros(rows, **long)
        self.valid = torch.zeros(rows, **long)  # 1 real row, 0 padding
        self.seq_idx = torch.full((rows,), -1, **long)
        self.block_tables = torch.zeros(rows, max_blocks, dtype=torch.int32, device=device)
        self.step = torch.zeros(1, **long)
        self.forced = torch.zeros(rows, steps, **long)
        self.tokens = torch.zeros(rows, steps, **long)
        self.logprobs = torch.zeros(rows, steps, dtype=torch.float32, device=device)
        self.ranks = torch.zeros(rows, steps, **long)
        k = max(num_top_logits, 1)
        self.top_ids = torch.zeros(rows, steps, k, **long)
        self.top_vals = torch.zeros(rows, steps, k, dtype=torch.float32, device=device)
        self.graphs = {}  # teacher forcing (bool) -> torch.cuda.CUDAGraph

    def mutable(self):
        """The buffers a step advances (saved around the warm-up and the capture)."""
        return (self.input_ids, self.positions, self.step)


class DecodeGraphs:
    """Greedy decode steps of a :class:`~loomnb.models.llama.ModelRunner`, padded to a bucket
    and (on CUDA) replayed from one CUDA graph per bucket (module docstring).

    Args:
        runner: the model runner; its KV cache is mutated by every step (the real rows' slots
            and the scratch block).
        max_blocks: width of every block table (the widest one :meth:`load` will see).
        max_steps: how many steps a load may run (the per-step outputs are recorded in
            ``[B, max_steps]`` buffers).
        num_top_logits: also record each step's top-k fp32 logits (0: off).
        buckets: the batch sizes to pad to.
        sampler: a :class:`~loomnb.models.sampling_params.SamplerState` with the bucket's rows
            (default None: greedy); each step then samples through it and advances its offset,
            in the graph.
        use_graphs: capture CUDA graphs (default: when the model is on CUDA); ``False`` runs
            the same padded step eagerly. ``True`` off CUDA raises ``ValueError``.

    Attributes: ``capture_time_s`` (warm-up + capture, summed over buckets), ``bucket`` and
    ``num_seqs`` of the last load.
    """

    def __init__(self, runner, max_blocks: int, max_steps: int, *, num_top_logits: int = 0,
                 buckets=DECODE_BUCKETS, use_graphs: bool | None = None, sampler=None):
        self.runner = runner
        self.device = runner.model.device
        if use_graphs is None:
            use_graphs = self.device.type == "cuda"
        if use_graphs and self.device.type != "cuda":
            raise ValueError("use_graphs=True needs the model on a CUDA device")
        self.use_graphs = use_graphs
        self.max_blocks, self.max_steps = max_blocks, max(max_steps, 1)
        self.num_top_logits = num_top_logits
        self.sampler = sampler
        self.buckets = tuple(sorted(buckets))
        self.capture_time_s = 0.0
        self.bucket = self.num_seqs = None
        self._forcing = False
        self._buckets: dict[int, _Bucket] = {}

    def load(self, input_ids, positions, block_tables, forced_token_ids=None) -> int:
        """Set the state of the next steps; returns the bucket. ``input_ids``/``positions``
        int64 ``[num_seqs]`` (the token to feed and its position), ``block_tables`` int32
        ``[num_seqs, <= max_blocks]``, ``forced_token_ids`` int64 ``[num_seqs, <= max_steps]``
        (step ``s`` feeds ``forced[:, s]`` instead of the previous step's token), all on the
        model's device. Copies into the bucket's buffers (no host sync); padding rows as the
        module docstring says. Mutates only this object's buffers."""
        n = input_ids.shape[0]
        if block_tables.shape[1] > self.max_blocks:
            raise ValueError(f"block_tables has {block_tables.shape[1]} columns; this "
                             f"DecodeGraphs was built for max_blocks={self.max_blocks}")
        B = bucket_size(n, self.buckets)
        if self.sampler is not None and self.sampler.rows != B:
            raise ValueError(f"the sampler state has {self.sampler.rows} rows; {n} sequences run "
                             f"in bucket {B}")
        st = self._buckets.get(B)
        if st is None:
            st = self._buckets[B] = _Bucket(B, self.max_blocks, self.max_steps,
                                            self.num_top_logits, self.device)
        scratch = self.runner.kv_cache.scratch_block
        st.input_ids.zero_()
        st.input_ids[:n] = input_ids
        st.positions.zero_()
        st.positions[:n] = positions
        st.valid.zero_()
        st.valid[:n] = 1
        st.seq_idx.fill_(-1)
        st.seq_idx[:n] = torch.arange(n, device=self.device)
        st.block_tables.fill_(scratch)
        st.block_tables[:n, :block_tables.shape[1]] = block_tables
        st.step.zero_()
        st.forced.zero_()
        if forced_token_ids is not None:
            st.forced[:n, :forced_token_ids.shape[1]] = forced_token_ids
        self._forcing = forced_token_ids is not None
        self.bucket, self.num_seqs = B, n
        return B

    def _body(self, st: _Bucket) -> None:
        """One padded decode step on ``st``'s buffers: device work only (capturable)."""
        r = self.runner
        ids = st.forced.index_select(1, st.step).view(-1) if self._forcing else st.input_ids
        slots = compute_slot_mapping(st.block_tables, st.seq_idx, st.positions, r.block_size)
        logits = r.decode_logits(ids, st.positions, slots, st.block_tables,
                                 (st.positions + 1).to(torch.int32))
        if self.num_top_logits:
            top = logits.float().topk(self.num_top_logits, dim=-1)
            st.top_ids.index_copy_(1, st.step, top.indices.unsqueeze(1))
            st.top_vals.index_copy_(1, st.step, top.values.unsqueeze(1))
        if self.sampler is None:
            nxt, lp, rank = r.ops.greedy_sample_logprob(logits)
        else:
            nxt, lp, rank = self.sampler.sample(r.ops, logits)
            self.sampler.advance()
        st.tokens.index_copy_(1, st.step, nxt.to(torch.long).view(-1, 1))
        st.logprobs.index_copy_(1, st.step, lp.to(torch.float32).view(-1, 1))
        st.ranks.index_copy_(1, st.step, rank.to(torch.long).view(-1, 1))
        st.input_ids.copy_(nxt.view(-1))
        st.positions.add_(st.valid)
        st.step.add_(1)

    def capture(self) -> None:
        """Capture the loaded bucket's graph if it has none (no-op without graphs). The
        warm-up computes the loaded step; the state is reset after it and after the capture,
        so the next :meth:`step` computes it again."""
        st = self._current()
        if not self.use_graphs or self._forcing in st.graphs:
            return
        t0 = time.perf_counter()
        state = st.mutable() + (() if self.sampler is None else self.sampler.mutable())
        saved = [t.clone() for t in state]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._body(st)  # compiles loomnb's kernels and remembers their launches
        torch.cuda.current_stream(self.device).wait_stream(side)
        for t, s in zip(state, saved):
            t.copy_(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._body(st)
        for t, s in zip(state, saved):  # the capture ran nothing; reset anyway
            t.copy_(s)
        torch.cuda.synchronize(self.device)
        st.graphs[self._forcing] = graph
        self.capture_time_s += time.perf_counter() - t0

    def step(self) -> None:
        """Run one decode step of the loaded batch: a graph replay (captured first if needed)
        or the eager padded step. Mutates the bucket's buffers and the KV cache."""
        st = self._current()
        if not self.use_graphs:
            self._body(st)
            return
        if self._forcing not in st.graphs:
            self.capture()
        st.graphs[self._forcing].replay()

    def outputs(self, num_steps: int | None = None) -> dict:
        """The real rows' recorded outputs of steps ``0 .. num_steps - 1`` (default all), device
        tensors: ``tokens`` int64 ``[num_seqs, num_steps]``, ``logprobs`` fp32, ``ranks``
        int64, and with ``num_top_logits`` ``top_ids``/``top_vals`` ``[num_seqs, num_steps,
        k]``. Views of the buffers: clone them before the next load."""
        st, n = self._current(), self.num_seqs
        s = self.max_steps if num_steps is None else num_steps
        out = {"tokens": st.tokens[:n, :s], "logprobs": st.logprobs[:n, :s],
               "ranks": st.ranks[:n, :s]}
        if self.num_top_logits:
            out["top_ids"] = st.top_ids[:n, :s]
            out["top_vals"] = st.top_vals[:n, :s]
        return out

    def _current(self) -> _Bucket:
        if self.bucket is None:
            raise RuntimeError("DecodeGraphs: load() a batch first")
        return self._buckets[self.bucket]
