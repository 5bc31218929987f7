"""The per-family test template: what every family's tests check, written once.

A family's ``tests/test_<family>_sim.py`` parametrizes these over its ops and awkward shapes:

* :func:`call_both` runs ``loomnb.<name>`` and ``loomnb.oracle.<name>`` on separate copies of
  the same arguments and returns both results and both argument lists after the call (so
  in-place mutation is compared too); :func:`assert_bits` / ``helpers.assert_ulps`` compare;
* :func:`out_given_and_not` checks that ``out=`` is filled and returned, and equals the
  allocating call;
* :func:`block_size_sweep` runs a call under several forced block sizes (``loomnb.ops._launch.
  force_threads``): correctness must not depend on the launch configuration;
* :func:`rejects` is one row of an error-message table: the call raises the named error with the
  message, and no argument was modified;
* ``tests/test_<family>_gpu.py`` adds the GPU-only checks (``helpers`` there: no recompile for a
  new num_tokens, graph capture, streams), and ``tests/test_ptx.py`` compiles the family's
  ``variants()`` for sm_90.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

import loomnb
from loomnb.ops import _launch as L


def bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_bits(got, want, what=""):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert got.dtype.itemsize == want.dtype.itemsize, (what, got.dtype, want.dtype)
    diff = bits(got) != bits(want)
    assert not diff.any(), f"{what}: {int(diff.sum())} of {diff.size} elements differ; first at {np.argwhere(diff)[:3].tolist()}"


def call_both(name, *args, **kwargs):
    """(got, want, args after the op, args after the oracle) of ``loomnb.<name>`` and
    ``loomnb.oracle.<name>`` called on deep copies of the same arguments."""
    a1, k1 = copy.deepcopy(args), copy.deepcopy(kwargs)
    a2, k2 = copy.deepcopy(args), copy.deepcopy(kwargs)
    got = getattr(loomnb, name)(*a1, **k1)
    want = getattr(loomnb.oracle, name)(*a2, **k2)
    return got, want, a1, a2


def out_given_and_not(call, make_out):
    """``call(out=None)`` allocates; ``call(out=buf)`` fills ``buf``, returns it, equals it."""
    fresh = call(out=None)
    fresh = fresh[0] if isinstance(fresh, tuple) else fresh
    buf = make_out()
    res = call(out=buf)
    res = res[0] if isinstance(res, tuple) else res
    assert res is buf, "out= must be returned"
    assert_bits(buf, fresh, "out given vs allocated")


def block_size_sweep(call, check, threads=(32, 64, 128, 256)):
    for t in threads:
        with L.force_threads(t):
            check(call(), f"threads={t}")


def snapshot(*arrays):
    saved = [None if a is None else np.array(a, copy=True) for a in arrays]
    return lambda: all(a is None or np.array_equal(bits(a), bits(s)) for a, s in zip(arrays, saved))


def rejects(call, exc, match, *arrays):
    """One row of an error-message table: ``call()`` raises ``exc`` matching ``match`` before
    any launch, and none of ``arrays`` changed."""
    same = snapshot(*arrays)
    with pytest.raises(exc, match=match):
        call()
    assert same(), "a rejected call must not modify its arguments"


class Launched(AssertionError):
    """A contract test's call reached a kernel launch."""


@pytest.fixture
def no_launch(monkeypatch):
    """``loomnb.ops._launch.launch`` replaced by a function that raises :class:`Launched`: a
    rejected call must raise before any launch, an empty batch return before one (contract
    test files use it autouse: ``pytestmark = pytest.mark.usefixtures("no_launch")``)."""
    def launch(factory, *args, **kwargs):
        raise Launched(f"a contract test launched {getattr(factory, '__name__', factory)}")
    monkeypatch.setattr(L, "launch", launch)
