"""Sampling in the decode loop: vLLM's per-request sampling parameters and the device state a
sampled decode carries from step to step.

:class:`SamplingParams` holds the fields of vLLM's ``SamplingParams`` the loop honours, with
vLLM's ranges and defaults (``temperature`` 0 here: the loop is greedy unless asked). The
default parameters are the plain greedy loop, which keeps its own path
(``greedy_sample_logprob``); any other parameters sample through :class:`SamplerState`. One step
of a sampled decode, on the device, with no host synchronisation (CUDA-graph capturable)::

    x = float32(logits)                                   (a copy, only when a penalty is
    apply_penalties_(x, prompt_mask, output_counts,        set; else x = logits, read in the
                     repetition, frequency, presence)      model's dtype: the same values)
    ids = top_k_top_p_sampling_from_logits(x, top_k, top_p, temperature=T, min_p=min_p,
                                           seed=seeds, offset=offset)
    logprob, rank = selected_token_logprob_rank(logits, ids)   (vLLM's "raw_logprobs"; with
        "processed_logprobs" of top_k_top_p_mask_logits(x, top_k, top_p, temperature=T,
        min_p=min_p): the logits the draw saw, divided by T, the dropped tokens at -inf)
    output_counts[row, ids[row]] += 1                     (only when a penalty is set)
    offset += 1                                           (advance(), once per step)

vLLM's order: penalties, then temperature, then min-p / top-k / top-p (the sampler op's
``filter_apply_order="top_k_first"``), then the draw; a row whose temperature is below 1e-5
takes the argmax of its penalised logits. Every row of a run has the same parameters. Seeds:
with ``seed``, every row's seed is ``seed`` (vLLM gives every request of a seeded batch its own
generator seeded alike, so two equal prompts sample alike), without one each row draws its own
from the operating system; the draw of step ``s`` (the first token: ``s = 0``) is the sampler's
Philox stream at ``offset = s``, so a seeded run gives the same tokens eagerly, graphed, on the
CPU oracles and on the GPU kernels, whatever the batch's order or padding.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

import torch

__all__ = ["SamplingParams", "SamplerState"]

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature is greedy
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's sampling parameters for every sequence of a run.

    Attributes:
        temperature: logits are divided by it; ``< 1e-5`` is greedy (the argmax). ``>= 0``.
        top_k: keep the ``top_k`` largest logits (ties at the k-th kept); 0 or -1: all.
        top_p: keep the smallest prefix of the sorted probabilities whose mass reaches it,
            in ``(0, 1]``; 1: all.
        min_p: keep tokens whose probability is at least ``min_p`` times the largest, in
            ``[0, 1]``; 0: off.
        seed: the Philox seed of every row (``None``: a fresh seed per row from the OS).
        repetition_penalty: ``> 0``; tokens seen in the prompt or the output have positive
            logits divided by it and negative ones multiplied; 1: off.
        frequency_penalty: in ``[-2, 2]``; subtracted times the token's output count.
        presence_penalty: in ``[-2, 2]``; subtracted once from every token in the output.
        logprobs_mode: what the sampled token's logprob and rank are computed on (vLLM's
            engine option of that name, for the whole run): ``"raw_logprobs"`` the model's
            logits, ``"processed_logprobs"`` the logits after the penalties, temperature and
            filters (``loomnb.top_k_top_p_mask_logits``). The greedy loop's (no penalty) are
            the same in both.

    Raises ``ValueError`` naming the field for a value outside its range (vLLM's checks).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs_mode: str = "raw_logprobs"

    def __post_init__(self):
        def bad(name, want):
            raise ValueError(f"{name} must be {want}; got {getattr(self, name)!r}")

        if self.logprobs_mode not in LOGPROBS_MODES:
            bad("logprobs_mode", " or ".join(map(repr, LOGPROBS_MODES)))
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "logprobs_mode":
                continue
            if f.name in ("top_k", "seed"):
                if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                    bad(f.name, "an int" + (" or None" if f.name == "seed" else ""))
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(f.name, "a finite number")
        if self.temperature < 0:
            bad("temperature", ">= 0")
        if self.top_k < -1:
            bad("top_k", "-1, 0 (all tokens) or >= 1")
        if not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "> 0")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(name, "in [-2, 2]")
        if self.seed is not None and not 0 <= self.seed < 2 ** 63:
            bad("seed", "in [0, 2^63)")

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def is_greedy(self) -> bool:
        """The plain greedy loop: greedy temperature and no penalty (the filters then keep the
        argmax, so they change nothing)."""
        return self.temperature < SAMPLING_EPS and not self.penalized


class SamplerState:
    """The device state of a sampled decode of ``rows`` rows over ``vocab_size`` tokens.

    ``prompt_mask`` bool ``[rows, V]`` (the tokens of each row's prompt), ``output_counts``
    int32 ``[rows, V]`` (each token's count in the row's output so far), ``seeds`` int64
    ``[rows]``, ``offset`` int64 ``[1]`` (the step's Philox offset), on ``device``. Rows past
    the prompts given to :meth:`load` are padding (nothing seen, seed 0). :meth:`sample` reads
    them and, when a penalty is set (the counts serve nothing else), updates
    ``output_counts``; :meth:`advance` moves ``offset`` on. Both are device
    work only, so a CUDA graph of a decode step may hold them (save :meth:`mutable` around a
    warm-up)."""

    def __init__(self, params: SamplingParams, rows: int, vocab_size: int, device):
        self.params, self.rows, self.vocab_size = params, rows, vocab_size
        dev = torch.device(device)
        self.prompt_mask = torch.zeros(rows, vocab_size, dtype=torch.bool, device=dev)
        self.output_counts = torch.zeros(rows, vocab_size, dtype=torch.int32, device=dev)
        self.seeds = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.offset = torch.zeros(1, dtype=torch.int64, device=dev)
        p = params
        full = dict(dtype=torch.float32, device=dev)
        self._penalties = (torch.full((rows,), p.repetition_penalty, **full),
                           torch.full((rows,), p.frequency_penalty, **full),
                           torch.full((rows,), p.presence_penalty, **full))

    def load(self, prompt_token_ids: list[list[int]]) -> None:
        """Reset the state for these prompts (one row each, the rest padding): their prompt
        masks, zero counts, the seeds (``params.seed`` or fresh ones) and offset 0."""
        n = len(prompt_token_ids)
        if n > self.rows:
            raise ValueError(f"{n} prompts for a SamplerState of {self.rows} rows")
        self.prompt_mask.zero_()
        for i, ids in enumerate(prompt_token_ids):
            self.prompt_mask[i, torch.tensor(ids, dtype=torch.long)] = True
        self.output_counts.zero_()
        seed = self.params.seed
        seeds = ([seed] * n if seed is not None else
                 [int.from_bytes(os.urandom(8), "little") >> 1 for _ in range(n)])
        self.seeds.zero_()
        if n:
            self.seeds[:n] = torch.tensor(seeds, dtype=torch.int64)
        self.offset.zero_()

    def mutable(self):
        """The tensors :meth:`sample` and :meth:`advance` change."""
        return (self.output_counts, self.offset)

    def sample(self, ops, logits, rows: slice | None = None):
        """Sample one token for each row of ``logits`` ``[n, V]`` (model dtype; rows ``rows``
        of the state, default the first ``n``) through ``ops`` (a backend of
        :mod:`loomnb.models.backends`). Returns ``(token_ids int64 [n], logprob fp32 [n],
        rank int64 [n])``, the logprob and rank of the sampled token under the raw logits
        (``logprobs_mode`` "raw_logprobs") or the processed ones.
        With a penalty, mutates ``output_counts`` of those rows (the token counted); never
        ``logits``."""
        n = logits.shape[0]
        rows = slice(0, n) if rows is None else rows
        p = self.params
        x = logits
        if p.penalized:
            x = logits.to(torch.float32, copy=True)
            counts = self.output_counts[rows]
            rep, freq, pres = (t[rows] for t in self._penalties)
            ops.apply_penalties_(x, self.prompt_mask[rows], counts, rep, freq, pres)
        ids = ops.top_k_top_p_sampling_from_logits(x, p.top_k, p.top_p, p.temperature,
                                                   p.min_p, self.seeds[rows], self.offset)
        ids = ids.to(torch.long)
        if p.penalized:
            self.count(ids.view(-1, 1), rows)
        if p.logprobs_mode == "processed_logprobs":
            logits = ops.top_k_top_p_mask_logits(x, p.top_k, p.top_p, p.temperature, p.min_p)
        lp, rank = ops.selected_token_logprob_rank(logits, ids)
        return ids, lp, rank

    def advance(self) -> None:
        """The next step's draws: ``offset += 1``."""
        self.offset.add_(1)

    def target_logits(self, logits, probs):
        """The processed logits of a speculative pass (``logprobs_mode="processed_logprobs"``):
        fp32 ``logits / T`` where ``probs`` (:meth:`target_probs` of these ``logits``) is
        positive, ``-inf`` elsewhere; at a greedy temperature the logits themselves (vLLM's
        greedy rows). A fresh ``[n, V]``."""
        x = logits.float()
        if self.params.temperature < SAMPLING_EPS:
            return x
        return torch.where(probs > 0, x / self.params.temperature, -math.inf)

    def penalized_pass_logits(self, ops, logits, row_seq, pos_rows, pos_drafts, drafts):
        """The logits of a speculative pass penalised position by position (vLLM's rejection
        sampler): row ``r`` of ``logits`` ``[n, V]`` belongs to sequence ``row_seq[r]`` (int64
        ``[n]``) and is penalised with that sequence's prompt mask and output counts plus the
        drafts before its position, the pairs ``(pos_rows[i], drafts[pos_drafts[i]])`` (int64
        index tensors; ``drafts`` int32, a placeholder ``< 0`` counts nothing). Returns a
        fresh fp32 ``[n, V]``; mutates nothing. Device work only (capturable)."""
        x = logits.to(torch.float32, copy=True)
        counts = self.output_counts.index_select(0, row_seq)
        d = drafts.index_select(0, pos_drafts)
        counts.index_put_((pos_rows, d.clamp(min=0).long()), (d >= 0).to(torch.int32),
                          accumulate=True)
        rep, freq, pres = (t.index_select(0, row_seq) for t in self._penalties)
        ops.apply_penalties_(x, self.prompt_mask.index_select(0, row_seq), counts, rep, freq,
                             pres)
        return x

    def count(self, token_ids, rows: slice = slice(None)) -> None:
        """``output_counts[rows][s, t] += 1`` for every token ``t >= 0`` of row ``s`` of
        ``token_ids`` ``[n, m]`` (int32 or int64; ``< 0``: padding)."""
        self.output_counts[rows].scatter_add_(1, token_ids.clamp(min=0).long(),
                                              (token_ids >= 0).to(torch.int32))

    def target_probs(self, logits):
        """The target distribution speculative sampling verifies drafts against (vLLM's
        rejection sampler on sampled requests): fp32 ``softmax(logits / T)`` ``[n, V]``, min-p,
        top-k (the k-th largest probability and its ties) and top-p (the smallest most-likely
        prefix reaching ``top_p`` in descending order, the crossing token included; torch's
        sort and cumulative sum, as vLLM's torch path) zeroed, renormalised. Torch ops on the
        device (capturable); ``logits`` as given (penalised by the caller:
        :meth:`penalized_pass_logits`)."""
        p = self.params
        x = logits.float() / max(p.temperature, SAMPLING_EPS)
        probs = torch.softmax(x, dim=-1)
        if p.min_p > 0:
            probs = torch.where(probs >= probs.amax(-1, keepdim=True) * p.min_p, probs, 0.0)
        if 0 < p.top_k < probs.shape[-1]:
            kth = probs.topk(p.top_k, dim=-1).values[:, -1:]
            probs = torch.where(probs >= kth, probs, 0.0)
        if p.top_p < 1:
            srt, idx = probs.sort(dim=-1, descending=True)
            above = srt.cumsum(-1) - srt
            keep = torch.empty_like(srt, dtype=torch.bool).scatter_(
                -1, idx, above < p.top_p * srt.sum(-1, keepdim=True))
            probs = torch.where(keep, probs, 0.0)
        return probs / probs.sum(-1, keepdim=True)
