"""The CustomOp replacements: vLLM's ``SiluAndMul`` and ``RotaryEmbedding`` with a
``forward_cuda`` that calls loomnb.

``SiluAndMul.register_oot`` / ``RotaryEmbedding.register_oot`` (registration.py) swap the class
vLLM instantiates for a subclass made here, when vLLM is there: each factory in
:data:`CUSTOM_OPS` gets vLLM's class wrapped by :func:`_selectable` and subclasses that. vLLM
names an out-of-tree class by its class name, so loomnb is selected by ``"+SiluAndMul"`` /
``"+RotaryEmbedding"`` in ``compilation_config["custom_ops"]``; the replacement keeps vLLM's own
names working as before (:func:`custom_op_mode`).

RoPE goes to the out-of-place ``loomnb.apply_rope_with_cos_sin_cache``: under torch.compile an
in-place custom op on the query and key (views of the QKV GEMM's output) is functionalised, and
Inductor lowers that to a copy of both views before the op and a scatter after it -- two kernels
a layer, 62 µs a decode step of SmolLM2 at batch 1 (measured). vLLM turns its own in-place ops
back into in-place calls (``FixFunctionalizationPass``, a fixed list with no hook for plug-ins);
an out-of-place op has nothing to undo.
"""

import inspect

import loomnb

from .counts import note, note_mode
from .fallbacks import rotary_embedding_fallback_reason, silu_and_mul_fallback_reason


def custom_op_mode(custom_ops, cls_name, vllm_name):
    """Which forward vLLM's CustomOp runs once the plug-in has replaced it: ``"loomnb"``,
    ``"vllm"`` (vLLM's own CUDA op) or ``None`` (disabled: vLLM's torch-native forward, which
    Inductor compiles), from ``compilation_config.custom_ops`` (a list holding ``"none"`` or
    ``"all"`` and ``"+name"`` / ``"-name"`` switches).

    vLLM enables an out-of-tree class by its class name (``cls_name``, e.g. ``"SiluAndMul"``) and
    never by the in-tree op's registered name (``vllm_name``, e.g. ``"silu_and_mul"``), so a
    replacement that only followed vLLM's rule would turn ``"+silu_and_mul"`` -- vLLM's own CUDA
    op -- into the torch-native forward. The rule here: a ``"-"`` of either name disables;
    ``"+cls_name"`` selects loomnb; ``"+vllm_name"`` vLLM's op; otherwise ``"all"`` selects
    loomnb and ``"none"`` disables."""
    if f"-{cls_name}" in custom_ops or f"-{vllm_name}" in custom_ops:
        return None
    if f"+{cls_name}" in custom_ops:
        return "loomnb"
    if f"+{vllm_name}" in custom_ops:
        return "vllm"
    return "loomnb" if "all" in custom_ops else None


def _selectable(base, cls_name, vllm_name):
    """A subclass of vLLM's CustomOp ``base`` that follows :func:`custom_op_mode`: ``enabled()``
    says whether either CUDA forward runs, and ``self._loomnb_on`` (set when vLLM picks the
    forward, at construction) whether it is loomnb's."""
    from vllm.config import get_cached_compilation_config

    class Selectable(base):
        @classmethod
        def _mode(cls):
            return custom_op_mode(get_cached_compilation_config().custom_ops, cls_name, vllm_name)

        @classmethod
        def enabled(cls):
            return cls._mode() is not None

        def dispatch_forward(self, *args, **kwargs):
            mode = type(self)._mode()
            self._loomnb_on = mode == "loomnb"
            if mode is None:  # vLLM may still force its device forward (enforce_enable)
                mode = "vllm" if getattr(self, "_enforce_enable", False) else "native"
            note_mode(cls_name, mode)
            return super().dispatch_forward(*args, **kwargs)

    return Selectable


def _silu_class(base):
    class LoomnbSiluAndMul(base):
        """vLLM's ``SiluAndMul`` whose CUDA forward is ``loomnb.silu_and_mul(x)`` (vLLM's own
        ``forward_cuda`` where :func:`silu_and_mul_fallback_reason` gives a reason)."""

        _loomnb = True

        def forward_cuda(self, x):
            if not getattr(self, "_loomnb_on", True):  # "+silu_and_mul": vLLM's own op
                return super().forward_cuda(x)
            reason = silu_and_mul_fallback_reason(x)
            note("silu_and_mul", reason)
            if reason is None:
                return loomnb.silu_and_mul(x)
            return super().forward_cuda(x)

    return LoomnbSiluAndMul


def _rope_class(base):
    class LoomnbRotaryEmbedding(base):
        """vLLM's ``RotaryEmbedding`` whose CUDA forward is
        ``loomnb.apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache,
        is_neox)``, returning new rotated tensors (vLLM's own ``forward_cuda``, in place, where
        :func:`rotary_embedding_fallback_reason` gives a reason)."""

        _loomnb = True

        def forward_cuda(self, positions, query, key=None):
            if not getattr(self, "_loomnb_on", True):  # "+rotary_embedding": vLLM's own op
                return super().forward_cuda(positions, query, key)
            if getattr(self, "use_flashinfer", False):
                reason = "vLLM selected its FlashInfer rotary path"
            else:
                cache = self._match_cos_sin_cache_dtype(query)
                reason = rotary_embedding_fallback_reason(positions, query, key, self.head_size,
                                                          cache, self.is_neox_style)
            note("rotary_embedding", reason)
            if reason is None:
                return loomnb.apply_rope_with_cos_sin_cache(positions, query, key,
                                                            self.head_size, cache,
                                                            self.is_neox_style)
            return super().forward_cuda(positions, query, key)

    return LoomnbRotaryEmbedding


# vLLM CustomOp class -> (its module, vLLM's registered name, loomnb op, the loomnb op's leading
# parameters this plug-in passes positionally, class factory)
CUSTOM_OPS = {
    "SiluAndMul": ("vllm.model_executor.layers.activation", "silu_and_mul", "silu_and_mul",
                   ("x",), _silu_class),
    "RotaryEmbedding": ("vllm.model_executor.layers.rotary_embedding.base", "rotary_embedding",
                        "apply_rope_with_cos_sin_cache",
                        ("positions", "query", "key", "head_size", "cos_sin_cache", "is_neox"),
                        _rope_class),
}


def loomnb_op(name, params):
    """``(loomnb.<name>, None)`` when this loomnb has the op with the leading parameters the
    plug-in passes and a torch custom op for torch.compile, else ``(None, why not)``."""
    fn = getattr(loomnb, name, None)
    if fn is None:
        return None, f"loomnb has no {name} in this version"
    try:
        got = tuple(inspect.signature(fn).parameters)[:len(params)]
    except (TypeError, ValueError):
        got = ()
    if got != tuple(params):
        return None, (f"loomnb.{name}'s leading parameters {got} are not ({', '.join(params)}), "
                      "which this plug-in passes")
    if getattr(fn, "traced", None) is None:
        return None, f"loomnb.{name} has no torch custom op (torch.compile could not trace it)"
    return fn, None
