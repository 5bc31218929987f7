"""Every public op x every zero-size dimension of its inputs (``tests/op_cases.py``: tokens,
hidden size, heads, head size, vocabulary, blocks, block size, draft length): the call is a
no-op whose results equal the oracle's, or a clear loomnb error that modified nothing -- never a
launch that faults the GPU (which would poison the caller's whole process). The registry covers
every op of ``loomnb.ops.OPS``, so a new op is swept as soon as it has a case.
"""

import copy

import numpy as np
import pytest

import loomnb
from conftest import HAS_GPU, SIM
from family import assert_bits
from op_cases import CASES, Draws, to_device, to_host

ZERO = [(name, dim) for name in sorted(CASES) for dim in CASES[name].zero]
ERRORS = (loomnb.LoomnbValueError, loomnb.LoomnbTypeError)


def test_every_op_has_a_case_with_its_zero_dimensions():
    assert sorted(CASES) == sorted(loomnb.ops.OPS), "tests/op_cases.py must cover every op"
    for c in CASES.values():
        assert c.zero and set(c.zero) <= set(c.dims), c.name
        assert set(c.ranges) <= set(c.dims), c.name


def test_every_oracle_has_its_ops_signature():
    """``loomnb.oracle.<name>`` takes the op's parameters, in its order, of the same kinds and
    defaults (what these tests call both with); it may add keyword-only test hooks with
    defaults (``form=`` of the RoPE oracles)."""
    import inspect
    for name in loomnb.ops.OPS:
        op = list(inspect.signature(getattr(loomnb, name)).parameters.values())
        ora = list(inspect.signature(getattr(loomnb.oracle, name)).parameters.values())
        shared = [p for p in ora if p.name in {q.name for q in op}]
        assert [(p.name, p.kind, p.default) for p in shared] == \
            [(p.name, p.kind, p.default) for p in op], name
        extra = [p for p in ora if p.name not in {q.name for q in op}]
        assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in extra), name


def _arrays(x):
    if isinstance(x, dict):
        x = tuple(x.values())
    flat = [e for a in x for e in (a if isinstance(a, list) else (a,))]  # Tensor[] arguments
    return [a for a in flat if isinstance(a, np.ndarray)]


def sweep_one(name, dim, device):
    c = CASES[name]
    d = dict(c.dims, **{dim: 0})
    args, kwargs = c.build(Draws(0), d, c.kinds[0], False)
    before = copy.deepcopy((args, kwargs))
    oracle_args = copy.deepcopy((args, kwargs))
    if device:
        import torch
        args, kwargs = to_device(args), to_device(kwargs)
    try:
        got = getattr(loomnb, name)(*args, **kwargs)
    except ERRORS as e:
        assert str(e).startswith(f"loomnb.{name}") or str(e).startswith("loomnb"), str(e)
        after = (to_host(args), to_host(kwargs)) if device else (args, kwargs)
        for a, b in zip(_arrays(after[0]) + _arrays(after[1]),
                        _arrays(before[0]) + _arrays(before[1])):
            assert_bits(a, b, f"{name} {dim}=0: a rejected call modified an argument")
        return "rejected"
    if device:
        torch.cuda.synchronize()  # a fault surfaces here
        got, args, kwargs = to_host(got), to_host(args), to_host(kwargs)
    want = getattr(loomnb.oracle, name)(*oracle_args[0], **oracle_args[1])
    c.compare(got, want, c.kinds[0], f"{name} {dim}=0", "gpu" if device else "sim")
    for a, b in zip(_arrays(args), _arrays(oracle_args[0])):
        assert_bits(a, b, f"{name} {dim}=0: arguments after the call")
    return "no-op"


@pytest.mark.sim
@pytest.mark.parametrize("name, dim", ZERO)
def test_zero_size_sim(name, dim):
    sweep_one(name, dim, device=False)


@pytest.mark.gpu
@pytest.mark.parametrize("name, dim", ZERO)
def test_zero_size_gpu(name, dim):
    sweep_one(name, dim, device=True)
