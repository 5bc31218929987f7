"""The counter-based random numbers of the sampling kernels: Philox-4x32-10 (Salmon et al.,
SC'11; the generator of cuRAND's ``curand_init`` states, torch's CUDA RNG and FlashInfer's
samplers), and the uniform and Gumbel variates drawn from its words.

``philox(c0, c1, c2, c3, k0, k1)`` maps a 128-bit counter and a 64-bit key to four 32-bit
words, ten rounds of two 32x32->64-bit multiplications; nothing is stored between calls, so a
draw depends only on (key, counter): the same seed, offset and token give the same number in
any launch configuration, batch composition or CUDA-graph replay. The multiplications are
written as 64-bit products of 32-bit words (``mul.wide.u32`` on the GPU; numba widens
integer arithmetic to 64 bits, so every word is cast back to uint32 to keep the products
32 x 32 bits; exact NumPy integers in the simulator). ``loomnb.oracle.sampler.philox`` is the same function over NumPy arrays, checked
against Random123's known-answer vectors (``tests/test_sampler_oracle.py``).

``uniform(w)``: ``(floor(w / 2^9) + 0.5) * 2^-23`` in float32 -- every value exact, strictly
inside ``(0, 1)``, so ``log(u)`` is finite. ``gumbel(w) = -log(-log(uniform(w)))``, each
``log`` a float32 ``logf`` (libdevice on the GPU: within an ulp or two of the simulator's
correctly rounded one).
"""

from __future__ import annotations

import math

from numba import float32, uint32, uint64

from .._numba_internals import device

M0, M1 = 0xD2511F53, 0xCD9E8D57   # the round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85   # the key schedule's increments (golden ratio, sqrt(3) - 1)
ROUNDS = 10
LOW = 0xFFFFFFFF


@device
def philox(c0, c1, c2, c3, k0, k1):
    """The four uint32 words of Philox-4x32-10 at counter ``(c0, c1, c2, c3)``, key ``(k0, k1)``
    (all uint32)."""
    for _ in range(ROUNDS):
        p0 = uint64(M0) * uint64(c0)
        p1 = uint64(M1) * uint64(c2)
        hi0, lo0 = uint32(p0 >> uint64(32)), uint32(p0 & uint64(LOW))
        hi1, lo1 = uint32(p1 >> uint64(32)), uint32(p1 & uint64(LOW))
        c0, c1, c2, c3 = uint32(hi1 ^ c1 ^ k0), lo1, uint32(hi0 ^ c3 ^ k1), lo0
        k0 = uint32((uint64(k0) + uint64(W0)) & uint64(LOW))
        k1 = uint32((uint64(k1) + uint64(W1)) & uint64(LOW))
    return c0, c1, c2, c3


@device
def uniform(w):
    """A float32 in ``(0, 1)`` from the uint32 word ``w``: ``(w >> 9) * 2^-23 + 2^-24``."""
    return float32((float32(w >> uint32(9)) + float32(0.5)) * float32(1.0 / 8388608.0))


@device
def gumbel(w):
    """A standard Gumbel variate from the uint32 word ``w``: ``-log(-log(uniform(w)))``."""
    e = float32(-float32(math.log(uniform(w))))
    return float32(-float32(math.log(e)))
