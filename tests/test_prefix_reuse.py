"""Prefix reuse in the decode loop (``loomnb.models.prefix_cache``, ``generate(...,
prefix_caching=True)``, ``loomnb generate --prefix-caching``).

The loop checks run the tiny random-weight llama of ``tests/test_model.py`` (no GGUF): the
greedy tokens with reuse on equal those with it off (float32: exactly; bf16: up to near-ties of
the top two logits, since the partial prefill's GEMMs have fewer rows and CPU GEMM kernels may
round a row another way for another row count), blocks are shared while the sequences live,
every block is back on the free list afterwards, and the chained hash keeps a block with equal
tokens after another prefix apart. The ``model`` test repeats the token check on SmolLM2.
"""

import numpy as np
import pytest
import torch
from test_cli import run, write_tiny_gguf
from test_model import needs_gguf, tiny_llama

from loomnb.models.llama import compare_greedy, top_logits_at
from loomnb.models.paged_cache import BLOCK_SIZE, BlockAllocator, PagedKVCache
from loomnb.models.prefix_cache import (NONE_HASH, PrefixCache, block_hashes,
                                        hash_block_tokens)

BS = BLOCK_SIZE
BASE = list(range(100, 140))  # 40 tokens: two full blocks and an 8-token tail
OTHER = list(range(200, 216))  # a first block that no other prompt starts with
# (prompt, prompt tokens its prefill computes when the prompts run in this order)
CASES = [
    (BASE[:37], 37),                  # nothing cached yet
    (BASE[:37], 1),                   # identical: both full blocks and the tail, last token
    (BASE[:32], 1),                   # a multiple of block_size, all cached: its last token
    (BASE[:32] + [5, 6, 7], 3),       # two blocks cached, another tail
    (BASE[:16], 1),                   # a prefix of the others, one block
    (BASE, 8),                        # the others are its prefix: two blocks cached
    (BASE[:17], 1),                   # one block cached, a tail of one token
    ([9, 8, 7], 3),                   # shorter than a block: nothing to share
    (OTHER + BASE[16:32], 32),        # block 1 equals BASE's block 1, after another prefix
]
PROMPTS = [p for p, _ in CASES]
NEW_TOKENS = 6
BACKENDS = ["loomnb-cpu", "torch-reference", "torch"]


@pytest.fixture(scope="module")
def tiny32():
    return tiny_llama(dtype=torch.float32)


@pytest.fixture(scope="module")
def tiny16():
    return tiny_llama(dtype=torch.bfloat16)


# --- the chained hash and the allocator ------------------------------------------------------


def test_block_hashes_are_chained():
    h = block_hashes(BASE, BS)
    assert len(h) == len(BASE) // BS == 2 and all(len(x) == 32 for x in h)
    assert h[0] == hash_block_tokens(None, BASE[:16]) == hash_block_tokens(NONE_HASH, BASE[:16])
    assert h[1] == hash_block_tokens(h[0], BASE[16:32])
    assert block_hashes(BASE[:35], BS) == h  # the partial tail has no block hash
    assert block_hashes(BASE[:15], BS) == []
    # the same 16 tokens after another first block: another hash
    other = block_hashes(OTHER + BASE[16:32], BS)
    assert other[1] != h[1] and other[0] != h[0]
    assert hash_block_tokens(None, BASE[16:32]) not in (h[1], other[1])
    assert block_hashes(BASE[:31] + [0], BS)[1] != h[1]  # one token apart


def test_allocator_ref_counts_and_cache():
    alloc = BlockAllocator(4)
    a = alloc.allocate(2)
    assert a == [0, 1] and alloc.ref_counts == [1, 1, 0, 0] and alloc.num_free_blocks == 2
    alloc.cache_block(b"h0", 0)
    alloc.cache_block(b"h0", 1)  # a hash keeps its first block
    alloc.cache_block(b"h1", 1)
    assert alloc.lookup([b"h0", b"h1", b"h2"]) == [0, 1]
    assert alloc.lookup([b"h1"]) == [1] and alloc.lookup([b"h2", b"h0"]) == []
    alloc.share([0])
    alloc.free([0, 1])
    assert alloc.ref_counts == [1, 0, 0, 0] and alloc.lookup([b"h0", b"h1"]) == [0]
    assert list(alloc.free_blocks) == [2, 3, 1]  # freed at count 0, to the back
    alloc.free([0])
    assert alloc.cached_blocks == {} and alloc.block_hashes == {}
    assert alloc.num_free_blocks == 4
    with pytest.raises(ValueError, match="block 0 is already free"):
        alloc.free([0])
    with pytest.raises(ValueError, match="block 2 is free; only an allocated block can be shared"):
        alloc.share([2])
    with pytest.raises(ValueError, match="only an allocated block can be cached"):
        alloc.cache_block(b"h", 3)
    with pytest.raises(RuntimeError, match="out of KV blocks: need 5, 4 free"):
        alloc.allocate(5)


@pytest.mark.parametrize("n, start, copies", [
    (37, 36, True),    # identical prompt with a tail: the tail block copied, its last token
    (32, 31, True),    # a multiple of block_size: the last full block copied
    (17, 16, False),   # a one-token tail: nothing cached in it, a fresh block, no copy
])
def test_copy_on_write_of_the_block_the_prefill_writes(n, start, copies):
    alloc = BlockAllocator(16)
    cache = PrefixCache(alloc, BS)
    first = cache.allocate(BASE[:n], 4)
    assert first.num_computed_tokens == 0 and first.block_mapping == []
    cache.commit(first)
    second = cache.allocate(BASE[:n], 4)
    j = start // BS
    assert second.num_computed_tokens == start
    assert second.blocks[:j] == first.blocks[:j]  # shared
    assert second.blocks[j] != first.blocks[j]  # its own block where it writes
    assert second.block_mapping == ([(first.blocks[j], second.blocks[j])] if copies else [])
    assert [alloc.ref_counts[b] for b in first.blocks] == [2] * j + [1] * (4 - j)
    assert len(set(first.blocks + second.blocks)) == 8 - j
    cache.end_prefill()
    if n % BS:  # the tail is not found once the sequences decode
        assert cache.allocate(BASE[:n], 4).num_computed_tokens == (n // BS) * BS


def test_disabled_prefix_cache_hands_out_fresh_blocks():
    alloc = BlockAllocator(8)
    cache = PrefixCache(alloc, BS, enabled=False)
    for want in ([0, 1], [2, 3]):
        seq = cache.allocate(BASE[:32], 2)
        cache.commit(seq)
        assert seq.blocks == want and seq.num_computed_tokens == 0
    assert alloc.cached_blocks == {}


# --- copy_blocks, per backend ----------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_backend_copy_blocks(backend, kv_cache_dtype):
    """Every layer's key and value cache: block dst = block src for each (src, dst) row, bits;
    the other blocks untouched; one call for all layers."""
    from loomnb.models.backends import get_backend

    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(3, 6, BS, 3, 64, torch.bfloat16, "cpu", kv_cache_dtype)
    for kv in cache.kv_caches:
        bits = torch.randint(0, 2**8 if cache.fp8 else 2**14, kv.shape, generator=gen)
        kv.view(torch.uint8 if cache.fp8 else torch.int16).copy_(bits)
    before = [kv.clone() for kv in cache.kv_caches]
    mapping = torch.tensor([[0, 3], [2, 1], [5, 4]], dtype=torch.int64)
    get_backend(backend).copy_blocks(cache.key_caches, cache.value_caches, mapping)
    for kv, old in zip(cache.kv_caches, before):
        want = old.clone()
        want[[3, 1, 4]] = old[[0, 2, 5]]  # both halves (key and value) of each block
        assert torch.equal(kv.view(torch.uint8), want.view(torch.uint8))


def test_torch_copy_blocks_rejects_a_bad_block_mapping():
    from loomnb.models.backends import TorchReferenceOps

    cache = PagedKVCache(1, 2, BS, 3, 64, torch.bfloat16, "cpu")
    args = cache.key_caches, cache.value_caches
    with pytest.raises(TypeError, match="block_mapping must be int64; got torch.int32"):
        TorchReferenceOps.copy_blocks(*args, torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"must be \[num_pairs, 2\]; got \[2\]"):
        TorchReferenceOps.copy_blocks(*args, torch.tensor([0, 1]))


def test_backend_copy_blocks_has_the_ops_signature():
    import inspect

    from loomnb import oracle
    from loomnb.models.backends import LoomnbCpuOps, LoomnbCudaOps, TorchOps, TorchReferenceOps

    op = [p for p in inspect.signature(oracle.copy_blocks).parameters][:3]
    assert op == ["key_caches", "value_caches", "block_mapping"]
    for backend in (TorchReferenceOps, TorchOps, LoomnbCpuOps, LoomnbCudaOps):
        params = [p for p in inspect.signature(backend.copy_blocks).parameters if p != "self"]
        assert params == op, backend.__name__


@pytest.mark.gpu
def test_loomnb_cuda_copy_blocks_equals_torch():
    from loomnb.models.backends import LoomnbCudaOps, TorchReferenceOps

    gen = torch.Generator(device="cuda").manual_seed(1)
    caches = [PagedKVCache(2, 8, BS, 3, 64, torch.bfloat16, "cuda") for _ in range(2)]
    for kv in caches[0].kv_caches:
        kv.copy_(torch.randn(kv.shape, generator=gen, device="cuda"))
    for a, b in zip(*(c.kv_caches for c in caches)):
        b.copy_(a)
    mapping = torch.tensor([[0, 5], [3, 2]], dtype=torch.int64, device="cuda")
    LoomnbCudaOps().copy_blocks(caches[0].key_caches, caches[0].value_caches, mapping)
    TorchReferenceOps.copy_blocks(caches[1].key_caches, caches[1].value_caches, mapping)
    for a, b in zip(*(c.kv_caches for c in caches)):
        assert torch.equal(a, b)


# --- the loop --------------------------------------------------------------------------------


def test_prefill_rejects_a_bad_num_computed_tokens(tiny32):
    runner = tiny32.new_runner("torch-reference", 8)
    with pytest.raises(ValueError, match=r"num_computed_tokens must be in 0\.\.4 \(at least the "
                                         r"last prompt token is computed\); got 5"):
        runner.prefill([1, 2, 3, 4, 5], num_computed_tokens=5)
    with pytest.raises(ValueError, match="needs the block_table that holds the cached prefix"):
        runner.prefill([1, 2, 3, 4, 5], num_computed_tokens=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tokens_identical_with_and_without_reuse_fp32(tiny32, backend):
    """float32: the same greedy tokens with reuse on and off, logprobs within float32
    rounding; the prefill computes only what the cache lacks (the per-prompt counts of
    CASES)."""
    off = tiny32.new_runner(backend, 64).generate(PROMPTS, NEW_TOKENS)
    runner = tiny32.new_runner(backend, 64)
    on = runner.generate(PROMPTS, NEW_TOKENS, prefix_caching=True)
    assert on.token_ids == off.token_ids, compare_greedy(on, off)
    for a, b in zip(on.token_logprobs, off.token_logprobs):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    assert on.prefix_caching and not off.prefix_caching
    assert on.num_prefill_tokens == off.num_prefill_tokens == sum(map(len, PROMPTS))
    assert on.num_computed_prefill_tokens == sum(n for _, n in CASES)
    assert off.num_computed_prefill_tokens == off.num_prefill_tokens
    assert on.num_cached_prefill_tokens == on.num_prefill_tokens - sum(n for _, n in CASES)
    alloc = runner.kv_cache.allocator
    assert alloc.num_free_blocks == alloc.num_blocks and not any(alloc.ref_counts)
    assert alloc.cached_blocks == {}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_tokens_with_and_without_reuse_bf16(tiny16, kv_cache_dtype):
    """bf16, loomnb-cpu (and FP8: the first prefill, which calibrates the scales, computes every
    token): the same greedy tokens, or a first divergence at a near-tie of the top two bf16
    logits (an ulp that the GEMMs' other row count can move)."""
    off = tiny16.new_runner("loomnb-cpu", 64, kv_cache_dtype=kv_cache_dtype).generate(
        PROMPTS, NEW_TOKENS, num_top_logits=5)
    on = tiny16.new_runner("loomnb-cpu", 64, kv_cache_dtype=kv_cache_dtype).generate(
        PROMPTS, NEW_TOKENS, num_top_logits=5, prefix_caching=True)
    verdicts = compare_greedy(on, off)
    assert all(v in ("identical", "near-tie") for v, _ in verdicts), verdicts
    assert on.num_computed_prefill_tokens == sum(n for _, n in CASES)


def test_blocks_are_shared_while_the_sequences_live(tiny32):
    """During the decode, the full blocks of the common prefix have one reference per sequence
    holding them, fewer blocks are in use than without reuse, and the block equal in tokens
    after another prefix is not shared; afterwards every block is free."""
    prompts = [BASE[:37], BASE[:37], BASE, OTHER + BASE[16:32]]
    seen = {}

    def progress(stage, done, total):
        if stage == "decode" and done == 1:
            alloc = runner.kv_cache.allocator
            seen["ref_counts"] = list(alloc.ref_counts)
            seen["in_use"] = alloc.num_blocks - alloc.num_free_blocks

    runner = tiny32.new_runner("torch-reference", 32)
    on = runner.generate(prompts, NEW_TOKENS, progress=progress, prefix_caching=True)
    counts = seen["ref_counts"]
    # blocks needed per sequence: cdiv(prompt_len + 5, 16) = 3, 3, 3, 3
    assert sorted((c for c in counts if c), reverse=True) == [3, 3, 1, 1, 1, 1, 1, 1]
    assert seen["in_use"] == on.num_kv_blocks == 8
    off = tiny32.new_runner("torch-reference", 32).generate(prompts, NEW_TOKENS)
    assert off.num_kv_blocks == 12
    assert on.token_ids == off.token_ids
    alloc = runner.kv_cache.allocator
    assert alloc.num_free_blocks == 32 and alloc.ref_counts == [0] * 32
    # the last prompt computed all its 32 tokens (hash chain), the identical one its last
    assert on.num_computed_prefill_tokens == 37 + 1 + 8 + 32


def test_fp8_cache_reuses_blocks_written_with_the_final_scales(tiny32):
    """An FP8 cache takes its scales from the first prefill, which computes every token (its
    keys set the amax); the later prompts reuse its blocks, written with those scales: the
    same tokens as without reuse."""
    prompts = [BASE[:20], BASE[:20], BASE]
    kw = dict(kv_cache_dtype="fp8")
    on = tiny32.new_runner("torch-reference", 16, **kw).generate(prompts, 4, prefix_caching=True)
    off = tiny32.new_runner("torch-reference", 16, **kw).generate(prompts, 4)
    assert on.token_ids == off.token_ids
    assert on.num_computed_prefill_tokens == 20 + 1 + 24


# --- the command line ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")


def test_cli_prefix_caching_with_batch_sizes(capsys, tiny_gguf):
    """--prefix-caching: the run says so, reports the prefill tokens computed and cached, the
    --batch-sizes table gains a column of prefill tokens computed, and --check-reference
    (the torch reference without reuse) finds the same tokens."""
    prompt = "the tea the tea the tea the tea"  # 20 tokens: one full block and a tail
    rc, out, err = run(capsys, "generate", "--gguf", tiny_gguf, "--prompt", prompt,
                       "--prompt", prompt + " and", "--max-new-tokens", "3", "--device", "cpu",
                       "--dtype", "float32", "--prefix-caching", "--batch-sizes", "1,4",
                       "--check-reference", "--no-progress")
    assert rc == 0, out + err
    assert "tokens; prefix caching on, then up to 2 decode step(s)" in out
    assert "prefill: 44 tokens (28 computed, 16 from the prefix cache) in " in out
    assert "KV cache auto, prefix caching on, 3 new tokens per sequence" in out
    assert "| prefill tok/s | prefill tokens computed | decode TPOT ms |" in out
    rows = [line for line in out.splitlines() if line.startswith(("| 1 |", "| 4 |"))]
    assert len(rows) == 2, out
    assert "| 20 of 20 (0% from the prefix cache) |" in rows[0]
    # [p, p + " and", p, p + " and"] (20, 24, 20, 24 tokens): 20 + 8 + 1 + 1 computed
    assert "| 30 of 88 (66% from the prefix cache) |" in rows[1]
    assert "check-reference: OK: greedy tokens identical for 2/2 prompts" in out
    rc, out, err = run(capsys, "generate", "--gguf", tiny_gguf, "--prompt", prompt,
                       "--max-new-tokens", "2", "--device", "cpu", "--no-progress")
    assert rc == 0 and "prefix cach" not in out and "computed" not in out


def test_cli_prefix_caching_excludes_speculative(capsys):
    rc, out, err = run(capsys, "generate", "--prompt", "Hi", "--speculative", "ngram",
                       "--prefix-caching")
    assert rc == 2 and out == "" and len(err.splitlines()) == 1
    assert "--prefix-caching applies to plain greedy decoding; leave out --speculative" in err


# --- SmolLM2 ---------------------------------------------------------------------------------


@pytest.mark.model
@needs_gguf
def test_smollm2_chat_prompts_share_the_system_turn():
    """SmolLM2 with the chat template (every prompt starts with the same system turn) and a
    repeated prompt, loomnb-cpu, bf16: the greedy tokens equal those without reuse, or part
    first at a near-tie of the top two logits (printed); the shared turn is not recomputed."""
    from loomnb.models import load_model

    model = load_model(device="cpu", dtype="bfloat16")
    prompts = ["The capital of France is", "Water is made of", "The capital of France is"]
    kw = dict(backend="loomnb-cpu", chat=True, ignore_eos=True, num_top_logits=5)
    off = model.generate(prompts, 7, **kw)
    on = model.generate(prompts, 7, prefix_caching=True, **kw)
    verdicts = compare_greedy(on, off)
    for i, (v, step) in enumerate(verdicts):
        if step is not None:
            print(f"[{i}] {v} at {step}: reuse {top_logits_at(on, i, step)}, no reuse "
                  f"{top_logits_at(off, i, step)}")
    assert all(v in ("identical", "near-tie") for v, _ in verdicts), verdicts
    assert on.token_ids[2] == on.token_ids[0]
    # the system turn's first block in prompt 1, all but the last token of prompt 2
    assert on.num_cached_prefill_tokens >= 16 + len(on.prompt_token_ids[2]) - 1
