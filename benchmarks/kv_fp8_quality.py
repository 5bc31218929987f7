"""What an FP8 (E4M3) KV cache costs SmolLM2 in quality, and what it saves in memory.

The 8 reference prompts (``bench_decode.PROMPTS``) greedy-decoded ``--max-new-tokens`` tokens
(64) with the KV cache in the model dtype (``auto``: bf16) and in FP8 (``fp8``: E4M3 codes,
per-layer scales ``max|k| / 200`` and ``max|v| / 100`` from the first prefill, vLLM's
``calculate_kv_scales``), on one backend:

* greedy agreement: per sequence the first position where the two token streams differ;
  ``agreement`` = positions equal before the first divergence / all positions, and how many
  sequences are identical throughout;
* logprob drift: the FP8 run teacher-forced on the bf16 tokens (``forced_token_ids``), so
  both runs score the same prefix at every position; the absolute difference of the bf16
  token's log-probability, mean and max. The FP8 run's log-probability of that token is
  ``logit(token) - logsumexp``, with ``logsumexp = top logit - logprob(top)`` from its greedy
  sampler and the token's logit among its top ``--top-k`` logits (a token outside them is
  counted in ``outside_top_k`` and left out);
* KV memory per token, ``2 * num_layers * num_kv_heads * head_size * element_size`` bytes, and
  how many sequences of ``--seq-len`` (4,096) tokens fit in each ``--gib`` budget.

Writes ``kv_fp8_quality_<time>_<device>.json`` under ``--out`` and prints a markdown table.
Runs anywhere (the CPU through loomnb's oracles is slow but works):

    python3 benchmarks/kv_fp8_quality.py --out benchmarks/results                # GPU
    python3 benchmarks/kv_fp8_quality.py --device cpu --num-prompts 2 --max-new-tokens 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import PROMPTS  # noqa: E402

from loomnb.models.llama import load_model  # noqa: E402
from loomnb.models.paged_cache import kv_bytes_per_token  # noqa: E402

GIB = 2 ** 30


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token, ``len(a)`` if none."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def forced_logprobs(result, tokens: list[list[int]]):
    """Log-probability of ``tokens[s][i]`` under ``result`` (a teacher-forced run with
    ``top_logits`` and ``token_logprobs``), ``None`` where the token is not among its top
    logits: ``logit(token) - (top logit - logprob(top))``."""
    ids, vals = result.top_logits
    out = []
    for s, seq in enumerate(tokens):
        row = []
        for i, tok in enumerate(seq):
            top_ids = ids[s, i].tolist()
            lse = vals[s, i, 0].item() - result.token_logprobs[s][i]
            row.append(vals[s, i, top_ids.index(tok)].item() - lse if tok in top_ids else None)
        out.append(row)
    return out


def memory(config, elem_sizes: dict, gib: list[float], seq_len: int) -> dict:
    """Per mode: bytes per token and sequences of ``seq_len`` tokens per GiB budget."""
    out = {}
    for mode, esize in elem_sizes.items():
        per_tok = kv_bytes_per_token(config.num_hidden_layers, config.num_kv_heads,
                                     config.head_size, esize)
        out[mode] = {"bytes_per_token": per_tok, "element_size": esize,
                     "sequences_that_fit": {f"{g:g} GiB": int(g * GIB // (per_tok * seq_len))
                                            for g in gib}}
    return out


def evaluate(model, prompts, max_new_tokens, backend=None, top_k=20, gib=(1.0, 80.0),
             seq_len=4096) -> dict:
    """Run the three decodes and return the report (module docstring). Every decode runs all
    ``max_new_tokens`` steps (``ignore_eos``): the positions compared are the same for every
    prompt, and the teacher-forced run feeds the reference's full sequences."""
    ref = model.generate(prompts, max_new_tokens, backend=backend, kv_cache_dtype="auto",
                         ignore_eos=True)
    fp8 = model.generate(prompts, max_new_tokens, backend=backend, kv_cache_dtype="fp8",
                         ignore_eos=True)
    forced = model.generate(prompts, max_new_tokens, backend=backend, kv_cache_dtype="fp8",
                            forced_token_ids=ref.token_ids, num_top_logits=top_k)
    div = [first_divergence(a, b) for a, b in zip(ref.token_ids, fp8.token_ids)]
    lp8 = forced_logprobs(forced, ref.token_ids)
    diffs = [abs(a - b) for ra, rb in zip(ref.token_logprobs, lp8) for a, b in zip(ra, rb)
             if b is not None]
    n_pos = len(prompts) * max_new_tokens
    elem = {"auto": torch.tensor([], dtype=model.dtype).element_size(), "fp8": 1}
    return {
        "backend": ref.backend,
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "greedy": {
            "agreement": sum(div) / n_pos,
            "identical_sequences": sum(d == max_new_tokens for d in div),
            "first_divergence": div,
        },
        "logprob": {
            "mean_abs_diff": sum(diffs) / len(diffs) if diffs else math.nan,
            "max_abs_diff": max(diffs) if diffs else math.nan,
            "positions": len(diffs),
            "outside_top_k": n_pos - len(diffs),
            "top_k": top_k,
        },
        "kv_memory": memory(model.config, elem, list(gib), seq_len),
        "seq_len": seq_len,
        "sequences": [{"prompt": p, "auto": ref.texts[i], "fp8": fp8.texts[i],
                       "first_divergence": div[i]} for i, p in enumerate(prompts)],
    }


def markdown(report: dict) -> str:
    g, lp, mem = report["greedy"], report["logprob"], report["kv_memory"]
    budgets = list(mem["auto"]["sequences_that_fit"])
    head = ("| KV cache | bytes/token | " + " | ".join(f"{report['seq_len']}-token seqs in {b}"
                                                      for b in budgets)
            + " | greedy agreement | identical seqs | mean abs dlogprob | max abs dlogprob |")
    lines = [head, "|" + "---|" * (6 + len(budgets))]
    for mode in ("auto", "fp8"):
        m = mem[mode]
        fits = " | ".join(str(m["sequences_that_fit"][b]) for b in budgets)
        if mode == "auto":
            quality = "(reference) | | | "
        else:
            quality = (f"{g['agreement']:.3f} | {g['identical_sequences']}/"
                       f"{report['num_prompts']} | {lp['mean_abs_diff']:.4f} | "
                       f"{lp['max_abs_diff']:.4f}")
        lines.append(f"| {mode} | {m['bytes_per_token']} | {fits} | {quality} |")
    return "\n".join(lines)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--backend", default=None,
                   help="ops backend (default: loomnb-cuda on cuda, loomnb-cpu on cpu)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=len(PROMPTS),
                   help=f"the first N of the {len(PROMPTS)} reference prompts")
    p.add_argument("--top-k", type=int, default=20,
                   help="top logits kept per position to score the bf16 token under FP8")
    p.add_argument("--gib", default="1,80", help="memory budgets in GiB, comma-separated")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--out", default="benchmarks/results")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    model = load_model(device=args.device)
    dev = model.device
    t0 = time.perf_counter()
    report = evaluate(model, PROMPTS[:args.num_prompts], args.max_new_tokens, args.backend,
                      args.top_k, [float(g) for g in args.gib.split(",")], args.seq_len)
    name = (torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu").replace(" ", "-")
    report.update({"model": "SmolLM2-135M-Instruct Q4_1 (bf16 weights)", "device": name,
                   "torch": torch.__version__, "time_s": time.perf_counter() - t0,
                   "date": time.strftime("%Y-%m-%d %H:%M:%S")})
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"kv_fp8_quality_{time.strftime('%Y%m%d-%H%M%S')}_{name}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(markdown(report))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
