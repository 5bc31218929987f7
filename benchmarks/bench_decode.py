"""Time per output token (TPOT) of the SmolLM2 decode loop: loomnb vs the pure-torch loop,
eager and CUDA-graphed, at batch 1 and 8; each backend's graphed tokens must equal its eager
ones, and the two backends' tokens are compared (they may part at a near-tie of bf16 logits:
the torch loop's fp32 attention sums in another order).

The graphed step captures the whole decode step in one CUDA graph, including the bookkeeping
(slot_mapping from the block tables, positions += 1, the token history), so a replay is one
launch per output token and the host does nothing else. Eager runs the same step from Python.
Prefill is excluded. Run on a GPU:

    python3 benchmarks/bench_decode.py --steps 64 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from loomnb.models.llama import BLOCK_SIZE, load_model
from loomnb.models.paged_cache import compute_slot_mapping

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was",
           "The three laws of thermodynamics are", "In 1969, the Apollo 11 mission",
           "A good recipe for pancakes:", "Photosynthesis converts", "The quick brown fox"]


def prefill(runner, model, prompts, steps):
    """Prefill each prompt into its own blocks; return the static decode state."""
    dev = model.device
    token_ids = [model.tokenizer.encode(p) for p in prompts]
    max_blocks = -(-(max(map(len, token_ids)) + steps + 1) // BLOCK_SIZE)
    block_tables = torch.tensor([runner.kv_cache.allocator.allocate(max_blocks) for _ in token_ids],
                                dtype=torch.int32, device=dev)
    last = [runner.prefill(ids, block_tables[i:i + 1])[-1:] for i, ids in enumerate(token_ids)]
    ids = model.compute_logits(torch.cat(last)).float().argmax(-1)
    positions = torch.tensor([len(t) for t in token_ids], device=dev)
    return ids, positions, block_tables


def run(model, backend, batch, steps, graphed):
    runner = model.new_runner(backend, num_blocks=1024)
    with torch.inference_mode():
        ids, positions, block_tables = prefill(runner, model, PROMPTS[:batch], steps)
        seq_idx = torch.arange(batch, device=model.device)
        history = torch.zeros(batch, steps, dtype=torch.long, device=model.device)

        def step():
            slots = compute_slot_mapping(block_tables, seq_idx, positions, BLOCK_SIZE)
            nxt = runner.decode_step(ids, positions, slots, block_tables, (positions + 1).to(torch.int32))
            history.copy_(torch.roll(history, -1, dims=1))
            history[:, -1] = nxt
            ids.copy_(nxt)
            positions.add_(1)

        fn = step
        if graphed:
            state = [ids.clone(), positions.clone(), history.clone()]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()  # warm-up (compiles loomnb's kernels) outside the capture
            torch.cuda.current_stream().wait_stream(side)
            for t, s in zip((ids, positions, history), state):
                t.copy_(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            for t, s in zip((ids, positions, history), state):  # capture ran nothing; reset anyway
                t.copy_(s)
            fn = graph.replay
        else:
            state = [ids.clone(), positions.clone(), history.clone()]
            step()  # warm-up
            for t, s in zip((ids, positions, history), state):
                t.copy_(s)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        tpot = (time.perf_counter() - t0) / steps
    return tpot, history.cpu().tolist()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    model = load_model(device="cuda")
    rows = []
    for batch in map(int, args.batches.split(",")):
        tokens = {}
        for backend in ("loomnb-cuda", "torch"):
            for graphed in (False, True):
                tpot, toks = run(model, backend, batch, args.steps, graphed)
                tokens[(backend, graphed)] = toks
                rows.append({"batch": batch, "backend": backend, "graphed": graphed,
                             "tpot_ms": tpot * 1e3, "tokens_per_s": batch / tpot})
                print(f"batch {batch} {backend:16s} {'graph' if graphed else 'eager'}: "
                      f"TPOT {tpot * 1e3:.3f} ms ({batch / tpot:.0f} tok/s)")
        same = len({json.dumps(t) for t in tokens.values()}) == 1
        graph_eq = all(tokens[(b, True)] == tokens[(b, False)] for b in ("loomnb-cuda", "torch"))
        print(f"batch {batch}: graphed == eager for each backend: {graph_eq}; "
              f"identical across the four runs: {same}")
        for r in rows:
            if r["batch"] == batch:
                r["tokens_identical"] = same
                r["graph_equals_eager"] = graph_eq
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"decode_{time.strftime('%Y%m%d-%H%M%S')}_"
                        f"{torch.cuda.get_device_name().replace(' ', '-')}.json")
    with open(path, "w") as f:
        json.dump({"steps": args.steps, "model": "SmolLM2-135M-Instruct Q4_1 (bf16 weights)",
                   "torch": torch.__version__, "rows": rows}, f, indent=1)
    print("wrote", path)
    return 0 if all(r["graph_equals_eager"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
