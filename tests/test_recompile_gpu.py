"""A serving loop whose batch (or context) grows must never stop for a JIT compile: for every
public op (``tests/op_cases.py``), in a fresh kernel registry -- so the result does not depend
on which tests ran before in this process -- the first call compiles everything a later call of
another num_tokens / num_seqs / context length can launch (``_launch.launch(warm=)``), and the
calls at the other sizes compile nothing."""

import numpy as np
import pytest

import loomnb
from loomnb.ops import _launch as L
from op_cases import CASES, Draws, to_device

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

# sizes each grown dim takes: past every size rule of the families (activation: 1, 2 and 4
# units a thread at 33,792 and 2^20 units; attention: 1/2/4 heads a CTA, the vector lanes past
# a wave, the split merge from 256 tokens)
SIZES = {"num_tokens": (1, 3, 250, 20000, 400000), "num_rows": (1, 3, 250, 20000),
         "num_reqs": (1, 3, 250, 2000), "num_seqs": (1, 3, 64, 300),
         "seq_len": (1, 40, 300, 5000)}
GROWN = [(name, dim) for name in sorted(CASES)
         for dim in ((CASES[name].recompile_dim,) if isinstance(CASES[name].recompile_dim, str)
                     else CASES[name].recompile_dim) if dim]


def test_every_op_declares_what_a_serving_loop_grows():
    assert {n for n, _ in GROWN} == set(CASES)
    assert all(dim in SIZES for _, dim in GROWN)


def _compiled():
    return {k: len(v._handles) for k, v in L._kernels.items() if v._handles}


@pytest.mark.parametrize("name, dim", GROWN)
def test_a_new_size_compiles_nothing(name, dim, monkeypatch):
    c = CASES[name]
    for attr in ("_kernels", "_dispatchers"):
        monkeypatch.setattr(L, attr, {})
    monkeypatch.setattr(L, "_warmed", set())
    L.clear_launch_cache()
    kind = c.kinds[0]
    before = None
    for n in SIZES[dim]:
        d = dict(c.dims, **{dim: n})
        if name == "paged_decode_attention" and dim == "num_seqs":
            d["seq_len"] = 8
        args, kwargs = c.build(Draws(0), d, kind, False)
        getattr(loomnb, name)(*to_device(args), **to_device(kwargs))
        torch.cuda.synchronize()
        if before is None:
            before = _compiled()
            assert before, "the first call compiled its kernel"
    after = _compiled()
    new = {str(k[1]) for k in after.keys() - before.keys()}
    assert after == before, f"{name}: a new {dim} compiled {sorted(new)}"
