"""The decode loop sampling through the sampler family (``loomnb.models.sampling_params``):
the parameters' checks, the loop's reproducibility (a seed gives the same tokens on every run,
padded or not, on the loomnb oracles and the torch reference), the state's bookkeeping, and
``loomnb generate``'s sampling options. Tiny random-weight models, no GGUF (one CLI case with
the GGUF is in test_model.py's style, skipped without it)."""

import math
import re

import numpy as np
import pytest
import torch

from loomnb import oracle
from loomnb.models import graphs as graphs_mod
from loomnb.models.backends import LoomnbCpuOps, TorchReferenceOps, get_backend
from loomnb.models.cli import main
from loomnb.models.sampling_params import SamplerState, SamplingParams

from test_model import tiny_llama

PROMPTS = [[1, 2, 3, 4, 5], list(range(40, 75)), [9, 8]]
HOT = dict(temperature=1.3, top_k=40, top_p=0.95, min_p=0.01, seed=1234)


@pytest.mark.parametrize("field, value, match", [
    ("temperature", -0.1, "temperature must be >= 0"),
    ("temperature", float("nan"), "temperature must be a finite number"),
    ("top_k", -2, "top_k must be -1, 0"),
    ("top_k", 2.0, "top_k must be an int"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("min_p", -0.5, r"min_p must be in \[0, 1\]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("frequency_penalty", 2.5, r"frequency_penalty must be in \[-2, 2\]"),
    ("presence_penalty", -3.0, r"presence_penalty must be in \[-2, 2\]"),
    ("seed", -1, r"seed must be in \[0, 2\^63\)"),
    ("seed", "7", "seed must be an int or None"),
    ("logprobs_mode", "processed", "logprobs_mode must be 'raw_logprobs' or "
                                   "'processed_logprobs'"),
])
def test_sampling_params_reject_out_of_range_values(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


def test_greedy_is_the_default_and_penalties_make_it_sampled():
    assert SamplingParams().is_greedy and not SamplingParams().penalized
    assert not SamplingParams(temperature=0.5).is_greedy
    p = SamplingParams(presence_penalty=0.5)
    assert p.penalized and not p.is_greedy  # greedy rows of penalised logits: the sampler path


@pytest.mark.parametrize("backend", ["loomnb-cpu", "torch-reference"])
def test_a_seed_gives_the_same_tokens_padded_or_not(backend):
    """cuda_graphs=True on the CPU runs the padded step (bucket 4 for 3 prompts): the sampled
    tokens, logprobs and ranks equal the unpadded loop's; a second run repeats them; another
    seed gives other tokens."""
    model = tiny_llama()
    p = SamplingParams(**HOT, repetition_penalty=1.2, frequency_penalty=0.3)
    plain = model.new_runner(backend, 16).generate(PROMPTS, 8, sampling=p)
    padded = model.new_runner(backend, 16).generate(PROMPTS, 8, sampling=p, cuda_graphs=True)
    again = model.new_runner(backend, 16).generate(PROMPTS, 8, sampling=p)
    assert padded.decode_batch == 4 and plain.sampling == p
    assert padded.token_ids == plain.token_ids == again.token_ids
    assert padded.token_logprobs == plain.token_logprobs
    assert padded.token_ranks == plain.token_ranks
    other = model.new_runner(backend, 16).generate(
        PROMPTS, 8, sampling=SamplingParams(**{**HOT, "seed": 99}))
    assert other.token_ids != plain.token_ids
    greedy = model.new_runner(backend, 16).generate(PROMPTS, 8)
    assert greedy.sampling is None and greedy.token_ids != plain.token_ids


def test_loomnb_oracles_sample_the_torch_references_tokens():
    """The loomnb-cpu backend (the sampler's oracles) and torch-reference (torch penalties, the
    oracle's draw) give the same tokens; the loomnb ops are named in the result."""
    model = tiny_llama()
    p = SamplingParams(**HOT, presence_penalty=0.5, repetition_penalty=1.3)
    a = model.new_runner("loomnb-cpu", 16).generate(PROMPTS, 10, sampling=p)
    b = model.new_runner("torch-reference", 16).generate(PROMPTS, 10, sampling=p)
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose(a.token_logprobs, b.token_logprobs, rtol=0, atol=1e-5)
    assert "top_k_top_p_sampling_from_logits" in a.loomnb_ops
    assert "top_k_top_p_sampling_from_logits" not in b.loomnb_ops


def test_torch_penalties_equal_the_oracle_bit_for_bit():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 64)) * 3).astype(np.float32)
    x[0, :3] = [np.inf, -np.inf, 0.0]
    pm = rng.random((3, 64)) < 0.2
    c = np.where(rng.random((3, 64)) < 0.3, rng.integers(1, 5, (3, 64)), 0).astype(np.int32)
    rep = np.array([1.3, 1.0, 0.7], np.float32)
    freq = np.array([0.2, 0.0, -0.5], np.float32)
    pres = np.array([0.4, -1.0, 0.0], np.float32)
    want = x.copy()
    oracle.apply_penalties_(want, pm, c, rep, freq, pres)
    got = torch.from_numpy(x.copy())
    TorchReferenceOps.apply_penalties_(got, *(torch.from_numpy(a) for a in (pm, c, rep, freq,
                                                                             pres)))
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("penalty", [1.2, 1.0])  # without a penalty nothing is counted
def test_sampler_state_counts_the_sampled_tokens_and_advances(penalty):
    p = SamplingParams(temperature=1.0, seed=5, repetition_penalty=penalty)
    st = SamplerState(p, 3, 50, "cpu")
    st.load([[1, 2], [3]])
    assert st.prompt_mask[0, [1, 2]].all() and st.prompt_mask.sum() == 3
    assert st.seeds.tolist() == [5, 5, 0]
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).bfloat16()
    ops = LoomnbCpuOps()
    ids0, _, _ = st.sample(ops, logits)
    st.advance()
    ids1, lp, rank = st.sample(ops, logits)
    assert int(st.offset) == 1
    want = torch.zeros(3, 50, dtype=torch.int32)
    for ids in (ids0, ids1):
        want[torch.arange(3), ids] += 1
    assert torch.equal(st.output_counts, want if p.penalized else torch.zeros_like(want))
    lf = logits.float()
    want_lp = torch.log_softmax(lf, -1).gather(1, ids1.view(-1, 1)).view(-1)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-6)
    assert (rank >= 1).all()
    with pytest.raises(ValueError, match="4 prompts for a SamplerState of 3 rows"):
        st.load([[1]] * 4)


def test_processed_logprobs_are_those_of_the_logits_the_draw_saw():
    """logprobs_mode="processed_logprobs": the sampled token's log-softmax and rank over the
    penalised logits divided by T with the dropped tokens at -inf (torch's log_softmax of the
    oracle's mask here); the same tokens as raw mode; both backends agree."""
    p = SamplingParams(temperature=0.7, top_k=6, top_p=0.8, seed=3, repetition_penalty=1.2)
    pp = SamplingParams(**{**p.__dict__, "logprobs_mode": "processed_logprobs"})
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = {}
    for params in (p, pp):
        st = SamplerState(params, 3, 50, "cpu")
        st.load([[1, 2], [3], [4, 5, 6]])
        out[params.logprobs_mode] = st.sample(LoomnbCpuOps(), logits)
    (ids, lp_raw, _), (ids_p, lp, rank) = out["raw_logprobs"], out["processed_logprobs"]
    assert torch.equal(ids, ids_p)
    x = logits.float()
    oracle.apply_penalties_(x.numpy(), st.prompt_mask.numpy(), np.zeros((3, 50), np.int32),
                            np.full(3, 1.2, np.float32), np.zeros(3, np.float32),
                            np.zeros(3, np.float32))
    y = torch.from_numpy(oracle.top_k_top_p_mask_logits(x.numpy(), 6, 0.8, temperature=0.7))
    assert int((y != -torch.inf).sum(1).max()) <= 6
    want = torch.log_softmax(y, -1)
    tok = want.gather(1, ids.view(-1, 1))
    torch.testing.assert_close(lp, tok.view(-1), rtol=0, atol=1e-6)
    assert torch.equal(rank, (want >= tok).sum(-1))
    assert (lp > lp_raw).all(), "the kept set's mass is renormalised"
    model = tiny_llama()
    a = model.new_runner("loomnb-cpu", 16).generate(PROMPTS, 6, sampling=pp)
    b = model.new_runner("torch-reference", 16).generate(PROMPTS, 6, sampling=pp)
    assert a.token_ids == b.token_ids and "top_k_top_p_mask_logits" in a.loomnb_ops
    np.testing.assert_allclose(a.token_logprobs, b.token_logprobs, rtol=0, atol=1e-5)


def test_equal_prompts_with_one_seed_sample_alike():
    """vLLM's seeded requests: the same seed and prompt give the same tokens in one batch."""
    model = tiny_llama()
    out = model.new_runner("loomnb-cpu", 16).generate([[5, 6, 7]] * 2 + [[8]], 6,
                                                      sampling=SamplingParams(**HOT))
    assert out.token_ids[0] == out.token_ids[1]
    unseeded = model.new_runner("loomnb-cpu", 16).generate(
        [[5, 6, 7]] * 2, 6, sampling=SamplingParams(**{**HOT, "seed": None}))
    assert unseeded.token_ids[0] != unseeded.token_ids[1]  # a fresh seed per row


def test_teacher_forcing_does_not_sample():
    model = tiny_llama()
    with pytest.raises(ValueError, match="teacher forcing"):
        model.new_runner("loomnb-cpu", 16).generate(PROMPTS, 3, forced_token_ids=[[1] * 3] * 3,
                                                    sampling=SamplingParams(**HOT))


@pytest.mark.parametrize("argv, message", [
    (["--top-p", "1.5"], r"--top-p must be in \(0, 1\]; got 1.5"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--temperature", "0.7", "--speculative", "ngram", "--check-reference"],
     "--check-reference cannot compare them"),
    (["--presence-penalty", "3"], r"--presence-penalty must be in \[-2, 2\]"),
    (["--logprobs-mode", "processed_logprobs"], "--logprobs-mode chooses what --logprobs "
                                                "reports"),
])
def test_cli_rejects_bad_sampling_options_before_loading(argv, message, capsys):
    rc = main(["generate", "--prompt", "hi", *argv])
    assert rc == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err), err


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_graphed_sampled_decode_equals_the_eager_padded_step(monkeypatch, mode):
    """On a GPU: the loomnb-cuda sampled decode through CUDA graphs (the offset advanced on the
    device inside the graph) gives the eager padded step's tokens and logprobs exactly, in
    both logprobs modes."""
    model = tiny_llama("cuda")
    p = SamplingParams(**HOT, repetition_penalty=1.2, frequency_penalty=0.2, logprobs_mode=mode)
    g = model.new_runner("loomnb-cuda", 16).generate(PROMPTS, 12, sampling=p, cuda_graphs=True)
    assert g.cuda_graphs and g.graph_capture_time_s > 0
    with monkeypatch.context() as m:
        m.setattr(graphs_mod.DecodeGraphs, "capture", lambda self: None)
        m.setattr(graphs_mod.DecodeGraphs, "step", lambda self: self._body(self._current()))
        e = model.new_runner("loomnb-cuda", 16).generate(PROMPTS, 12, sampling=p,
                                                         cuda_graphs=True)
    assert g.token_ids == e.token_ids and g.token_logprobs == e.token_logprobs
    again = model.new_runner("loomnb-cuda", 16).generate(PROMPTS, 12, sampling=p,
                                                         cuda_graphs=True)
    assert again.token_ids == g.token_ids


def counting_model(device="cpu"):
    """A tiny model whose one layer adds nothing (zero output projections) and whose head
    predicts token + 1 (the embedding shifted by one row): it continues 1, 2, 3, ..."""
    model = tiny_llama(device, num_layers=1)
    model.layers[0].o_proj.zero_()
    model.layers[0].down_proj.zero_()
    model.lm_head = torch.roll(model.embed_tokens, 1, 0).contiguous()
    return model


def _speculative(model, prompts, n, sampling, k=3, backend="loomnb-cpu"):
    from loomnb.models.speculative import SpeculativeRunner

    runner = SpeculativeRunner(model, LoomnbCpuOps() if backend == "loomnb-cpu" else
                               TorchReferenceOps(), 4 * len(prompts) + 8)
    return runner.generate_speculative(prompts, n, num_speculative_tokens=k,
                                       prompt_lookup_min=1, prompt_lookup_max=2,
                                       sampling=sampling, logprobs=True)


def test_chain_speculative_is_reproducible_and_accepts_drafts():
    """A model whose one layer adds nothing (zero output projections) and whose head predicts
    token + 1 (its lm_head the embedding shifted by one row) continues 1, 2, 3, ...: the n-gram
    drafts are its own continuation and sampling at T = 0.2 accepts them; a seed repeats the
    tokens, another changes them."""
    counter = counting_model()
    hot = _speculative(counter, [[1, 2, 3, 4, 5, 6, 1, 2]], 6,
                       SamplingParams(temperature=0.2, seed=1))
    assert hot.token_ids == [[3, 4, 5, 6, 7, 8]]
    assert hot.num_accepted_tokens >= 3 and hot.num_steps < 6
    model = tiny_llama()
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8], [5, 6, 5, 6, 5]]
    p = SamplingParams(temperature=0.6, top_k=5, seed=21)
    a = _speculative(model, prompts, 10, p)
    b = _speculative(model, prompts, 10, p)
    c = _speculative(model, prompts, 10, SamplingParams(temperature=0.6, top_k=5, seed=22))
    assert a.token_ids == b.token_ids and a.token_logprobs == b.token_logprobs
    assert c.token_ids != a.token_ids
    assert all(len(t) == 10 for t in a.token_ids) and a.num_draft_tokens > 0
    assert "chain_speculative_sampling" in a.loomnb_ops
    # the torch reference samples through the same oracles: the same tokens
    assert _speculative(model, prompts, 10, p, backend="torch-reference").token_ids == a.token_ids


def test_speculative_sampling_penalises_each_position_with_the_drafts_before_it():
    """With penalties, row j of a sequence's pass is penalised with the sequence's counts plus
    its drafts 0..j-1 (vLLM's rejection sampler), bit for bit the oracle's penalties of those
    counts; the emitted tokens are counted. End to end: num_speculative_tokens=0 gives the plain
    penalised loop's tokens, drafts are accepted, and the torch reference agrees."""
    from loomnb.models.speculative import SpeculativeRunner, _Pass

    V, k = 30, 3
    p = SamplingParams(temperature=0.9, seed=2, repetition_penalty=1.4, frequency_penalty=0.5,
                       presence_penalty=0.3)
    st = SamplerState(p, 2, V, "cpu")
    st.load([[1, 2], [3]])
    st.output_counts[0, 5] = 2
    logits = torch.randn(2 * (k + 1), V, generator=torch.Generator().manual_seed(3))
    drafts = torch.tensor([7, 5, -1, 9, 9, 4], dtype=torch.int32)
    counter = counting_model()
    ps = _Pass(SpeculativeRunner(counter, LoomnbCpuOps(), 16), torch.zeros(2, 4, dtype=torch.int32),
               k, False, 0, sampler=st)
    got = st.penalized_pass_logits(LoomnbCpuOps(), logits, ps.row_seq, ps.pos_rows,
                                   ps.pos_drafts, drafts)
    for s in range(2):
        for j in range(k + 1):
            counts = st.output_counts[s].clone()
            for d in drafts[s * k: s * k + j].tolist():
                if d >= 0:
                    counts[d] += 1
            want = logits[s * (k + 1) + j].numpy().copy()[None]
            oracle.apply_penalties_(want, st.prompt_mask[s:s + 1].numpy(), counts[None].numpy(),
                                    *(np.array([v], np.float32) for v in (1.4, 0.5, 0.3)))
            assert np.array_equal(got[s * (k + 1) + j].numpy().view(np.uint32),
                                  want[0].view(np.uint32)), (s, j)
    st.count(torch.tensor([[7, 5, -1, -1], [9, -1, -1, -1]]))
    assert st.output_counts[0, 7] == 1 and st.output_counts[0, 5] == 3
    assert st.output_counts[1, 9] == 1 and int(st.output_counts.sum()) == 5

    prompts = [[1, 2, 3, 4, 5, 6, 1, 2], [5, 6, 5, 6, 5]]
    hot = SamplingParams(temperature=0.2, seed=1, frequency_penalty=0.1)
    plain = counter.new_runner("loomnb-cpu", 16).generate(prompts, 6, sampling=hot)
    assert _speculative(counter, prompts, 6, hot, k=0).token_ids == plain.token_ids
    a = _speculative(counter, prompts, 6, hot)
    assert a.num_accepted_tokens > 0
    assert _speculative(counter, prompts, 6, hot, backend="torch-reference").token_ids == \
        a.token_ids == _speculative(counter, prompts, 6, hot).token_ids


def test_speculative_processed_logprobs_are_the_verifiers():
    """logprobs_mode="processed_logprobs" with speculation: the same tokens as raw mode; a
    pass without drafts gives the plain loop's processed logprobs exactly; a draft pass the
    log-softmax of the verifier's kept logits over T (``SamplerState.target_logits``), so
    each emitted token's processed logprob is finite and at least its raw one here (T < 1,
    tokens dropped)."""
    import dataclasses

    counter = counting_model()
    prompts = [[1, 2, 3, 4, 5, 6, 1, 2], [5, 6, 5, 6, 5]]
    raw = SamplingParams(temperature=0.5, top_k=8, seed=3, presence_penalty=0.2)
    pro = dataclasses.replace(raw, logprobs_mode="processed_logprobs")
    plain = counter.new_runner("loomnb-cpu", 16).generate(prompts, 6, sampling=pro)
    k0 = _speculative(counter, prompts, 6, pro, k=0)
    assert k0.token_ids == plain.token_ids and k0.token_logprobs == plain.token_logprobs
    a, b = _speculative(counter, prompts, 6, raw), _speculative(counter, prompts, 6, pro)
    assert a.token_ids == b.token_ids and b.num_accepted_tokens > 0
    for lr, lp in zip(a.token_logprobs, b.token_logprobs):
        assert all(math.isfinite(y) and y >= x - 1e-6 for x, y in zip(lr, lp)), (lr, lp)
    assert "top_k_top_p_mask_logits" in b.loomnb_ops


@pytest.mark.parametrize("k, p, mp, t", [(0, 1.0, 0.0, 1.0), (6, 1.0, 0.0, 0.7),
                                         (0, 0.7, 0.0, 1.0), (8, 0.5, 0.0, 1.3),
                                         (0, 1.0, 0.15, 1.0), (5, 0.8, 0.05, 0.9)])
def test_speculation_verifies_against_the_samplers_distribution(k, p, mp, t):
    """``SamplerState.target_probs`` (the distribution ``chain_speculative_sampling`` checks
    drafts against) is the sampler's: the tokens the sampler keeps (vLLM's reading of the
    filters, as the sampler's oracle tests define it), their temperature softmax renormalised,
    zero elsewhere (distinct logits: no ties at a boundary)."""
    from test_sampler_oracle import reference_kept

    rng = np.random.default_rng(3)
    x = rng.permutation(np.linspace(3.0, -3.0, 40)).astype(np.float32)
    st = SamplerState(SamplingParams(temperature=t, top_k=k, top_p=p, min_p=mp), 2, 40, "cpu")
    got = st.target_probs(torch.from_numpy(np.stack([x, x[::-1].copy()])))
    for row, xr in zip(got.numpy(), (x, x[::-1])):
        keep = reference_kept(xr, k, p, mp, t, False)
        q = np.where(keep, np.exp(xr.astype(np.float64) / t - xr.max() / t), 0)
        np.testing.assert_allclose(row, q / q.sum(), rtol=2e-6, atol=1e-9)
        assert ((row > 0) == keep).all()


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [{}, dict(frequency_penalty=0.1, presence_penalty=0.1,
                                            logprobs_mode="processed_logprobs")])
def test_chain_speculative_on_the_gpu_graphed_and_eager(extra):
    """loomnb-cuda: the counting model's speculative sampling, CUDA-graphed and eager, gives
    the same tokens (1 -> 2 -> 3 ...) and logprobs, accepting drafts; with penalties and
    processed logprobs too (the graph's warm-up neither draws nor counts)."""
    from loomnb.models.speculative import SpeculativeRunner

    counter = counting_model("cuda")
    outs = []
    for graph in (True, False):
        runner = SpeculativeRunner(counter, get_backend("loomnb-cuda", "cuda"), 16)
        outs.append(runner.generate_speculative(
            [[1, 2, 3, 4, 5, 6, 1, 2], [5, 6, 5, 6, 5]], 6, num_speculative_tokens=3,
            prompt_lookup_min=1, prompt_lookup_max=2, cuda_graph=graph, logprobs=True,
            sampling=SamplingParams(temperature=0.2, seed=1, **extra)))
    assert outs[0].token_ids == outs[1].token_ids
    assert outs[0].token_logprobs == outs[1].token_logprobs
    if not extra:
        assert outs[0].token_ids[0] == [3, 4, 5, 6, 7, 8]
    assert outs[0].num_accepted_tokens >= 3
