"""The no-recompile rule checked without a GPU: under the simulator every op runs its whole
host path -- validation, launch rules, parameters -- with the kernel launch itself stubbed
out, at each size a serving loop grows through (``op_cases.GROWN_SIZES``), and every
variant a later size launches must be one the first call launched or compiled beside it
(``_launch.launch(warm=)``). ``tests/test_recompile_gpu.py`` checks the same on the H200 with
real compiles."""

import pytest

import loomnb
from loomnb.ops import _launch as L
from op_cases import GROWN_SIZES, grown, grown_call

pytestmark = pytest.mark.sim

GROWN = grown()


class _NoLaunch:
    def __getitem__(self, config):
        return lambda *args: None


@pytest.mark.parametrize("name, dim", GROWN)
def test_a_new_size_launches_only_what_the_first_call_compiled(name, dim, monkeypatch):
    monkeypatch.setattr(L, "kernel", lambda factory, spec, sig: _NoLaunch())
    monkeypatch.setattr(L, "_launched", set())
    monkeypatch.setattr(L, "_warmed", set())
    monkeypatch.setattr(L.ArrayParam, "sim_value", lambda self: None)
    first = None
    for n in GROWN_SIZES[dim]:
        args, kwargs = grown_call(name, dim, n)
        L._launched.clear()
        getattr(loomnb, name)(*args, **kwargs)
        if first is None:
            first = set(L._launched)
            assert first, "the first call launched its kernel"
        else:
            new = {f"{f.__name__}({s})" for f, s, _ in L._launched - first}
            assert not new, f"{name}: {dim} = {n} launches what the first call did not compile: {sorted(new)}"
