"""Property tests of every public op against its oracle (``tests/op_cases.py``), with
hypothesis drawing the sizes (1 and awkward ones), the dtype, the option values, row inputs as
views of wider buffers, and NaN/+-inf/-0.0/subnormal values:

* the results -- outputs and every argument after the call (in-place results; inputs that must
  stay unmodified) -- equal the oracle's: bit for bit where the math is elementwise, under the
  tolerance table otherwise (each case's ``compare``);
* a call the op rejects raises a loomnb error and modifies nothing.

The simulator pass runs a fixed, derandomised budget per op (CI); the GPU pass runs the same
properties on the H200 with ``LOOMNB_FUZZ_EXAMPLES`` examples per op (default 30), where the
kernels run libdevice's math and the hardware conversions.
"""

import copy
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import loomnb
from family import assert_bits, bits
from op_cases import CASES, Draws, assert_same, to_device, to_host

ERRORS = (loomnb.LoomnbValueError, loomnb.LoomnbTypeError)
SIM_EXAMPLES = int(os.environ.get("LOOMNB_FUZZ_SIM_EXAMPLES", "6"))
GPU_EXAMPLES = int(os.environ.get("LOOMNB_FUZZ_EXAMPLES", "30"))


def _arrays(x):
    if isinstance(x, dict):
        x = tuple(x.values())
    flat = [e for a in x for e in (a if isinstance(a, list) else (a,))]  # Tensor[] arguments
    return [a for a in flat if isinstance(a, np.ndarray)]


def check_case(name, dims, kind, special, seed, mode):
    c = CASES[name]
    args, kwargs = c.build(Draws(seed), dims, kind, special)
    oracle_args = copy.deepcopy((args, kwargs))
    before = copy.deepcopy((args, kwargs))
    what = f"{name} {kind} {dims} special={special} seed={seed}"
    if mode == "gpu":
        import torch
        args, kwargs = to_device(args), to_device(kwargs)
    try:
        got = getattr(loomnb, name)(*args, **kwargs)
    except ERRORS as e:
        after = (to_host(args), to_host(kwargs)) if mode == "gpu" else (args, kwargs)
        for a, b in zip(_arrays(after[0]) + _arrays(after[1]), _arrays(before[0]) + _arrays(before[1])):
            assert_bits(a, b, f"{what}: a rejected call modified an argument")
        raise AssertionError(f"{what}: a generated call was rejected: {e}") from e
    if mode == "gpu":
        torch.cuda.synchronize()
        got, args = to_host(got), to_host(args)
    with np.errstate(all="ignore"):
        want = getattr(loomnb.oracle, name)(*oracle_args[0], **oracle_args[1])
    c.compare(got, want, kind, what, mode, inputs=before[0])
    for i, (a, a_oracle, a_before) in enumerate(zip(_arrays(args), _arrays(oracle_args[0]),
                                                    _arrays(before[0]))):
        if np.array_equal(bits(a_oracle), bits(a_before)):  # an input: must be unmodified
            assert_same(a, a_before, f"{what}: argument {i} was modified")
        else:  # mutated in place: as the oracle mutates it
            c.compare(a, a_oracle, kind, f"{what}: argument {i} after the call", mode,
                      inputs=before[0])


def _draw(data, c):
    dims = dict(c.dims)
    for k, (lo, hi) in sorted(c.ranges.items()):
        dims[k] = data.draw(st.integers(lo, hi), label=k)
    kind = data.draw(st.sampled_from(c.kinds), label="kind")
    special = c.specials and data.draw(st.booleans(), label="special")
    seed = data.draw(st.integers(0, 2 ** 32 - 1), label="seed")
    return dims, kind, special, seed


COMMON = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck),
              print_blob=True, phases=(Phase.explicit, Phase.generate, Phase.shrink))


def run_property(name, mode, examples):
    """Hypothesis over ``name``'s case: ``examples`` derandomised draws, each checked in ``mode``."""
    @settings(max_examples=examples, derandomize=True, **COMMON)
    @given(data=st.data())
    def prop(data):
        check_case(name, *_draw(data, CASES[name]), mode=mode)
    prop()


@pytest.mark.sim
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", sorted(CASES))
def test_op_equals_oracle_sim(name):
    run_property(name, "sim", SIM_EXAMPLES)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", sorted(CASES))
def test_op_equals_oracle_gpu(name):
    run_property(name, "gpu", GPU_EXAMPLES)
