"""KV-cache movement benchmark: loomnb's ``copy_blocks``, ``swap_blocks``, ``gather_cache``,
``concat_and_cache_mla`` and ``compact_blocks`` against vLLM 0.24's compiled cache ops (where
vLLM has the op) and the torch code engines write, in one process, both provider orders.

    python3 benchmarks/bench_kv_blocks.py --vllm-lib /path/to/_C_stable_libtorch.abi3.so
    python3 benchmarks/bench_kv_blocks.py                # without vLLM: loomnb and torch only
    python3 benchmarks/bench_kv_blocks.py --quick        # smoke: a dozen cases, 5 repeats
    python3 benchmarks/bench_kv_blocks.py --dry-run      # no GPU: fake timings, real plumbing
    python3 benchmarks/bench_kv_blocks.py --ops swap_blocks --size 64,512 --block-kb 16

Cases (blocks are vLLM's interleaved ``[num_blocks, 2, 16, num_kv_heads, head_size]`` bf16
layout; a 64 KB block is 16 tokens x 8 heads x 128 K+V, a 16 KB block 16 x 4 x 64 K+V):

* ``copy_blocks``: a fork's copy-on-write, 16 / 256 / 2048 distinct ``(src, dst)`` pairs of a
  pool of at least 512 blocks, 1 and 32 layers. loomnb gets the whole per-layer buffers as one
  list (one launch for all layers); torch does ``kv[dst] = kv[src]`` per layer (as vLLM 0.24
  forks blocks); vLLM's ``copy_blocks_mla`` on the same list where the library still has it.
* ``swap_blocks``: 16 / 256 / 2048 blocks of 64 KB and of 16 KB, GPU -> pinned host (``d2h``:
  random GPU blocks to consecutive host blocks) and host -> GPU (``h2d``: the reverse). loomnb
  with the mapping on the GPU (one kernel, graph-capturable) and ``loomnb_host_map`` with the
  CPU mapping vLLM takes (an upload a call: timed eagerly only); vLLM's
  ``swap_blocks(src, dst, block_size_in_bytes, block_mapping)`` (a ``cudaMemcpyAsync`` per
  block); torch as an engine stages it: ``index_select`` into a GPU buffer and one
  ``copy_(non_blocking=True)`` to the pinned pool (``h2d``: one copy, then ``index_copy_``).
* ``pcie_copy``: the copy floor of each ``swap_blocks`` case, measured in the same run: one
  ``pinned.copy_(gpu, non_blocking=True)`` (or the reverse) of the same total bytes.
* ``gather_cache``: K pages of 2,048 blocks (32,768 tokens of 8 x 128, the K half of the
  interleaved cache), and MLA's latent cache ``[num_blocks, 16, 576]`` at 1k / 8k / 32k tokens,
  bf16 and FP8 E4M3 -> bf16 (scale 0.05); sequences of up to 2,048 tokens over a shuffled
  block table. vLLM's ``cp_gather_cache`` (bf16) and ``gather_and_maybe_dequant_cache`` (FP8);
  torch's ``index_select`` of the page rows (slots precomputed; FP8: then ``* scale``).
* ``concat_and_cache_mla``: kv_lora_rank 512 + pe_dim 64 at 1 / 8 / 64 / 512 / 4096 tokens, bf16
  and FP8 caches, random distinct slots; vLLM's op and torch's ``kv_cache.view(-1, 576)[slots]
  = torch.cat([kv_c, k_pe], -1)`` (FP8: ``(x / scale).clamp(+-448).to(e4m3)``).
* ``compact_blocks``: a random permutation of 2,048 and 16,384 blocks (one layer) and of 1,024
  blocks in 32 layers, in place; torch does ``kv.copy_(kv[perm])`` per layer, which needs a
  temporary the size of a layer's pool (``torch_temporary_bytes`` in each row). vLLM has no
  such op. loomnb uploads the permutation's tables every call (not capturable), so this op is
  timed eagerly for every provider: its rows' ``graph_us`` is the eager loop's per-call time
  (``graph_us_from: "eager"``, ``graph_n`` null, the reason in ``timer``), as is
  ``loomnb_host_map``'s.

Bytes model (GB/s and % of the copy rate measured in the same run come from it):
``copy_blocks`` ``2 * pairs * block_bytes * layers + 16 * pairs``; ``swap_blocks`` ``2 *
blocks * block_bytes + 16 * blocks``; ``pcie_copy`` ``2 * blocks * block_bytes`` (the bus
carries half of it: ``meta.pcie`` has that rate); ``gather_cache`` ``tokens * entries *
(cache element + 2)``; ``concat_and_cache_mla`` ``tokens * 576 * (2 + cache element) + 8 *
tokens``; ``compact_blocks`` ``2 * moved blocks * block_bytes * layers``.

Exactness: each provider's output (the forked blocks, the destination pool, the gathered rows,
the whole MLA cache, the permuted pools) is compared byte for byte with the reference's on the
same fresh inputs -- vLLM's where it has the op, else the torch composite's (logged). After the
sweep the targets below are evaluated on the medians of both passes and stored in
``meta.targets`` (printed): ``copy_blocks`` >= 3x torch and >= 80% of the copy rate at 2,048
pairs, >= 1.0x torch at 16; ``swap_blocks`` >= 90% of the PCIe copy floor (256 blocks and up,
both block sizes and directions); ``gather_cache`` >= 1.2x vLLM; ``concat_and_cache_mla`` >=
1.0x vLLM and byte-identical to it. The default sweep takes about 2-3 GPU minutes.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
import torch  # noqa: E402

BLOCK_SIZE = 16
GEOMETRY = {64: (8, 128), 16: (4, 64)}     # block KB -> (num_kv_heads, head_size), K+V bf16
BF16 = 2
MLA_LORA, MLA_PE = 512, 64
MLA_ENTRIES = MLA_LORA + MLA_PE
SEQ_TOKENS = 2048        # gather: sequences of at most this many tokens
SCALE = 0.05             # FP8 scale: stored = real / 0.05
FP8_MAX = 448.0
MIN_POOL = 512           # copy/swap: the GPU pool has at least this many blocks
PERM_SEED = 1234         # compact: the permutation depends on the case only (bytes model exact)


def block_bytes(kb=64):
    hk, d = GEOMETRY[kb]
    return 2 * BLOCK_SIZE * hk * d * BF16


# the default and --quick plans
COPY = [(layers, pairs) for layers in (1, 32) for pairs in (16, 256, 2048)]
COPY_QUICK = [(1, 16), (1, 2048)]
SWAP = [(direction, kb, n) for direction in ("d2h", "h2d") for kb in (64, 16)
        for n in (16, 256, 2048)]
SWAP_QUICK = [("d2h", 64, 2048), ("h2d", 64, 2048), ("d2h", 16, 2048)]
GATHER = [("k_pages", "bf16", 2048 * BLOCK_SIZE)] + [("mla", kv, T) for kv in ("bf16", "fp8")
                                                    for T in (1024, 8192, 32768)]
GATHER_QUICK = [("k_pages", "bf16", 2048 * BLOCK_SIZE), ("mla", "bf16", 8192), ("mla", "fp8", 8192)]
MLA = [(kv, T) for kv in ("bf16", "fp8") for T in (1, 8, 64, 512, 4096)]
MLA_QUICK = [("bf16", 1), ("bf16", 4096), ("fp8", 64)]
COMPACT = [(1, 2048), (1, 16384), (32, 1024)]
COMPACT_QUICK = [(1, 2048)]

OPS = {
    "copy_blocks": H.Op("copy_blocks", ("caches", "block_mapping"), ("dst_blocks",),
                        vllm_name="copy_blocks_mla"),
    "swap_blocks": H.Op("swap_blocks", ("src", "block_mapping"), ("dst",)),
    "pcie_copy": H.Op("pcie_copy", ("src",), ("dst",), vllm_name=None),
    "gather_cache": H.Op("gather_cache", ("src_cache", "block_table", "cu_seq_lens"), ("dst",),
                         vllm_name="cp_gather_cache"),
    "concat_and_cache_mla": H.Op("concat_and_cache_mla", ("kv_c", "k_pe", "slot_mapping"),
                                 ("kv_cache",)),
    "compact_blocks": H.Op("compact_blocks", ("caches", "permutation"), ("caches",),
                           vllm_name=None),
}


def cdiv(a, b):
    return -(-a // b)


def permutation(num_blocks):
    """The compaction's permutation of a case (``new[i] = old[perm[i]]``), fixed per size."""
    return np.random.default_rng(PERM_SEED + num_blocks).permutation(num_blocks).astype(np.int64)


def moved_blocks(num_blocks):
    perm = permutation(num_blocks)
    return int((perm != np.arange(num_blocks)).sum())


def op_bytes(case):
    """The bytes model of one call (module docstring)."""
    op = case["op"]
    if op == "copy_blocks":
        return 2 * case["pairs"] * block_bytes() * case["layers"] + 16 * case["pairs"]
    if op == "swap_blocks":
        return 2 * case["blocks"] * block_bytes(case["block_kb"]) + 16 * case["blocks"]
    if op == "pcie_copy":
        return 2 * case["blocks"] * block_bytes(case["block_kb"])
    if op == "gather_cache":
        entries = GEOMETRY[64][0] * GEOMETRY[64][1] if case["source"] == "k_pages" else MLA_ENTRIES
        return case["num_tokens"] * entries * ((1 if case["kv"] == "fp8" else BF16) + BF16)
    if op == "concat_and_cache_mla":
        c = 1 if case["kv"] == "fp8" else BF16
        return case["num_tokens"] * (MLA_ENTRIES * (BF16 + c) + 8)
    if op == "compact_blocks":
        return 2 * moved_blocks(case["blocks"]) * block_bytes() * case["layers"]
    raise KeyError(op)


# ---------------------------------------------------------------- inputs
def _randn(shape, g, device):
    return torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)


def _fp8_codes(x, scale=SCALE):
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _pinned(like, device):
    """A pinned host copy of ``like`` (plain host memory on a CPU-only run)."""
    host = torch.empty(like.shape, dtype=like.dtype, pin_memory=torch.device(device).type == "cuda")
    host.copy_(like)
    return host


def make_inputs(case, device, seed):
    """Fresh tensors of one call of ``case`` by role name (every provider's, same seed: same
    values)."""
    g = torch.Generator(device=device).manual_seed(seed)
    op = case["op"]
    if op == "copy_blocks":
        pairs, hk, d = case["pairs"], *GEOMETRY[64]
        nb = max(2 * pairs, MIN_POOL)
        caches = [_randn((nb, 2, BLOCK_SIZE, hk, d), g, device) for _ in range(case["layers"])]
        perm = torch.randperm(nb, generator=g, device=device)[:2 * pairs]
        src, dst = perm[:pairs].contiguous(), perm[pairs:].contiguous()
        return {"caches": caches, "kv_caches": caches, "src_idx": src, "dst_idx": dst,
                "block_mapping": torch.stack([src, dst], 1).contiguous()}
    if op in ("swap_blocks", "pcie_copy"):
        n, kb = case["blocks"], case["block_kb"]
        hk, d = GEOMETRY[kb]
        gpu = _randn((max(2 * n, MIN_POOL), 2, BLOCK_SIZE, hk, d), g, device)
        host = _pinned(_randn((n, 2, BLOCK_SIZE, hk, d), g, device), device)
        gpu_idx = torch.randperm(gpu.shape[0], generator=g, device=device)[:n].contiguous()
        host_idx = torch.arange(n, device=device)
        if case["direction"] == "d2h":
            src, dst, pairs = gpu, host, (gpu_idx, host_idx)
        else:
            src, dst, pairs = host, gpu, (host_idx, gpu_idx)
        mapping = torch.stack(pairs, 1).contiguous()
        return {"src": src, "dst": dst, "block_mapping": mapping,
                "block_mapping_cpu": mapping.cpu(), "block_size_in_bytes": block_bytes(kb),
                "gpu_idx": gpu_idx, "host": host,
                "staging": torch.zeros((n, 2, BLOCK_SIZE, hk, d), dtype=torch.bfloat16,
                                       device=device)}
    if op == "gather_cache":
        T, fp8 = case["num_tokens"], case["kv"] == "fp8"
        S = case["num_seqs"]
        L = T // S
        bps = cdiv(L, BLOCK_SIZE)
        nb = S * bps + 16
        if case["source"] == "k_pages":
            hk, d = GEOMETRY[64]
            kv = _randn((nb, 2, BLOCK_SIZE, hk, d), g, device)
            cache, flat, entries = kv[:, 0], kv.view(-1, hk, d), (hk, d)
            rows_per_block = 2 * BLOCK_SIZE  # K rows of block b: flat rows 32 b .. 32 b + 15
        else:
            lat = _randn((nb, BLOCK_SIZE, MLA_ENTRIES), g, device)
            cache = _fp8_codes(lat) if fp8 else lat
            flat, entries, rows_per_block = cache.view(-1, MLA_ENTRIES), (MLA_ENTRIES,), BLOCK_SIZE
        bt = torch.randperm(nb, generator=g, device=device)[:S * bps].view(S, bps)
        pos = torch.arange(L, device=device)
        rows = (bt[:, pos // BLOCK_SIZE] * rows_per_block + pos % BLOCK_SIZE).reshape(-1)
        return {"src_cache": cache, "flat": flat, "rows": rows.contiguous(),
                "dst": torch.zeros((T, *entries), dtype=torch.bfloat16, device=device),
                "block_table": bt.to(torch.int32).contiguous(),
                "cu_seq_lens": (torch.arange(S + 1, device=device) * L).to(torch.int32),
                "token_to_seq": torch.arange(S, device=device,
                                             dtype=torch.int32).repeat_interleave(L),
                "batch_size": S, "num_tokens": T, "seq_starts": None,
                "kv_cache_dtype": "fp8" if fp8 else "auto",
                "scale": torch.full((1,), SCALE, dtype=torch.float32, device=device)}
    if op == "concat_and_cache_mla":
        T, fp8 = case["num_tokens"], case["kv"] == "fp8"
        nb = cdiv(2 * T, BLOCK_SIZE) + 4
        kv_a = _randn((T, MLA_ENTRIES), g, device)   # k_pe: a slice of the projection's output
        kv_c = _randn((T, MLA_LORA), g, device)
        slots = torch.randperm(nb * BLOCK_SIZE, generator=g, device=device)[:T].contiguous()
        return {"kv_c": kv_c, "k_pe": kv_a[:, MLA_LORA:], "slot_mapping": slots,
                "kv_cache": torch.zeros((nb, BLOCK_SIZE, MLA_ENTRIES), device=device,
                                        dtype=torch.uint8 if fp8 else torch.bfloat16),
                "kv_cache_dtype": "fp8" if fp8 else "auto",
                "scale": torch.full((1,), SCALE, dtype=torch.float32, device=device)}
    if op == "compact_blocks":
        nb, hk, d = case["blocks"], *GEOMETRY[64]
        caches = [_randn((nb, 2, BLOCK_SIZE, hk, d), g, device) for _ in range(case["layers"])]
        perm = permutation(nb)
        return {"caches": caches, "permutation": torch.from_numpy(perm),
                "perm_gpu": torch.from_numpy(perm).to(device)}
    raise KeyError(op)


def collect(op, t):
    """The outputs compared for exactness, by role name."""
    if op == "copy_blocks":
        return lambda _: {"dst_blocks": torch.stack([c[t["dst_idx"]] for c in t["caches"]])}
    if op == "compact_blocks":
        return lambda _: {"caches": torch.stack(t["caches"])}
    if op == "pcie_copy":
        return lambda _: {"dst": t["host"] if t["dst"] is t["host"] else t["staging"]}
    key = OPS[op].writes[0]
    return lambda _: {key: t[key]}


# ---------------------------------------------------------------- torch composites
def t_copy_blocks(t):
    caches, src, dst = t["caches"], t["src_idx"], t["dst_idx"]

    def call():
        for kv in caches:
            kv[dst] = kv[src]
    return call


def t_swap_blocks(t, case):
    src, dst, staging, idx = t["src"], t["dst"], t["staging"], t["gpu_idx"]
    if case["direction"] == "d2h":
        def call():
            torch.index_select(src, 0, idx, out=staging)
            dst.copy_(staging, non_blocking=True)
    else:
        def call():
            staging.copy_(src, non_blocking=True)
            dst.index_copy_(0, idx, staging)
    return call


def t_pcie_copy(t, case):
    host, staging = t["host"], t["staging"]
    if case["direction"] == "d2h":
        return partial(host.copy_, staging, non_blocking=True)
    return partial(staging.copy_, host, non_blocking=True)


def t_gather_cache(t):
    flat, rows, dst, scale = t["flat"], t["rows"], t["dst"], t["scale"]
    if t["kv_cache_dtype"] == "auto":
        return partial(torch.index_select, flat, 0, rows, out=dst)

    def call():
        dst.copy_(torch.index_select(flat, 0, rows).view(torch.float8_e4m3fn).float() * scale)
    return call


def t_concat_and_cache_mla(t):
    kv_c, k_pe, slots, scale = t["kv_c"], t["k_pe"], t["slot_mapping"], t["scale"]
    flat = t["kv_cache"].view(-1, MLA_ENTRIES)
    fp8 = t["kv_cache_dtype"] != "auto"

    def call():
        rows = torch.cat([kv_c, k_pe], -1)
        flat[slots] = _fp8_codes(rows, scale) if fp8 else rows
    return call


def t_compact_blocks(t):
    caches, perm = t["caches"], t["perm_gpu"]

    def call():
        for kv in caches:
            kv.copy_(kv[perm])
    return call


def torch_call(op, t, case):
    return {"copy_blocks": lambda: t_copy_blocks(t), "swap_blocks": lambda: t_swap_blocks(t, case),
            "pcie_copy": lambda: t_pcie_copy(t, case), "gather_cache": lambda: t_gather_cache(t),
            "concat_and_cache_mla": lambda: t_concat_and_cache_mla(t),
            "compact_blocks": lambda: t_compact_blocks(t)}[op]()


# ---------------------------------------------------------------- providers
class Loomnb(H.LoomnbProvider):
    """loomnb's ops: ``copy_blocks(caches, [], mapping)`` (one list, one launch), ``swap_blocks``
    with the mapping on the GPU, ``gather_cache``, ``concat_and_cache_mla``, ``compact_blocks``
    (the permutation a CPU tensor)."""

    def unsupported(self, case):
        if case["op"] == "pcie_copy":
            return "pcie_copy is swap_blocks' copy floor: torch's copy_ only"

    def bind(self, op, t, case):
        m, name = self.m, op.name
        if name == "copy_blocks":
            call = partial(m.copy_blocks, t["caches"], [], t["block_mapping"])
        elif name == "swap_blocks":
            call = partial(m.swap_blocks, t["src"], t["dst"], t["block_size_in_bytes"],
                           self.mapping(t))
        elif name == "gather_cache":
            fp8 = t["kv_cache_dtype"] != "auto"
            call = partial(m.gather_cache, t["src_cache"], t["dst"], t["block_table"],
                           t["cu_seq_lens"], t["kv_cache_dtype"], t["scale"] if fp8 else None)
        elif name == "concat_and_cache_mla":
            call = partial(m.concat_and_cache_mla, t["kv_c"], t["k_pe"], t["kv_cache"],
                           t["slot_mapping"], t["kv_cache_dtype"], t["scale"])
        elif name == "compact_blocks":
            call = partial(m.compact_blocks, t["caches"], t["permutation"])
        else:
            raise H.NotAvailable(f"loomnb has no {name}")
        return call, collect(name, t)

    def mapping(self, t):
        return t["block_mapping"]


class LoomnbHostMap(Loomnb):
    """loomnb.swap_blocks with the CPU block_mapping vLLM takes (uploaded and synchronised each
    call, so not capturable: timed eagerly only)."""
    name = "loomnb_host_map"
    eager_only = "the CPU block_mapping is uploaded and synchronised every call"

    def unsupported(self, case):
        if case["op"] != "swap_blocks":
            return "the CPU-mapping variant of swap_blocks only"

    def mapping(self, t):
        return t["block_mapping_cpu"]


class Torch(H.Provider):
    """The torch code engines write (module docstring): per-layer indexing for copy and
    compaction, index_select + one non-blocking copy for swaps, index_select of the page rows for
    gathers, cat + index_put for the MLA write."""
    name = "torch"

    def bind(self, op, t, case):
        return torch_call(op.name, t, case), collect(op.name, t)


class Vllm(H.Provider):
    """vLLM 0.24's compiled cache ops from $LOOMNB_VLLM_LIB / --vllm-lib, loaded without
    importing vllm, looked up in ``torch.ops._C_cache_ops`` then ``torch.ops._C`` and bound by
    their schemas' argument names (printed): ``copy_blocks_mla`` (where the library still has
    it), ``swap_blocks`` (CPU mapping), ``cp_gather_cache`` / ``gather_and_maybe_dequant_cache``,
    ``concat_and_cache_mla``. For an op it lacks, its rows are n/a and, as the exactness
    reference, the torch composite stands in (logged)."""
    name = "vllm"
    namespaces = ("_C_cache_ops", "_C")
    NAMES = ("copy_blocks_mla", "swap_blocks", "cp_gather_cache", "gather_and_maybe_dequant_cache",
             "concat_and_cache_mla")
    REQUIRED = {"copy_blocks_mla": ("kv_caches", "block_mapping"),
                "swap_blocks": ("src", "dst", "block_mapping"),
                "cp_gather_cache": ("src_cache", "dst", "block_table", "cu_seq_lens"),
                "gather_and_maybe_dequant_cache": ("src_cache", "dst", "block_table", "cu_seq_lens",
                                                   "scale"),
                "concat_and_cache_mla": ("kv_c", "k_pe", "kv_cache", "slot_mapping", "scale")}

    def setup(self, args, log):
        path, err = H.load_vllm_library(args)
        if err:
            return err
        self.packets, self.schemas, self.bindings, self.log = {}, {}, {}, log
        self.fallbacks_logged = set()
        for name in self.NAMES:
            for ns in self.namespaces:
                try:
                    packet = getattr(getattr(torch.ops, ns), name)
                    self.schemas[name] = str(packet.default._schema)
                    self.packets[name] = packet
                    break
                except (AttributeError, RuntimeError):
                    continue
            else:
                where = ", ".join(f"torch.ops.{ns}" for ns in self.namespaces)
                self.schemas[name] = f"MISSING {name} (looked in {where})"
            log(f"[vllm] schema {self.schemas[name]}")
        if not self.packets:
            return ("no --vllm-lib given and LOOMNB_VLLM_LIB is unset" if not path
                    else f"{path} registers none of {', '.join(self.NAMES)}")
        self.lib = str(Path(path).resolve()) if path else "ops already registered in this process"

    @staticmethod
    def vllm_name(case):
        op = case["op"]
        if op == "gather_cache":
            return "gather_and_maybe_dequant_cache" if case["kv"] == "fp8" else "cp_gather_cache"
        return OPS[op].vllm

    def unsupported(self, case):
        name = self.vllm_name(case)
        if name is None:
            return f"vLLM has no {case['op']}"
        if hasattr(self, "packets") and name not in self.packets:  # (set up: the library lacks it)
            return f"this vLLM library has no {name}"

    def bind(self, op, t, case):
        reason = self.unsupported(case)
        if reason:  # only the exactness reference gets here: the torch composite stands in
            if op.name not in self.fallbacks_logged:
                self.fallbacks_logged.add(op.name)
                self.log(f"[exact] {op.name}: {reason}; the torch composite is its reference")
            return Torch.bind(self, op, t, case)
        name = self.vllm_name(case)
        packet = self.packets[name]
        vals = dict(t)
        if name == "swap_blocks":
            vals["block_mapping"] = t["block_mapping_cpu"]
        args, kwargs, desc = H.bind_schema(packet.default._schema, vals, self.REQUIRED[name], {})
        if name not in self.bindings:
            self.log(f"[vllm] {name}({desc})")
            self.bindings[name] = desc
        return partial(packet, *args, **kwargs), collect(op.name, t)


PROVIDERS = {p.name: p for p in (Loomnb, LoomnbHostMap, Vllm, Torch)}


def eager_only(prov, case):
    """Why this provider's calls of this case cannot be graph-captured (None: they can)."""
    if case["op"] == "compact_blocks":
        return ("loomnb's compaction uploads the permutation's tables every call; every provider "
                "is timed eagerly for a like-for-like comparison")
    return getattr(prov, "eager_only", None)


def _time_eagerly(calls, nbytes, args, why):
    est = H.time_eager(calls, len(calls), repeats=1, warmup=1, device=args.device)["us"]
    n = int(min(max(args.target_ms * 1e3 / max(est, 1e-3), 3), 256))
    e = H.time_eager(calls, n, repeats=args.repeats, device=args.device)
    return {"l2_sets": len(calls), "graph_us": e["us"], "graph_us_min": e["us_min"],
            "graph_n": None, "graph_us_from": "eager", "eager_us": e["us"],
            "host_us": e["host_us"], "eager_n": e["n"],
            "timer": f"eager only ({why}): graph_us is the eager loop's time",
            "GBps": nbytes / (e["us"] * 1e-6) / 1e9}


def _case_timing(orig, family, args, prov, case, pass_i):
    """The harness's timing of a case, but eager-only where the calls cannot be captured (and
    eager after a failed capture, with the reason in ``graph_error``)."""
    if family is not FAMILY:
        return orig(family, args, prov, case, pass_i)
    op = family.ops[case["op"]]
    prov.fresh()

    def make_call(i):
        t = family.make_inputs(op, case, args.device, args.seed + 1000 + i)
        return prov.bind(op, t, case)[0]

    why = eager_only(prov, case)
    if not why:
        try:
            return H.time_case(make_call, case["bytes"], l2_cold=args.l2_cold, l2=args.l2_bytes,
                               target_ms=args.target_ms, repeats=args.repeats, device=args.device)
        except Exception as e:  # noqa: BLE001 - fall back to the eager loop, and say so
            if torch.cuda.is_available() and args.device != "cpu":
                torch.cuda.synchronize()
            err = f"{type(e).__name__}: {e}"[:500]
            why = "the CUDA-graph capture failed"
    else:
        err = None
    k = H.l2_cold_sets(case["bytes"], args.l2_bytes) if args.l2_cold else 1
    out = _time_eagerly([make_call(i) for i in range(k)], case["bytes"], args, why)
    if err:
        out["graph_error"] = err
    return out


# ---------------------------------------------------------------- the family
class KvBlocksFamily(H.Family):
    name = "kv_blocks"
    ops = OPS
    providers = PROVIDERS
    x_axis, x_default, x_quick = "size", [16, 256, 2048], [16, 2048]
    dtypes = ("bf16",)
    vllm_ns = "_C_cache_ops"
    bytes_model = ("copy_blocks 2*pairs*block_bytes*layers + 16*pairs; swap_blocks "
                   "2*blocks*block_bytes + 16*blocks; pcie_copy 2*blocks*block_bytes; gather_cache "
                   "tokens*entries*(cache element + 2); concat_and_cache_mla tokens*576*(2 + cache "
                   "element) + 8*tokens; compact_blocks 2*moved blocks*block_bytes*layers")
    fake = {"loomnb": (3.0, 3800.0), "loomnb_host_map": (20.0, 52.0), "vllm": (6.0, 2600.0),
            "torch": (9.0, 1100.0)}  # (floor µs, GB/s) for --dry-run

    def add_arguments(self, p):
        p.add_argument("--layers", type=H.csv_list(int),
                       help="layers of copy_blocks and compact_blocks (default: the plan's)")
        p.add_argument("--block-kb", type=H.csv_list(int, GEOMETRY),
                       help="swap_blocks' block sizes, 64 and/or 16 (default: both)")
        p.add_argument("--directions", type=H.csv_list(str, ("d2h", "h2d")),
                       help="swap_blocks' directions (default: both)")
        p.add_argument("--kv-dtypes", type=H.csv_list(str, ("bf16", "fp8")),
                       help="cache dtypes of gather_cache (MLA) and concat_and_cache_mla")

    def cases(self, args):
        default_sizes = self.x_quick if args.quick else self.x_default
        sizes = args.size if args.size != default_sizes else None
        q = args.quick
        out = []
        for op in args.ops:
            if op == "pcie_copy" and "swap_blocks" in args.ops:
                continue  # measured beside each swap_blocks case
            for spec in self._plan(op, q, sizes, args):
                # swap_blocks' copy floor right after each of its cases (same clocks, same run)
                for o in (op, "pcie_copy") if op == "swap_blocks" else (op,):
                    case = {"op": o, "dtype": "bf16", "l2": "cold" if args.l2_cold else "warm",
                            **spec}
                    case["x"] = case["size"]
                    case["bytes"] = op_bytes(case)
                    out.append(case)
        return out

    def _plan(self, op, quick, sizes, args):
        """The (op-specific) case specs of ``op``: the default or quick plan, with --size,
        --layers, --directions, --block-kb, --kv-dtypes replacing that axis."""
        def override(plan, pos, values):
            if not values:
                return plan
            keys = dict.fromkeys(s[:pos] + s[pos + 1:] for s in plan)
            return [k[:pos] + (v,) + k[pos:] for k in keys for v in values]

        def plural(n):
            return f"{n} layer{'s' if n > 1 else ''}, 64 KB blocks"
        if op == "copy_blocks":
            plan = override(override(COPY_QUICK if quick else COPY, 1, sizes), 0, args.layers)
            for layers, pairs in plan:
                yield {"layers": layers, "pairs": pairs, "size": pairs, "shape": plural(layers)}
        elif op in ("swap_blocks", "pcie_copy"):
            plan = override(SWAP_QUICK if quick else SWAP, 2, sizes)
            plan = override(override(plan, 0, args.directions), 1, args.block_kb)
            for direction, kb, n in plan:
                yield {"direction": direction, "block_kb": kb, "blocks": n, "size": n,
                       "shape": f"{direction} {kb} KB blocks"}
        elif op == "gather_cache":
            plan = override(GATHER_QUICK if quick else GATHER, 2, sizes)
            mla = override([s for s in plan if s[0] == "mla"], 1, args.kv_dtypes)
            for source, kv, T in [s for s in plan if s[0] == "k_pages"] + mla:
                S = max(1, cdiv(T, SEQ_TOKENS))
                T = T // S * S
                label = ("K pages 8x128 bf16" if source == "k_pages"
                         else f"MLA 576 {'fp8 -> bf16' if kv == 'fp8' else 'bf16'}")
                yield {"source": source, "kv": kv, "num_tokens": T, "num_seqs": S, "size": T,
                       "shape": label}
        elif op == "concat_and_cache_mla":
            plan = override(override(MLA_QUICK if quick else MLA, 1, sizes), 0, args.kv_dtypes)
            for kv, T in plan:
                yield {"kv": kv, "num_tokens": T, "size": T, "shape": f"512+64, {kv} cache"}
        elif op == "compact_blocks":
            plan = override(override(COMPACT_QUICK if quick else COMPACT, 1, sizes), 0, args.layers)
            for layers, n in plan:
                yield {"layers": layers, "blocks": n, "size": n, "shape": plural(layers),
                       "torch_temporary_bytes": n * block_bytes()}

    def shape_label(self, case):
        return case["shape"]

    def op_bytes(self, op, case):
        return op_bytes(case)

    def make_inputs(self, op, case, device, seed):
        return make_inputs(case, device, seed)


FAMILY = KvBlocksFamily()


# ---------------------------------------------------------------- targets
def _medians(rows):
    """(op, shape, size, provider) -> {"us", "GBps", "exact_min"}: medians over the passes (the
    graph time, or the eager time of an eager-only case)."""
    by = {}
    for r in rows:
        us = r.get("graph_us") if r.get("graph_us") is not None else r.get("eager_us")
        if r.get("status") == "ok" and us:
            by.setdefault((r["op"], r["shape"], r["size"], r["provider"]), []).append(r)
    out = {}
    for k, rs in by.items():
        us = [r["graph_us"] if r.get("graph_us") is not None else r["eager_us"] for r in rs]
        ex = [r["exact_min"] for r in rs if r.get("exact_min") is not None]
        out[k] = {"us": statistics.median(us), "GBps": statistics.median(r["GBps"] for r in rs),
                  "exact_min": min(ex) if ex else None}
    return out


def evaluate_targets(rows, copy_GBps, exact_ref):
    """The targets over a run's rows (module docstring): one entry per checked shape, with the
    ratio and whether it is met (None: not measured). Speedups are peer µs / loomnb µs."""
    med = _medians(rows)
    out = []

    def entry(target, op, shape, size, need, peer, ratio, **extra):
        me = med.get((op, shape, size, "loomnb"))
        e = {"target": target, "op": op, "shape": shape, "size": size, "need": need,
             "loomnb_us": me["us"] if me else None, "peer": peer, "ratio": ratio,
             "met": None if ratio is None else ratio >= need, **extra}
        out.append(e)

    def speedup(op, shape, size, peer):
        me, other = med.get((op, shape, size, "loomnb")), med.get((op, shape, size, peer))
        return (other["us"] / me["us"], other["us"]) if me and other else (None, None)

    cases = sorted({k[:3] for k in med} | {(r["op"], r["shape"], r["size"]) for r in rows},
                   key=lambda k: (k[0], k[1], k[2]))
    for op, shape, size in cases:
        if op == "copy_blocks" and size in (16, 2048):
            need = 3.0 if size == 2048 else 1.0
            ratio, peer_us = speedup(op, shape, size, "torch")
            entry(f">= {need}x torch", op, shape, size, need, "torch", ratio, peer_us=peer_us)
            me = med.get((op, shape, size, "loomnb"))
            if size == 2048:
                pct = me["GBps"] / copy_GBps if me and copy_GBps else None
                entry(">= 80% of the copy rate", op, shape, size, 0.8, "copy rate", pct,
                      copy_GBps=copy_GBps)
        elif op == "swap_blocks" and size >= 256:
            me = med.get((op, shape, size, "loomnb"))
            floor = med.get(("pcie_copy", shape, size, "torch"))
            ratio = floor["us"] / me["us"] if me and floor else None
            entry(">= 90% of the PCIe copy floor", op, shape, size, 0.9, "pcie_copy", ratio,
                  peer_us=floor["us"] if floor else None,
                  pcie_GBps=floor["GBps"] / 2 if floor else None)
        elif op == "gather_cache":
            ratio, peer_us = speedup(op, shape, size, "vllm")
            entry(">= 1.2x vLLM", op, shape, size, 1.2, "vllm", ratio, peer_us=peer_us)
        elif op == "concat_and_cache_mla":
            ratio, peer_us = speedup(op, shape, size, "vllm")
            entry(">= 1.0x vLLM", op, shape, size, 1.0, "vllm", ratio, peer_us=peer_us)
            me = med.get((op, shape, size, "loomnb"))
            exact = (me["exact_min"] if me and str(exact_ref or "").startswith("vllm") else None)
            entry("byte-identical to vLLM", op, shape, size, 1.0, "vllm", exact,
                  exact_ref=exact_ref)
    return out


def pcie_rates(rows):
    """The copy floor's bus rate (bytes one way / µs) of each pcie_copy case of the run."""
    med = _medians(rows)
    return [{"shape": k[1], "blocks": k[2], "us": v["us"], "bus_GBps": v["GBps"] / 2}
            for k, v in sorted(med.items()) if k[0] == "pcie_copy" and k[3] == "torch"]


def add_targets(json_path):
    """Evaluate the targets of a result file, store them (and the PCIe rates) in its meta,
    print them."""
    path = Path(json_path)
    d = json.loads(path.read_text())
    meta = d["meta"]
    targets = evaluate_targets(d["results"], meta.get("copy_GBps"), meta.get("exact_ref"))
    meta["targets"], meta["pcie"] = targets, pcie_rates(d["results"])
    path.write_text(json.dumps(d, indent=1, default=str) + "\n")
    fake = " (DRY RUN: fake timings)" if meta.get("dry_run") else ""
    checked = [t for t in targets if t["met"] is not None]
    print(f"targets: {sum(t['met'] for t in checked)} of {len(checked)} met, "
          f"{len(targets) - len(checked)} not measured{fake}")
    for t in targets:
        state = {True: "met ", False: "MISS", None: "n/m "}[t["met"]]
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
        us = "-" if t["loomnb_us"] is None else f"{t['loomnb_us']:.1f} µs"
        print(f"  {state} {t['op']} {t['shape']} {t['size']}: {t['target']}: ratio {ratio} "
              f"(loomnb {us})")
    for p in meta["pcie"]:
        print(f"  pcie {p['shape']} {p['blocks']} blocks: {p['bus_GBps']:.1f} GB/s one way{fake}")
    return targets


def parse_args(argv=None):
    return H.parse_args(FAMILY, argv)


def main(argv=None) -> Path:
    orig = H._case_timing
    H._case_timing = functools.partial(_case_timing, orig)  # eager-only cases (compact_blocks)
    try:
        path = H.run(FAMILY, argv)
    finally:
        H._case_timing = orig
    add_targets(path)
    return path


if __name__ == "__main__":
    main()
