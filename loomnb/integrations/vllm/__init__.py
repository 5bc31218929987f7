"""loomnb inside vLLM 0.24: a general plug-in that routes vLLM's RMSNorm ops, SiLU-and-mul and
RoPE to loomnb's kernels, falling back to vLLM's own implementation, counted, wherever loomnb
does not take the arguments.

Turn it on (``docs/vllm.md`` has the whole story)::

    pip install loomnb                # declares the entry point  vllm.general_plugins: loomnb
    from vllm import LLM
    from loomnb.integrations.vllm import engine_kwargs
    llm = LLM(model_path, **engine_kwargs("loomnb"))

What it routes, through vLLM 0.24.0's own mechanisms:

* ``vllm.ir.ops.rms_norm`` (an IR op) -> ``loomnb.rms_norm(x, weight, eps, rounding="once")``;
  selected by ``ir_op_priority`` ``rms_norm = ["loomnb", "vllm_c", "native"]``;
* ``vllm.ir.ops.fused_add_rms_norm`` -> ``loomnb.fused_add_rms_norm(x, x_residual, weight, eps,
  rounding="once")``, in place; ``ir_op_priority`` ``fused_add_rms_norm = [...]`` likewise;
* ``SiluAndMul`` (a CustomOp) -> ``loomnb.silu_and_mul(x)``; ``custom_ops`` ``"+SiluAndMul"``;
* ``RotaryEmbedding`` -> ``loomnb.apply_rope_with_cos_sin_cache(positions, query, key,
  head_size, cos_sin_cache, is_neox)``, out of place (the rotated query and key are new
  tensors, the bits of vLLM's in-place op); ``custom_ops`` ``"+RotaryEmbedding"``.

One module per duty:

* ``fallbacks`` -- whether loomnb takes a call: the plug-in's policy (CUDA, bf16/fp16, vLLM's
  arguments loomnb has no parameter for), then the op's own validation, run on the call's
  metadata; the op's error message is the reason;
* ``ir`` -- the IR implementations and their ``supports_args``;
* ``custom_ops`` -- the CustomOp replacements and the ``custom_ops`` rule they follow;
* ``registration`` -- :func:`register` (the entry point), :func:`routes`, :func:`engine_kwargs`;
* ``counts`` and ``reporting`` -- the decision counters, :func:`report` and :func:`summary`.

Nothing here imports vLLM until :func:`register` runs; importing this package needs torch.
"""

from .counts import custom_op_modes, fallback_counts, reset_counts, routed_counts
from .custom_ops import CUSTOM_OPS, custom_op_mode, loomnb_op
from .fallbacks import (ROUTED_DTYPES, rms_norm_fallback_reason, rotary_embedding_fallback_reason,
                        silu_and_mul_fallback_reason)
from .ir import (IR_OPS, ir_fused_add_rms_norm, ir_fused_add_rms_norm_supported, ir_rms_norm,
                 ir_rms_norm_supported)
from .registration import (_STATE, CONFIGS, OPS, PROVIDER, Route, _reset, engine_kwargs, register,
                           routes)
from .reporting import process, report, summary

__all__ = ["register", "routes", "report", "summary", "process", "routed_counts", "fallback_counts",
           "reset_counts", "custom_op_mode", "custom_op_modes", "engine_kwargs",
           "rms_norm_fallback_reason", "silu_and_mul_fallback_reason",
           "rotary_embedding_fallback_reason", "loomnb_op", "Route", "PROVIDER", "CONFIGS", "OPS"]
