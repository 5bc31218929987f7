"""The no-recompile rule checked without a GPU: under the simulator every op runs its whole
host path -- validation, launch rules, parameters -- with the kernel launch itself stubbed
out, at each size a serving loop grows through (``test_recompile_gpu.SIZES``), and every
variant a later size launches must be one the first call launched or compiled beside it
(``_launch.launch(warm=)``). ``tests/test_recompile_gpu.py`` checks the same on the H200 with
real compiles."""

import numpy as np
import pytest

import loomnb
from loomnb.ops import _launch as L
from op_cases import CASES, Draws

pytestmark = pytest.mark.sim

SIZES = {"num_tokens": (1, 3, 250, 20000, 400000), "num_rows": (1, 3, 250, 20000),
         "num_reqs": (1, 3, 250, 2000), "num_seqs": (1, 3, 64, 300),
         "seq_len": (1, 40, 300, 5000)}
GROWN = [(name, dim) for name in sorted(CASES)
         for dim in ((CASES[name].recompile_dim,) if isinstance(CASES[name].recompile_dim, str)
                     else CASES[name].recompile_dim) if dim]


class _NoLaunch:
    def __getitem__(self, config):
        return lambda *args: None


@pytest.mark.parametrize("name, dim", GROWN)
def test_a_new_size_launches_only_what_the_first_call_compiled(name, dim, monkeypatch):
    c = CASES[name]
    monkeypatch.setattr(L, "kernel", lambda factory, spec, sig: _NoLaunch())
    monkeypatch.setattr(L, "_launched", set())
    monkeypatch.setattr(L, "_warmed", set())
    monkeypatch.setattr(L.ArrayParam, "sim_value", lambda self: None)
    first = None
    for n in SIZES[dim]:
        d = dict(c.dims, **{dim: n})
        if name == "paged_decode_attention" and dim == "num_seqs":
            d["seq_len"] = 8
        args, kwargs = c.build(Draws(0), d, c.kinds[0], False)
        L._launched.clear()
        getattr(loomnb, name)(*args, **kwargs)
        if first is None:
            first = set(L._launched)
            assert first, "the first call launched its kernel"
        else:
            new = {f"{f.__name__}({s})" for f, s, _ in L._launched - first}
            assert not new, f"{name}: {dim} = {n} launches what the first call did not compile: {sorted(new)}"
