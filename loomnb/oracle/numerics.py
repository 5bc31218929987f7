"""The oracles' one rounding helper: float32 -> the activation dtype, as the GPU rounds.

``to_dtype(v, dtype)`` rounds to nearest even (ml_dtypes / NumPy) and writes every NaN as the
canonical NaN the GPU's conversion instructions produce -- 0x7FFF for bf16 and fp16 (CUDA's
``__float2bfloat16_rn``/``cvt.rn.bf16.f32``, which vLLM's and torch's CUDA kernels use) --
where ml_dtypes would keep the sign and write 0x7FC0/0xFFC0 (torch's CPU conversion does the
same). So "bit-identical to the oracle" holds for NaN rows too.
"""

import numpy as np

CANONICAL_NAN = {2: np.uint16(0x7FFF)}


def to_dtype(v, dtype):
    """``r(v)``: float32 ``v`` rounded to ``dtype`` (bf16, fp16 or fp32), NaN canonical."""
    out = np.asarray(v, dtype=np.float32).astype(dtype)
    if out.dtype.itemsize == 2:
        nan = np.isnan(out.astype(np.float32))
        if nan.any():
            out.view(np.uint16)[nan] = CANONICAL_NAN[2]
    return out
