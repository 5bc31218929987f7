"""A serving loop whose batch (or context) grows must never stop for a JIT compile: for every
public op (``tests/op_cases.py``), in a fresh kernel registry -- so the result does not depend
on which tests ran before in this process -- the first call compiles everything a later call of
another num_tokens / num_seqs / context length can launch (``_launch.launch(warm=)``), and the
calls at the other sizes compile nothing."""

import pytest

import loomnb
from loomnb.ops import _launch as L
from op_cases import CASES, GROWN_SIZES, grown, grown_call, to_device

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

GROWN = grown()


def test_every_op_declares_what_a_serving_loop_grows():
    assert {n for n, _ in GROWN} == set(CASES)
    assert all(dim in GROWN_SIZES for _, dim in GROWN)


def _compiled():
    return {k: len(v._handles) for k, v in L._kernels.items() if v._handles}


@pytest.mark.parametrize("name, dim", GROWN)
def test_a_new_size_compiles_nothing(name, dim, monkeypatch):
    for attr in ("_kernels", "_dispatchers"):
        monkeypatch.setattr(L, attr, {})
    monkeypatch.setattr(L, "_warmed", set())
    L.clear_launch_cache()
    before = None
    for n in GROWN_SIZES[dim]:
        args, kwargs = grown_call(name, dim, n)
        getattr(loomnb, name)(*to_device(args), **to_device(kwargs))
        torch.cuda.synchronize()
        if before is None:
            before = _compiled()
            assert before, "the first call compiled its kernel"
    after = _compiled()
    new = {str(k[1]) for k in after.keys() - before.keys()}
    assert after == before, f"{name}: a new {dim} compiled {sorted(new)}"
