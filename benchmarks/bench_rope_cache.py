"""RoPE + paged KV-cache write benchmark: loomnb's fused op (one launch) vs loomnb's two ops,
vLLM 0.24's ``rotary_embedding`` + ``reshape_and_cache_flash`` (compiled ops), FlashInfer
0.6.12's ``apply_rope_with_cos_sin_cache_inplace`` + ``append_paged_kv_cache``, a torch eager
composite (rotation + index writes) and torch.compile of it.

    python3 benchmarks/bench_rope_cache.py --vllm-lib /path/to/_C_stable_libtorch.abi3.so
    python3 benchmarks/bench_rope_cache.py --quick     # 32/8/128, bf16 cache, 1/128/2048 tokens
    python3 benchmarks/bench_rope_cache.py --dry-run   # no GPU: fake timings, real plumbing

One benchmarked op, ``rope_cache``: rotate q and k in place (NeoX, rot_dim = head_size), then
write the rotated k and v to an interleaved NHD cache ``(num_blocks, 2, 16, num_kv_heads,
head_size)`` at random slots (a decode batch), bf16 or FP8 E4M3 storage. q/k/v are slices of
one fused QKV buffer, as in vLLM. Outputs compared for exactness (bytes equal to vLLM's on the
same inputs): query, key, and the cache rows written (gathered at the slots).

Bytes model per token (``b`` activation bytes, ``c`` cache bytes): q read + write
``2*Hq*D*b``, k read + write ``2*Hk*D*b``, v read ``Hk*D*b``, cache writes ``2*Hk*D*c``, the
cos/sin row ``D*b``, position and slot 16 -- the fused op's floor (the two-op sequences read k
twice). The sweep is lean by default (about 3 GPU minutes, FlashInfer's JIT included).
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
import torch  # noqa: E402

BLOCK_SIZE = 16
MAX_POS = 4096
SCALE = 0.05
FP8_MAX = 448.0
GEOMETRIES = {"32/8/128": (32, 8, 128), "28/4/128": (28, 4, 128), "9/3/64": (9, 3, 64)}
# the default sweep: (geometry, kv dtypes, num_tokens)
DEFAULT = [("32/8/128", ("bf16", "fp8"), (1, 8, 32, 128, 512, 2048)),
           ("28/4/128", ("bf16",), (1, 128, 2048)),
           ("9/3/64", ("bf16",), (1, 128, 2048))]
QUICK = [("32/8/128", ("bf16",), (1, 128, 2048))]

OPS = {"rope_cache": H.Op("rope_cache", ("positions", "query", "key", "value", "cos_sin_cache",
                                         "slot_mapping"),
                          ("query", "key", "key_cache_rows", "value_cache_rows"))}


def op_bytes(num_tokens, num_heads, num_kv_heads, head_size, kv="bf16", act_bytes=2):
    """Bytes the fused op must move (module docstring)."""
    c = 1 if kv == "fp8" else act_bytes
    D = head_size
    per_token = (2 * num_heads * D * act_bytes + 3 * num_kv_heads * D * act_bytes
                 + 2 * num_kv_heads * D * c + D * act_bytes + 16)
    return num_tokens * per_token


def make_inputs(case, device, seed):
    """Fresh tensors of one call: the fused QKV buffer (q/k/v views), positions, cos/sin (bf16
    and a float32 copy for FlashInfer), an interleaved NHD cache, random distinct slots."""
    g = torch.Generator(device=device).manual_seed(seed)
    T, Hq, Hk, D = case["num_tokens"], case["num_heads"], case["num_kv_heads"], case["head_size"]
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=g, device=device).to(torch.bfloat16)
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D)
    f = torch.outer(torch.arange(MAX_POS, dtype=torch.float32, device=device), inv)
    cs32 = torch.cat([f.cos(), f.sin()], -1)
    num_blocks = -(-T // BLOCK_SIZE) + 1
    cdt = torch.uint8 if case["kv"] == "fp8" else torch.bfloat16
    kv_cache = torch.zeros(num_blocks, 2, BLOCK_SIZE, Hk, D, dtype=cdt, device=device)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g, device=device)[:T]
    return {"qkv": qkv, "query": qkv[:, :Hq * D], "key": qkv[:, Hq * D:(Hq + Hk) * D],
            "value": qkv[:, (Hq + Hk) * D:],
            "positions": torch.randint(0, MAX_POS, (T,), generator=g, device=device),
            "cos_sin_cache": cs32.to(torch.bfloat16), "cos_sin_cache_f32": cs32,
            "kv_cache": kv_cache, "key_cache": kv_cache[:, 0], "value_cache": kv_cache[:, 1],
            "slot_mapping": slots, "k_scale": torch.full((1,), SCALE, device=device),
            "v_scale": torch.full((1,), SCALE, device=device),
            "kv_cache_dtype": "fp8" if case["kv"] == "fp8" else "auto", "head_size": D}


def collect(t):
    """The outputs compared for exactness: query, key and the cache rows at the slots."""
    s = t["slot_mapping"]
    blk, off = s // BLOCK_SIZE, s % BLOCK_SIZE
    return lambda _: {"query": t["query"], "key": t["key"],
                      "key_cache_rows": t["key_cache"][blk, off],
                      "value_cache_rows": t["value_cache"][blk, off]}


# ---------------------------------------------------------------- torch composite (the spec)
def t_rope_cache(positions, query, key, value, key_cache, value_cache, slot_mapping, head_size,
                 cos_sin_cache, kv_cache_dtype, k_scale, v_scale):
    """NeoX RoPE in fp32 (products rounded as torch does), in place, then index writes."""
    T, D = positions.shape[0], head_size
    cos, sin = cos_sin_cache[positions].float().chunk(2, -1)
    cos, sin = cos[:, None], sin[:, None]
    for x in (query, key):
        x3 = x.view(T, -1, D)
        x1, x2 = x3[..., :D // 2].float(), x3[..., D // 2:].float()
        x3.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1))
    blk, off = slot_mapping // key_cache.shape[1], slot_mapping % key_cache.shape[1]
    k3, v3 = key.view(T, -1, D), value.view(T, -1, D)
    if kv_cache_dtype == "auto":
        key_cache[blk, off] = k3
        value_cache[blk, off] = v3
    else:
        q8 = lambda x, s: (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # noqa: E731
        key_cache[blk, off] = q8(k3, k_scale).view(torch.uint8)
        value_cache[blk, off] = q8(v3, v_scale).view(torch.uint8)


def _args(t):
    return (t["positions"], t["query"], t["key"], t["value"], t["key_cache"], t["value_cache"],
            t["slot_mapping"], t["head_size"], t["cos_sin_cache"], t["kv_cache_dtype"],
            t["k_scale"], t["v_scale"])


# ---------------------------------------------------------------- providers
class Loomnb(H.LoomnbProvider):
    """loomnb.rotary_embedding_and_cache: one launch (fma='vllm')."""

    def bind(self, op, t, case):
        return (partial(self.m.rotary_embedding_and_cache, t["positions"], t["query"], t["key"],
                        t["value"], t["key_cache"], t["value_cache"], t["slot_mapping"],
                        t["head_size"], t["cos_sin_cache"], True, t["kv_cache_dtype"],
                        t["k_scale"], t["v_scale"]), collect(t))


class LoomnbTwo(Loomnb):
    """loomnb.rotary_embedding then loomnb.reshape_and_cache_flash: two launches."""
    name = "loomnb_two"

    def bind(self, op, t, case):
        T, D = t["positions"].shape[0], t["head_size"]
        rope = partial(self.m.rotary_embedding, t["positions"], t["query"], t["key"], D,
                       t["cos_sin_cache"], True)
        cache = partial(self.m.reshape_and_cache_flash, t["key"].view(T, -1, D),
                        t["value"].view(T, -1, D), t["key_cache"], t["value_cache"],
                        t["slot_mapping"], t["kv_cache_dtype"], t["k_scale"], t["v_scale"])
        return (lambda: (rope(), cache())), collect(t)


class Vllm(H.Provider):
    """vLLM 0.24's compiled torch.ops._C.rotary_embedding + torch.ops._C_cache_ops.
    reshape_and_cache_flash (two launches) from $LOOMNB_VLLM_LIB / --vllm-lib, loaded without
    importing vllm and bound by schema argument names (printed); at setup, which of the nine
    FMA contraction forms of loomnb's oracle reproduce its RoPE bytes (fp32 data)."""
    name = "vllm"
    rope_ns, cache_ns = "_C", "_C_cache_ops"

    def setup(self, args, log):
        path, err = H.load_vllm_library(args)
        if err:
            return err
        try:
            self.rope = getattr(torch.ops, self.rope_ns).rotary_embedding
            self.cache = getattr(torch.ops, self.cache_ns).reshape_and_cache_flash
            schemas = {"rotary_embedding": str(self.rope.default._schema),
                       "reshape_and_cache_flash": str(self.cache.default._schema)}
        except (AttributeError, RuntimeError) as e:
            return ("no --vllm-lib given and LOOMNB_VLLM_LIB is unset" if not path
                    else f"vLLM ops missing: {e!r}")
        self.lib = str(Path(path).resolve()) if path else "ops already registered in this process"
        self.schemas, self.bindings, self.log = schemas, {}, log
        for sch in schemas.values():
            log(f"[vllm] schema {sch}")
        self.probe = (probe_forms(self.rope, log)
                      if args.device != "cpu" and torch.cuda.is_available() else {})

    def unsupported(self, case):
        return None

    def bind(self, op, t, case):
        T, D = t["positions"].shape[0], t["head_size"]
        vals = {**t, "key": t["key"], "is_neox": True, "rope_dim_offset": 0, "inverse": False}
        ra, rk, rdesc = H.bind_schema(self.rope.default._schema, vals,
                                      ("positions", "query", "key", "head_size", "cos_sin_cache",
                                       "is_neox"), {})
        cvals = {**t, "key": t["key"].view(T, -1, D), "value": t["value"].view(T, -1, D)}
        ca, ck, cdesc = H.bind_schema(self.cache.default._schema, cvals,
                                      ("key", "value", "key_cache", "value_cache", "slot_mapping",
                                       "kv_cache_dtype", "k_scale", "v_scale"), {})
        if "rope_cache" not in self.bindings:
            self.bindings["rope_cache"] = f"rotary_embedding({rdesc}); reshape_and_cache_flash({cdesc})"
            self.log(f"[vllm] {self.bindings['rope_cache']}")
        rope, cache = partial(self.rope, *ra, **rk), partial(self.cache, *ca, **ck)
        return (lambda: (rope(), cache())), collect(t)


def probe_forms(rope, log):
    """Which oracle contraction forms give vLLM's bytes: fp32 query/key and cache (bf16 data
    rounds every form to the same bits), NeoX and GPT-J, inverse or not."""
    import loomnb.oracle
    import numpy as np
    out = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for is_neox in (True, False):
        for inverse in (False, True):
            q = torch.randn(64, 8 * 128, generator=g, device="cuda") * 3
            pos = torch.randint(0, MAX_POS, (64,), generator=g, device="cuda")
            inv = 1.0 / 10000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32, device="cuda") / 128)
            f = torch.outer(torch.arange(MAX_POS, dtype=torch.float32, device="cuda"), inv)
            cs = torch.cat([f.cos(), f.sin()], -1)
            got = q.clone()
            rope(pos, got, None, 128, cs, is_neox, 0, inverse)
            got = got.cpu().numpy().view(np.uint32)
            match = []
            for form in [f"{x}{y}" for x in "abn" for y in "den"]:
                qo = q.cpu().numpy().copy()
                loomnb.oracle.rotary_embedding(pos.cpu().numpy(), qo, None, 128, cs.cpu().numpy(),
                                               is_neox, 0, inverse, form=form)
                if np.array_equal(qo.view(np.uint32), got):
                    match.append(form)
            key = f"{'neox' if is_neox else 'gptj'}{'_inverse' if inverse else ''}"
            out[key] = match
            log(f"[vllm] fp32 RoPE FMA form probe {key}: oracle forms equal to vLLM: {match} "
                f"(loomnb fma='vllm' uses {'ad' if inverse else 'ae'})")
    return out


class FlashInfer(H.Provider):
    """FlashInfer 0.6.12: apply_rope_with_cos_sin_cache_inplace (float32 cos/sin, as it requires)
    + append_paged_kv_cache on the same interleaved NHD cache, each token its own one-page
    sequence (kv_indices = its block, last page length = its offset + 1). JIT-compiled on first
    use (outside the timed regions); bf16 caches only (its append does not quantise)."""
    name = "flashinfer"

    def setup(self, args, log):
        try:
            import flashinfer
            self.rope = flashinfer.rope.apply_rope_with_cos_sin_cache_inplace
            self.append = flashinfer.page.append_paged_kv_cache
        except Exception as e:  # noqa: BLE001
            return f"import flashinfer failed: {e!r}"
        try:  # JIT both modules now, so a compiler failure skips the provider with its reason
            t = make_inputs({"num_tokens": 1, "num_heads": 8, "num_kv_heads": 8, "head_size": 128,
                             "kv": "bf16"}, "cuda", 0)
            self.bind(None, t, {})[0]()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            return f"flashinfer JIT/first call failed: {e!r}"[:500]

    def unsupported(self, case):
        if case.get("kv") == "fp8":
            return "append_paged_kv_cache stores the key dtype (no FP8 quantisation)"

    def bind(self, op, t, case):
        T, D = t["positions"].shape[0], t["head_size"]
        s = t["slot_mapping"]
        blk, off = (s // BLOCK_SIZE).int(), (s % BLOCK_SIZE).int()
        indptr = torch.arange(T + 1, dtype=torch.int32, device=s.device)
        batch = torch.arange(T, dtype=torch.int32, device=s.device)
        last = off + 1
        rope = partial(self.rope, t["positions"], t["query"], t["key"], D, t["cos_sin_cache_f32"], True)
        append = partial(self.append, t["key"].view(T, -1, D), t["value"].view(T, -1, D), batch,
                         off, t["kv_cache"], blk, indptr, last, "NHD")
        return (lambda: (rope(), append())), collect(t)


class Torch(H.Provider):
    """torch eager composite: NeoX rotation in fp32 (in place) then index writes (E4M3 by a
    clamp and cast)."""
    name = "torch"

    def fn(self, op):
        return t_rope_cache

    def bind(self, op, t, case):
        return partial(self.fn(op), *_args(t)), collect(t)


class TorchCompile(Torch):
    """torch.compile of the composite, default mode, automatic dynamic shapes (one recompile
    when num_tokens changes, not one per case); compiled outside the timed regions."""
    name = "torch_compile"
    error_status = "skip"

    def setup(self, args, log):
        for knob in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 256)
        self.compiled = torch.compile(t_rope_cache)

    def fn(self, op):
        return self.compiled


PROVIDERS = {p.name: p for p in (Loomnb, LoomnbTwo, Vllm, FlashInfer, Torch, TorchCompile)}


class RopeCacheFamily(H.Family):
    name = "rope_cache"
    ops = OPS
    providers = PROVIDERS
    x_default, x_quick = [1, 8, 32, 128, 512, 2048], [1, 128, 2048]
    dtypes = ("bf16",)
    vllm_ns = "_C"
    bytes_model = ("per token: q and k read + written, v read, k and v cache rows written, the "
                   "cos/sin row, position and slot (the fused op's floor)")
    fake = {"loomnb": (2.2, 4000.0), "loomnb_two": (4.2, 3600.0), "vllm": (4.9, 2000.0),
            "flashinfer": (3.7, 3400.0), "torch": (38.0, 300.0), "torch_compile": (9.0, 1500.0)}

    def add_arguments(self, p):
        p.add_argument("--geometries", type=H.csv_list(str, GEOMETRIES),
                       help="num_heads/num_kv_heads/head_size list (default: the lean sweep)")
        p.add_argument("--kv-dtypes", type=H.csv_list(str, ("bf16", "fp8")),
                       help="cache storage (default: the lean sweep)")

    def cases(self, args):
        default_tokens = self.x_quick if args.quick else self.x_default
        explicit = args.geometries or args.kv_dtypes or args.num_tokens != default_tokens
        plan = QUICK if args.quick else DEFAULT
        if explicit:
            plan = [(g, tuple(args.kv_dtypes or ("bf16",)), tuple(args.num_tokens))
                    for g in (args.geometries or ["32/8/128"])]
        out = []
        for geom, kvs, tokens in plan:
            Hq, Hk, D = GEOMETRIES[geom]
            for kv in kvs:
                for T in tokens:
                    case = {"op": "rope_cache", "num_heads": Hq, "num_kv_heads": Hk,
                            "head_size": D, "kv": kv, "num_tokens": T, "dtype": "bf16",
                            "l2": "cold" if args.l2_cold else "warm", "x": T,
                            "shape": f"{geom} {kv}"}
                    case["bytes"] = op_bytes(T, Hq, Hk, D, kv)
                    out.append(case)
        return out

    def shape_label(self, case):
        return case["shape"]

    def op_bytes(self, op, case):
        return op_bytes(case["num_tokens"], case["num_heads"], case["num_kv_heads"],
                        case["head_size"], case["kv"])

    def make_inputs(self, op, case, device, seed):
        return make_inputs(case, device, seed)


FAMILY = RopeCacheFamily()


def parse_args(argv=None):
    return H.parse_args(FAMILY, argv)


def main(argv=None) -> Path:
    return H.run(FAMILY, argv)


if __name__ == "__main__":
    main()
