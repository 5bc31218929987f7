"""``loomnb generate``'s run: torch's CPU threads, loading the model, the decode (plain,
speculative, or throughput at each ``--batch-sizes``) and the ``--check-reference`` rerun; what
it prints is :mod:`loomnb.models._cli_report`'s. torch is imported when :func:`generate` runs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ._cli_report import progress_bars, reference_verdict, report, report_logprobs
from ._cli_validate import UsageError, validate
from ._names import EXIT_OK, LOOMNB_OPS, TORCH_OPS


def cpu_threads(requested: int | None = None) -> tuple[int, str]:
    """torch's CPU thread count for the run, and why: ``requested`` (``--threads``), else
    ``$OMP_NUM_THREADS`` when it is a whole number >= 1, else the CPUs this process may run on
    (``os.sched_getaffinity``) less those that the 1-minute load average says other processes
    keep busy (rounded), at least 1. torch's default (one thread per core) collapses when
    another process is busy on one of them (its threads wait for each other at every op: on a
    2-core machine 41 tok/s idle, ~1 tok/s beside one CPU-bound process, ~20 tok/s there with
    one thread)."""
    if requested is not None:
        return requested, "--threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) >= 1:
        return int(env), "$OMP_NUM_THREADS"
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    busy = min(cpus - 1, int(load + 0.5))
    return max(1, cpus - busy), (f"{cpus} CPU(s) available, 1-minute load average {load:.1f}; "
                                 "--threads N to choose")


def generate(args) -> int:
    """``loomnb generate``: validate, load, decode, report (see :mod:`loomnb.models.cli`). On
    the CPU (or with ``--threads``) torch's thread count is :func:`cpu_threads`' for the run and
    restored after it."""
    plan = validate(args)
    import torch

    before = torch.get_num_threads()
    if plan.device == "cpu" or args.threads is not None:
        n, why = cpu_threads(args.threads)
        torch.set_num_threads(n)
        print(f"torch: {n} CPU thread{'s' if n > 1 else ''} ({why})", flush=True)
    try:
        return _run(args, plan)
    finally:
        torch.set_num_threads(before)


def _run(args, plan) -> int:
    from .gguf_loader import GGUFFormatError
    from .llama import load_model

    header, cfg = plan.header, plan.header.config
    print(f"loading {Path(plan.gguf).name} ({header.file_type} GGUF, {cfg.num_hidden_layers} "
          f"layers, hidden_size {cfg.hidden_size}, num_heads {cfg.num_heads}, num_kv_heads "
          f"{cfg.num_kv_heads}, context {cfg.max_position_embeddings} tokens) onto "
          f"{plan.device} in {args.dtype} from {plan.gguf}", flush=True)
    try:
        model = load_model(plan.gguf, device=plan.device, dtype=args.dtype)
    except GGUFFormatError as e:  # tensor data the header check could not see
        raise UsageError(str(e)) from None
    lens = ", ".join(str(len(p)) for p in plan.prompt_token_ids)
    chat = " (chat template)" if args.chat else ""
    m = args.max_new_tokens
    if args.speculative:
        then = (f"up to {m - 1} more token(s) each in target passes of the last token and up to "
                f"{plan.num_speculative_tokens} drafts")
    elif args.ignore_eos:
        then = f"{m - 1} decode step(s)"
    else:
        then = f"up to {m - 1} decode step(s) (each sequence until its end-of-text token)"
    reuse = "; prefix caching on" if args.prefix_caching else ""
    print(f"prefill {len(args.prompt)} prompt(s) of {lens} tokens{chat}{reuse}, then {then}; "
          f"memory-bound ops on {plan.backend}", flush=True)
    show = sys.stderr.isatty() if args.progress is None else args.progress
    if plan.sampling is not None:
        p = plan.sampling
        seed = ("greedy: the argmax of the penalised logits" if p.temperature < 1e-5 else
                "a fresh seed per prompt" if p.seed is None else f"seed {p.seed}")
        print(f"sampling: temperature {p.temperature:g}, top-k {p.top_k}, top-p {p.top_p:g}, "
              f"min-p {p.min_p:g}, repetition/frequency/presence penalties "
              f"{p.repetition_penalty:g}/{p.frequency_penalty:g}/{p.presence_penalty:g}, {seed}",
              flush=True)
    if args.speculative:
        return _speculative(model, args, plan, show)
    result = _generate_with_progress(model, args, plan.backend, show, "generate",
                                     cuda_graphs=plan.cuda_graphs,
                                     prefix_caching=args.prefix_caching, sampling=plan.sampling)
    report(result, "generate", m)
    if args.logprobs:
        report_logprobs(result, model.tokenizer)
    loomnb_ops = ", ".join(result.loomnb_ops) or "none"
    torch_ops = list(TORCH_OPS) + [op for op in LOOMNB_OPS if op not in result.loomnb_ops and not (
        result.sampling is not None and op == "greedy_sample_logprob")]  # sampled: not run
    print(f"loomnb ops: {loomnb_ops}; torch: {', '.join(torch_ops)}")
    if args.batch_sizes:
        _throughput(model, args, plan, show)
    what = "greedy tokens" if plan.sampling is None else f"sampled tokens (seed {plan.sampling.seed})"
    return _check_reference(model, args, result, show, what, plan.sampling)


def _speculative(model, args, plan, show) -> int:
    """``--speculative ngram``: prompt-lookup decoding (``loomnb.models.speculative``) on the
    chosen backend, CUDA-graphed on a GPU; with ``--check-reference`` the torch reference's
    plain greedy decoding must give the same tokens."""
    from .speculative import generate_speculative

    bars = progress_bars(show, "speculative")
    try:
        result = generate_speculative(model, args.prompt, args.max_new_tokens,
                                      backend=plan.backend, chat=args.chat,
                                      num_speculative_tokens=plan.num_speculative_tokens,
                                      cuda_graph=plan.cuda_graphs and plan.device == "cuda",
                                      num_top_logits=5 if args.check_reference else 0,
                                      progress=bars, ignore_eos=args.ignore_eos,
                                      logprobs=args.logprobs, sampling=plan.sampling)
    finally:
        if bars is not None:
            bars.close()
    report(result, f"generate (speculative {args.speculative})", args.max_new_tokens)
    print(result.summary())
    if args.logprobs:
        report_logprobs(result, model.tokenizer)
    return _check_reference(model, args, result, show,
                            "speculative tokens and torch-reference's greedy tokens")


def _check_reference(model, args, result, show, what: str, sampling=None) -> int:
    """``--check-reference`` (else ``EXIT_OK``): decode with the torch-reference backend (plain
    greedy, or the same seeded ``sampling``; the same stopping rule, no prefix caching, no CUDA
    graphs), report each divergence, and return 0
    if ``result``'s tokens are identical (or part only at near-ties, with
    ``--allow-near-ties``), else 1 (:func:`~loomnb.models._cli_report.reference_verdict`)."""
    if not args.check_reference:
        return EXIT_OK
    print("check-reference: decoding again with the torch-reference backend", flush=True)
    ref = _generate_with_progress(model, args, "torch-reference", show, "reference",
                                  sampling=sampling)
    report(ref, "reference", args.max_new_tokens)
    return reference_verdict(result, ref, what, args.allow_near_ties, args.dtype)


def _generate_with_progress(model, args, backend, show, label, cuda_graphs=False, prompts=None,
                            ignore_eos=None, prefix_caching=False, sampling=None):
    bars = progress_bars(show, label)
    try:
        return model.generate(args.prompt if prompts is None else prompts, args.max_new_tokens,
                              backend=backend, chat=args.chat,
                              num_top_logits=5 if args.check_reference else 0, progress=bars,
                              cuda_graphs=cuda_graphs, kv_cache_dtype=args.kv_cache_dtype,
                              ignore_eos=args.ignore_eos if ignore_eos is None else ignore_eos,
                              prefix_caching=prefix_caching, sampling=sampling)
    finally:
        if bars is not None:
            bars.close()


def _throughput(model, args, plan, show) -> None:
    """``--batch-sizes``: per batch size, the prompts repeated to fill it, one generate run on
    the chosen backend (graphs and KV-cache dtype as the main run; all ``--max-new-tokens``
    steps, end-of-text ignored, so every row measures the same work), and the kernel count of
    one eager decode step (:func:`loomnb.models.profiling.step_kernel_counts`). With
    ``--prefix-caching`` the repeated prompts share their cached blocks and a column gives the
    prefill tokens computed of all prompt tokens (prefill tok/s counts all prompt tokens)."""
    from .paged_cache import cdiv
    from .profiling import step_kernel_counts

    graphs = "CUDA graphs" if plan.cuda_graphs and plan.device == "cuda" else (
        "padded eager steps" if plan.cuda_graphs else "eager steps")
    reuse = ", prefix caching on" if args.prefix_caching else ""
    print(f"throughput: backend {plan.backend} on {plan.device}, {graphs}, KV cache "
          f"{args.kv_cache_dtype}{reuse}, {args.max_new_tokens} new tokens per sequence "
          f"(end-of-text ignored), prompts repeated to fill each batch", flush=True)
    rows, what = [], None
    for n in args.batch_sizes:
        prompts = (args.prompt * cdiv(n, len(args.prompt)))[:n]
        res = _generate_with_progress(model, args, plan.backend, show, f"batch {n}",
                                      cuda_graphs=plan.cuda_graphs, prompts=prompts,
                                      ignore_eos=True, prefix_caching=args.prefix_caching,
                                      sampling=plan.sampling)
        context = max(len(p) for p in res.prompt_token_ids) + args.max_new_tokens // 2
        runner = model.new_runner(plan.backend, num_blocks=n * cdiv(context, 16) + 1,
                                  kv_cache_dtype=args.kv_cache_dtype)
        counts = step_kernel_counts(runner, n, context)
        what = counts["what"]
        tpot = (f"{res.tpot_s * 1e3:.3f}" if args.max_new_tokens > 1 else "n/a")
        rate = f"{res.decode_tokens_per_s:.1f}" if args.max_new_tokens > 1 else "n/a"
        per_layer = "n/a" if counts["per_layer"] is None else counts["per_layer"]
        saved = ""
        if args.prefix_caching:
            total, cached = res.num_prefill_tokens, res.num_cached_prefill_tokens
            saved = (f" {total - cached} of {total} ({100 * cached / total:.0f}% from the "
                     f"prefix cache) |")
        rows.append(f"| {n} | {res.decode_batch or n} | {res.prefill_tokens_per_s:.1f} |{saved} "
                    f"{tpot} | {rate} | {counts['per_step']} | {per_layer} |")
    extra = (" prefill tokens computed |", "---|") if args.prefix_caching else ("", "")
    print(f"| batch | decode rows | prefill tok/s |{extra[0]} decode TPOT ms | decode tok/s | "
          f"per step | per layer |\n|---|---|---|{extra[1]}---|---|---|---|")
    print("\n".join(rows))
    print(f"(per step / per layer: {what}, one eager decode step at the run's context; "
          f"TPOT = decode time / (max-new-tokens - 1), graph capture excluded)")

