"""Launch arithmetic of the norm kernels: every configuration covers the row, within CUDA limits.

Correctness must not depend on the configuration (the simulator and GPU tests sweep it); this
checks the arithmetic itself, for the hidden sizes of common models and awkward ones.
"""

import pytest

from loomnb.ops._norm_kernels import CACHED_VPT
from loomnb.ops.norm import launch_config


@pytest.mark.parametrize("hidden_size", [8, 72, 576, 2048, 4096, 5120, 8192, 12288, 16384, 65536, 65544])
def test_cached_config_covers_the_row(hidden_size):
    threads, vpt = launch_config(hidden_size, True, None)
    assert threads % 32 == 0 and 32 <= threads <= 1024
    if vpt:
        assert vpt in CACHED_VPT and threads * vpt * 8 >= hidden_size
    else:
        assert threads == 1024 and 1024 * max(CACHED_VPT) * 8 < hidden_size  # scalar layout


def test_four_units_a_thread_at_every_batch_size():
    """128 x 4 at 4096 whatever the batch (the rule takes no row count; the probe measured
    512 x 1 slower at 1 row)."""
    assert launch_config(4096, True, None) == (128, 4)
    assert launch_config(576, True, None) == (64, 2)  # SmolLM2


@pytest.mark.parametrize("hidden_size", [1, 19, 1000, 5000])
def test_scalar_config_is_vllms(hidden_size):
    assert launch_config(hidden_size, False) == (min(1024, max(32, -(-hidden_size // 32) * 32)), 0)


def test_forced_threads():
    assert launch_config(4096, True, 256) == (256, 2)
    assert launch_config(8 * 257, True, 32) == (32, 0)
