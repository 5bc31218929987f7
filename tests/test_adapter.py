"""The adapter's reading of ``__cuda_array_interface__`` (v0-v3), checked on the CPU with the
device lookup stubbed: masks and unknown versions rejected, read-only exports marked (and then
rejected as outputs: ``test_norm_gpu.py``), ``strides: None`` as C-contiguous, zero-size arrays,
element strides, the producer stream of v3, and the dtype from the object, never the typestr."""

import numpy as np
import pytest

from loomnb import LoomnbTypeError, LoomnbValueError
from loomnb import _adapter as ad

pytestmark = pytest.mark.nosim


class CAI:
    def __init__(self, dtype, **cai):
        self.dtype = np.dtype(dtype)
        self.__cuda_array_interface__ = {"version": 3, "shape": (2, 3), "typestr": self.dtype.str,
                                         "data": (0x1000, False), "strides": None, **cai}


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch):
    monkeypatch.setattr(ad, "_device_of", lambda obj, lib, ptr: 0)


def test_plain_export():
    a = ad.wrap("op", "x", CAI("float32"))
    assert (a.kind, a.shape, a.strides, a.ptr, a.readonly, a.sync_stream) == (
        "f32", (2, 3), (3, 1), 0x1000, False, None)


def test_strides_in_bytes_become_elements():
    a = ad.wrap("op", "x", CAI("float16", strides=(16, 2)))
    assert a.strides == (8, 1)
    with pytest.raises(LoomnbValueError, match="strides that are whole elements"):
        ad.wrap("op", "x", CAI("float16", strides=(16, 3)))


def test_read_only_exports_are_marked():
    assert ad.wrap("op", "out", CAI("float32", data=(0x1000, True))).readonly


def test_masks_and_unknown_versions_are_rejected():
    with pytest.raises(LoomnbValueError, match="argument 'x' must be an array without a __cuda_array_interface__ mask"):
        ad.wrap("op", "x", CAI("float32", mask=CAI("bool")))
    with pytest.raises(LoomnbValueError, match="version 0..3; got version 4"):
        ad.wrap("op", "x", CAI("float32", version=4))
    with pytest.raises(LoomnbValueError, match="the spec disallows 0"):
        ad.wrap("op", "x", CAI("float32", stream=0))


def test_zero_size_and_old_versions():
    a = ad.wrap("op", "x", CAI("float32", shape=(0, 3), data=(0, False), version=1, stream=5))
    assert a.shape == (0, 3) and a.size == 0 and a.sync_stream is None  # v1 has no stream
    assert ad.wrap("op", "x", CAI("float32", stream=5)).sync_stream == 5


@pytest.mark.parametrize("data", [(None, False), (0, False), (0, True)])
def test_empty_exports_may_have_a_null_pointer(data):
    """CAI v3 allows ``data = (None, ...)`` or a 0 pointer for an empty array: a no-op input."""
    a = ad.wrap("op", "x", CAI("float32", shape=(0, 4096), data=data))
    assert a.ptr == 0 and a.size == 0 and a.extent() == (0, 0)


def test_a_null_pointer_for_a_non_empty_array_is_rejected():
    for data in ((None, False), (0, False)):
        with pytest.raises(LoomnbValueError, match="argument 'x' must be a non-null data pointer "
                                                   r"for a non-empty array; got data = \("):
            ad.wrap("op", "x", CAI("float32", shape=(2, 3), data=data))
    with pytest.raises(LoomnbValueError, match="an integer data pointer"):
        ad.wrap("op", "x", CAI("float32", data=("0x1000", False)))


def test_dtype_comes_from_the_object_and_must_agree_in_size():
    import ml_dtypes
    a = ad.wrap("op", "x", CAI(ml_dtypes.bfloat16, typestr="<f2"))  # torch's old bf16 typestr
    assert a.kind == "bf16"
    with pytest.raises(LoomnbValueError, match="itemsize"):
        ad.wrap("op", "x", CAI(ml_dtypes.bfloat16, typestr="<f4"))
    with pytest.raises(LoomnbTypeError, match="reads the dtype from the array object"):
        ad.wrap("op", "x", CAI("complex64"))
