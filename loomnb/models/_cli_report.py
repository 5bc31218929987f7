"""What ``loomnb generate`` prints: progress bars, each run's continuations and rates, the
tokens' logprobs, and ``--check-reference``'s verdict."""

from __future__ import annotations

import sys

from ._names import EXIT_CHECK_FAILED, EXIT_OK


class _Progress:
    """``progress(stage, done, total)`` for ``LlamaModel.generate``: one tqdm bar per stage on
    stderr (prefill: one unit per layer of each prompt; decode: one unit per step)."""

    UNITS = {"prefill": "layer", "decode": "step"}

    def __init__(self, label: str):
        self.label, self.stage, self.bar = label, None, None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage != self.stage:
            self.close()
            from tqdm import tqdm

            self.stage = stage
            self.bar = tqdm(total=total, desc=f"{self.label} {stage}", unit=self.UNITS[stage],
                            file=sys.stderr, leave=False, dynamic_ncols=True)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.stage, self.bar = None, None


def progress_bars(enabled: bool, label: str):
    """``progress`` for a run labelled ``label``: tqdm bars when ``enabled`` and tqdm is
    installed, else None (no bars)."""
    if not enabled:
        return None
    try:
        import tqdm  # noqa: F401
    except ImportError:  # the model extra installs it; without it, no bars
        return None
    return _Progress(label)


def report(result, header: str, max_new_tokens: int) -> None:
    """A run's continuations, then its prefill and decode rates (and how the decode ran)."""
    print(f"== {header}: backend {result.backend}")
    for i, (prompt, text) in enumerate(zip(result.prompts, result.texts)):
        print(f"[{i}] {prompt!r} -> {text!r}")
    ended = ""
    steps = result.num_decode_steps
    if steps is not None and steps < max_new_tokens - 1:
        ended = (f"; every sequence ended at end-of-text after {steps} of {max_new_tokens - 1} "
                 "decode steps")
    reuse = ""
    if getattr(result, "prefix_caching", False):
        cached = result.num_cached_prefill_tokens
        reuse = (f" ({result.num_prefill_tokens - cached} computed, {cached} from the prefix "
                 f"cache)")
    print(f"prefill: {result.num_prefill_tokens} tokens{reuse} in {result.prefill_time_s:.3f} s "
          f"({result.prefill_tokens_per_s:.1f} tok/s); decode: {result.num_decode_tokens} tokens "
          f"in {result.decode_time_s:.3f} s ({result.decode_tokens_per_s:.1f} tok/s){ended}"
          + _decode_mode(result))


def _decode_mode(result) -> str:
    """How the decode ran, when it was not the plain eager loop on a bf16/fp32 cache."""
    parts = []
    if result.cuda_graphs:
        kind = "CUDA graph" if result.graph_capture_time_s else "padded eager steps"
        parts.append(f"{kind}, {result.decode_batch} rows")
        if result.graph_capture_time_s:
            parts.append(f"capture {result.graph_capture_time_s:.3f} s not included")
    if result.kv_cache_dtype != "auto":
        parts.append(f"KV cache {result.kv_cache_dtype}")
    return f" [{'; '.join(parts)}]" if parts else ""


def report_logprobs(result, tokenizer) -> None:
    """Each generated token with its log-probability (fp32 log-softmax of the raw logits) and
    rank (1-based; ties count against the token: vLLM's V1 sampler), as the backend's greedy
    sampler computed them in the same pass as the argmax."""
    for i, (ids, lps, ranks) in enumerate(zip(result.token_ids, result.token_logprobs,
                                              result.token_ranks)):
        cells = [f"{tokenizer.decode([t])!r} {lp:.4f} #{rk}" for t, lp, rk in zip(ids, lps, ranks)]
        print(f"[{i}] logprobs: " + ", ".join(cells))


def reference_verdict(result, ref, what: str, allow_near_ties: bool, dtype: str) -> int:
    """``--check-reference``'s verdict: each divergence of ``result`` from the torch reference's
    ``ref`` (with both paths' top logits there), then one ``check-reference: OK|FAILED`` line;
    returns ``EXIT_OK`` if the tokens are identical (or part only at near-ties, with
    ``allow_near_ties``), else ``EXIT_CHECK_FAILED``. ``dtype``: the model's (``--dtype``)."""
    from .llama import compare_greedy, top_logits_at

    verdicts = compare_greedy(result, ref)
    for i, (verdict, step) in enumerate(verdicts):
        if verdict != "identical":
            a, b = result.token_ids[i], ref.token_ids[i]
            print(f"[{i}] {verdict} at new token {step}: {result.backend} {a[step:step + 3]} "
                  f"vs torch-reference {b[step:step + 3]}; logits there: {result.backend} "
                  f"{top_logits_at(result, i, step)}, torch-reference "
                  f"{top_logits_at(ref, i, step)}")
    n_same = sum(v == "identical" for v, _ in verdicts)
    n_tie = sum(v == "near-tie" for v, _ in verdicts)
    ok = n_same == len(verdicts) or (allow_near_ties and n_same + n_tie == len(verdicts))
    longest = max(len(t) for t in result.token_ids)
    print(f"check-reference: {'OK' if ok else 'FAILED'}: {what} identical for {n_same}/"
          f"{len(verdicts)} prompts x {longest} tokens ({result.backend} vs torch-reference); "
          f"{n_tie} diverge at a near-tie (<= 2 {dtype} ulps of the top logit)")
    return EXIT_OK if ok else EXIT_CHECK_FAILED

