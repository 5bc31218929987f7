"""The launch scaffold on the CPU: parameters (one list -> signature, packed GPU values), the
fast-path key, and the replay of a remembered launch with a newly allocated output."""

import numpy as np
import pytest
import torch
from numba import types

from loomnb import _adapter as ad
from loomnb.ops import _launch as L

pytestmark = pytest.mark.nosim


def _arr(shape, strides, kind="bf16", ptr=0x10000):
    return ad.Arr(None, "torch", kind, "x", shape, strides, ptr, 0)


def test_one_parameter_list_gives_the_signature_and_the_packed_values():
    x = _arr((3, 4, 64), (512, 64, 1))
    params = [L.array(x, words=True), L.array(x), L.absent("float32", 1), L.f32(0.5), L.i64(7)]
    assert L.argtypes(params) == (types.Array(types.uint32, 3, "A"), types.Array(types.uint16, 3, "A"),
                                  types.Array(types.float32, 1, "A"), types.float32, types.int64)
    words = params[0]
    assert words.shape == (3, 4, 32) and words.strides == (256, 32, 1)
    # numba's array ABI: meminfo, parent, nitems, itemsize, data, shape..., byte strides...
    assert words.gpu_values() == (0, 0, 3 * 4 * 32, 4, 0x10000, 3, 4, 32, 1024, 128, 4)
    assert params[1].gpu_values() == (0, 0, 768, 2, 0x10000, 3, 4, 64, 1024, 128, 2)
    assert params[2].gpu_values() == (0, 0, 0, 4, 0, 0, 0)
    assert sum(p.nparams for p in params) == 11 + 11 + 7 + 1 + 1


def test_keys_take_the_checked_path_for_anything_unusual():
    a, b = torch.zeros(2, 8), torch.zeros(8)
    k = L.key("op", (1e-6,), a, b, None)
    assert k == ("op", (1e-6,), a.data_ptr(), a.shape, a.stride(), a.dtype,
                 b.data_ptr(), b.shape, b.stride(), b.dtype, None)
    assert L.key("op", (True,), a, b) is None, "True == 1.0 must not find the eps=1.0 launch"
    assert L.key("op", (1.0,), np.zeros(3), b) is None, "not a torch tensor"
    assert L.key3("op", 1e-6, "twice", a, b, None)[-1] is None
    assert L.key3("op", 1, "twice", a, b, None) is None and L.key3("op", 1.0, None, a, b, a) is None
    assert L.key("op", (1e-6,), a[:, ::2], b) != L.key("op", (1e-6,), a, b)


class _FakePrepared:
    device, params = 0, 123

    def __init__(self):
        self.slots, self.calls = {}, []

    def set_slot(self, slot, value):
        self.slots[slot] = value

    def driver_call(self, stream, params, extra):
        self.calls.append((stream, dict(self.slots)))
        return (L.CUDA_SUCCESS,)


def test_replay_allocates_outputs_again_and_points_the_launch_at_them(monkeypatch):
    monkeypatch.setattr(L, "_rt", (lambda: 0, lambda dev: 77, False))
    L.clear_launch_cache()
    x = ad.Arr(torch.zeros(4, 8), "torch", "f32", "float32", (4, 8), (8, 1), 0x1000, 0)
    out_t = torch.empty(4, 8)
    out = ad.Arr(out_t, "torch", "f32", "float32", (4, 8), (8, 1), out_t.data_ptr(), 0,
                 alloc=lambda: torch.empty(4, 8))
    view = out.view((2, 8), (16, 1), ptr=out_t.data_ptr() + 32)  # rows 1 and 3, say
    fake = _FakePrepared()
    L._remember(("k",), fake, [L.array(x), L.array(out), L.f32(1.0), L.array(view)])
    got = L.replay(("k",))
    assert len(got) == 1 and got[0].shape == (4, 8)
    stream, slots = fake.calls[-1]
    assert stream == 77
    # x takes slots 0-8, out 9-17 (data at 9 + 4), the scalar 18, the view 19-27 (data at 23)
    assert slots == {13: got[0].data_ptr(), 23: got[0].data_ptr() + 32}
    assert L.replay(("other",)) is None and L.launch_cache_info()["misses"] >= 1
    assert L.fill(got, None, "given") == (got[0], "given")
    L.clear_launch_cache()


def test_replay_runs_every_launch_of_a_two_launch_call(monkeypatch):
    """An op of two launches (a split pass and its merge) replays both, in order, and a buffer
    it allocated is patched into every launch that uses it."""
    monkeypatch.setattr(L, "_rt", (lambda: 0, lambda dev: 5, False))
    L.clear_launch_cache()
    ws_t = torch.empty(16)
    ws = ad.Arr(ws_t, "torch", "f32", "float32", (16,), (1,), ws_t.data_ptr(), 0,
                alloc=lambda: torch.empty(16))
    first, second = _FakePrepared(), _FakePrepared()
    order = []
    for name, fake in (("first", first), ("second", second)):
        real = fake.driver_call
        fake.driver_call = lambda stream, params, extra, real=real, name=name: (order.append(name), real(stream, params, extra))[1]
    L._remember_chain(("two",), [(first, [L.array(ws)]), (second, [L.f32(1.0), L.array(ws)])])
    got = L.replay(("two",))
    assert order == ["first", "second"]
    assert first.calls[-1][1] == {4: got[0].data_ptr()} and second.calls[-1][1] == {5: got[0].data_ptr()}
    L.clear_launch_cache()
