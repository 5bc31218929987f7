"""Generation stops at end-of-text, as engines do (``loomnb.models``): each sequence at its first
stop token (kept in ``token_ids``, cut from the text), the batch when every sequence has; the
unpadded loop, the padded (CUDA-graph bucket) steps and the speculative loop agree, and
``ignore_eos`` / no stop tokens decode every step. Tiny random models, no GGUF: the SmolLM2
checks are in ``test_model.py`` and ``test_cli.py``."""

import pytest
import torch

from loomnb.models.llama import compare_greedy
from loomnb.models.speculative import SpeculativeRunner, batch_invariant_linear

from test_model import tiny_llama
from test_speculative_loop import CYCLE, copy_llama

PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11], [5, 6]]
NEW = 8


def first_stop(ids, stops):
    return next((i for i, t in enumerate(ids) if t in stops), None)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def full(model):
    """The tokens of every step, nothing stopping."""
    return model.new_runner("loomnb-cpu", 16).generate(PROMPTS, NEW, num_top_logits=3)


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_each_sequence_stops_at_its_first_stop_token(model, full, cuda_graphs):
    # a stop token for every sequence, met at steps 2, 4 and 3 (or earlier, where it recurs)
    stops = {full.token_ids[0][2], full.token_ids[1][4], full.token_ids[2][3]}
    ends = [first_stop(ids, stops) for ids in full.token_ids]
    got = model.new_runner("loomnb-cpu", 16).generate(PROMPTS, NEW, num_top_logits=3,
                                                      cuda_graphs=cuda_graphs,
                                                      stop_token_ids=stops)
    assert got.token_ids == [ids[:e + 1] for ids, e in zip(full.token_ids, ends)]
    assert [len(lp) for lp in got.token_logprobs] == [e + 1 for e in ends]
    assert [len(rk) for rk in got.token_ranks] == [e + 1 for e in ends]
    assert got.token_logprobs == [lp[:e + 1] for lp, e in zip(full.token_logprobs, ends)]
    assert got.num_decode_steps == max(ends) < NEW - 1  # the batch ends with its last sequence
    assert got.num_decode_tokens == sum(ends)
    assert got.top_logits[0].shape == (len(PROMPTS), max(ends) + 1, 3)
    assert got.tpot_s == pytest.approx(got.decode_time_s / max(ends))
    assert compare_greedy(got, got) == [("identical", None)] * len(PROMPTS)


def test_a_sequence_that_never_stops_keeps_the_batch_going(model, full):
    stops = {full.token_ids[0][1]} - set(full.token_ids[1])
    assert stops, "the test needs a token of sequence 0 that sequence 1 never emits"
    got = model.new_runner("loomnb-cpu", 16).generate(PROMPTS, NEW, stop_token_ids=stops)
    assert got.num_decode_steps == NEW - 1 and len(got.token_ids[1]) == NEW
    assert len(got.token_ids[0]) == first_stop(full.token_ids[0], stops) + 1


def test_a_stop_token_from_the_prefill_ends_the_sequence_at_once(model, full):
    stops = {ids[0] for ids in full.token_ids}
    got = model.new_runner("loomnb-cpu", 16).generate(PROMPTS, NEW, stop_token_ids=stops)
    assert got.token_ids == [ids[:1] for ids in full.token_ids]
    assert got.num_decode_steps == 0 and got.num_decode_tokens == 0


def test_no_stop_tokens_decodes_every_step(model, full):
    got = model.new_runner("loomnb-cpu", 16).generate(PROMPTS, NEW, stop_token_ids=())
    assert got.token_ids == full.token_ids and got.num_decode_steps == NEW - 1
    with pytest.raises(ValueError, match="teacher forcing"):
        model.new_runner("loomnb-cpu", 16).generate(PROMPTS, NEW, stop_token_ids={1},
                                                    forced_token_ids=full.token_ids)


def test_compare_greedy_sees_a_sequence_that_stopped_early(model, full):
    """One run stopped where the other did not: equal common tokens, different lengths."""
    import copy

    short = copy.copy(full)
    short.token_ids = [full.token_ids[0][:3]] + full.token_ids[1:]
    assert compare_greedy(short, full)[0] == ("mismatch", 3)


@pytest.mark.parametrize("backend", ["torch-reference", "loomnb-cpu"])
def test_speculative_loop_stops_where_plain_greedy_stops(backend):
    """The copy model cycles through 12 tokens; stop token 5 ends each sequence at its first 5
    (kept), also when a pass emitted it among accepted drafts; logprobs and ranks come for every
    kept token and equal plain greedy decoding's."""
    from loomnb.models.backends import get_backend

    model = copy_llama(torch.float32)
    prompts = [[30, 31, 3, 4, 5, 6], [40, 2, 3, 9, 2, 3], [7], [50, 51, 52]]
    stops = {5}
    with batch_invariant_linear():
        ref = model.new_runner(backend, 64).generate(prompts, 30, stop_token_ids=stops)
        runner = SpeculativeRunner(model, get_backend(backend, model.device), 64)
        got = runner.generate_speculative(prompts, 30, stop_token_ids=stops, logprobs=True)
    assert got.token_ids == ref.token_ids
    for ids in got.token_ids:
        assert ids[-1] == 5 and 5 not in ids[:-1] and len(ids) <= CYCLE
    assert [len(lp) for lp in got.token_logprobs] == [len(t) for t in got.token_ids]
    assert got.token_ranks == ref.token_ranks
    flat = lambda lists: [v for lp in lists for v in lp]  # noqa: E731
    assert flat(got.token_logprobs) == pytest.approx(flat(ref.token_logprobs), abs=1e-6)
    assert got.num_decode_tokens == sum(len(t) - 1 for t in got.token_ids)
    assert got.num_accepted_tokens > 0


def test_benchmarks_decode_every_step_whatever_the_stop_tokens(tmp_path):
    """kv_fp8_quality.py compares the bf16 and FP8 caches over all max_new_tokens positions
    (ignore_eos), also when the model emits its stop token at once."""
    import sys
    from pathlib import Path

    from loomnb.models import llama
    from test_cli import write_tiny_gguf

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import kv_fp8_quality as Q

    model = llama.load_model(write_tiny_gguf(tmp_path / "tiny.gguf"), device="cpu")
    first = model.generate(["the tea"], 1, backend="loomnb-cpu").token_ids[0][0]
    model.tokenizer.stop_token_ids = frozenset({first})
    assert model.generate(["the tea"], 4, backend="loomnb-cpu").token_ids == [[first]]
    report = Q.evaluate(model, ["the tea"], 4, backend="loomnb-cpu", top_k=3)
    assert report["logprob"]["positions"] + report["logprob"]["outside_top_k"] == 4
