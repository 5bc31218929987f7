"""Registration with vLLM, what it did, and the engine settings that select it.

vLLM calls :func:`register` in every process it starts (``vllm/plugins/__init__.py``,
``load_general_plugins``; ``VLLM_PLUGINS=loomnb`` restricts loading to this one), through the
entry point ``vllm.general_plugins: loomnb``. It registers provider ``"loomnb"`` for the IR ops
(``register_impl(..., supported=current_platform.is_cuda(), supports_args=...)``,
``inplace=True`` for the fused add) and the CustomOp replacements (``register_oot``), and records
one :class:`Route` per vLLM op. A vLLM without a class or op the plug-in needs, or one whose
``register_impl`` refuses an implementation (vLLM checks the signatures itself), leaves that op
to vLLM: the route says why and the plug-in logs a warning. :func:`engine_kwargs` gives the
settings that select loomnb (or vLLM's own ops) for an engine.
"""

import dataclasses
import functools
import importlib
import logging

from ...checks import LoomnbValueError
from .counts import LOCK, _reset_modes, reset_counts
from .custom_ops import CUSTOM_OPS, _selectable, loomnb_op
from .fallbacks import _decide
from .ir import IR_OPS

__all__ = ["register", "routes", "engine_kwargs", "Route", "PROVIDER", "CONFIGS", "OPS"]

PROVIDER = "loomnb"  # the vLLM IR provider name and the entry point's name
PLUGIN = "loomnb.integrations.vllm"
log = logging.getLogger("vllm.loomnb")  # under vLLM's logger, so vLLM's handler prints it
CONFIGS = ("default", "vllm_ops", "loomnb")
OPS = (*IR_OPS, *CUSTOM_OPS)  # what engine_kwargs(ops=...) can give to loomnb


@dataclasses.dataclass(frozen=True)
class Route:
    """One vLLM op and what :func:`register` did with it in this process.

    ``routed``: loomnb implements it here (it runs where ``enable`` selects it and the call's
    arguments pass the fallback check); ``reason``: why (not); ``enable``: the vLLM engine
    setting that selects loomnb's implementation.
    """

    vllm_op: str
    loomnb_op: str
    mechanism: str
    routed: bool
    reason: str
    enable: str


_STATE = {"registered": False, "vllm_version": None}
_ROUTES = {}  # vllm op -> Route, in IR_OPS then CUSTOM_OPS order


def _ir_route(name, routed, reason):
    _, _, inplace, loomnb_name = IR_OPS[name]
    return Route(f"vllm.ir.ops.{name}", f"loomnb.{loomnb_name}(..., rounding='once')",
                 f"vLLM IR provider '{PROVIDER}'" + (" (inplace)" if inplace else ""), routed,
                 reason, f"ir_op_priority={{'{name}': ['loomnb', 'vllm_c', 'native']}}")


def _oot_route(cls_name, routed, reason):
    _, vllm_name, loomnb_name, params, _ = CUSTOM_OPS[cls_name]
    return Route(cls_name, f"loomnb.{loomnb_name}({', '.join(params)})",
                 f"{cls_name}.register_oot", routed, reason,
                 f"compilation_config={{'custom_ops': ['none', '+{cls_name}']}} (the class name; "
                 f"'+{vllm_name}' selects vLLM's own CUDA op)")


def _all_routes(routed, reason):
    return ([_ir_route(n, routed, reason) for n in IR_OPS]
            + [_oot_route(c, routed, reason) for c in CUSTOM_OPS])


class _Missing(Exception):
    """This vLLM lacks a module, class or op the plug-in needs."""


def _register_ir(ir, name):
    """Provider 'loomnb' for ``vllm.ir.ops.<name>``: (routed, reason)."""
    impl, supports, inplace, _ = IR_OPS[name]
    op = getattr(ir.ops, name, None)
    if op is None:
        raise _Missing(f"this vLLM has no vllm.ir.ops.{name}")
    existing = op.impls.get(PROVIDER)
    if existing is not None:  # a second register() in one process, or another package's provider
        if existing.impl_fn is impl:
            return bool(existing.supported), ("registered" if existing.supported
                                              else "registered unsupported on this platform")
        return False, (f"provider '{PROVIDER}' is already registered by "
                       f"{getattr(existing.impl_fn, '__module__', '?')}")
    from vllm.platforms import current_platform
    is_cuda = bool(current_platform.is_cuda())
    op.register_impl(PROVIDER, supported=is_cuda, supports_args=supports, inplace=inplace)(impl)
    return is_cuda, ("registered" if is_cuda
                     else f"vLLM's platform is {type(current_platform).__name__}, not CUDA")


def _register_oot(cls_name):
    """loomnb's replacement of vLLM's CustomOp ``cls_name``: (routed, reason)."""
    module, vllm_name, loomnb_name, params, factory = CUSTOM_OPS[cls_name]
    _, why = loomnb_op(loomnb_name, params)
    if why is not None:
        return False, why
    try:
        base = getattr(importlib.import_module(module), cls_name)
        from vllm.config import get_cached_compilation_config  # noqa: F401 - _selectable's
        from vllm.model_executor.custom_op import op_registry_oot
    except Exception as e:  # noqa: BLE001 - any vLLM layout this plug-in does not know
        raise _Missing(f"this vLLM has no {module}.{cls_name} ({type(e).__name__}: {e})") from e
    current = op_registry_oot.get(cls_name)
    if current is not None:
        if getattr(current, "_loomnb", False):
            return True, "registered"
        return False, (f"another plug-in already replaced {cls_name} "
                       f"({current.__module__}.{current.__qualname__})")
    base.register_oot(factory(_selectable(base, cls_name, vllm_name)))
    return True, "registered"


def register():
    """vLLM's general-plug-in entry point (``vllm.general_plugins: loomnb``): register loomnb's
    implementations with vLLM. Idempotent (vLLM calls it once per process; a later call in the
    same process does nothing) and never raises: whatever cannot be routed is recorded in
    :func:`routes` with the reason, logged, and left to vLLM."""
    with LOCK:
        if _STATE["registered"]:
            return
        _STATE["registered"] = True
        try:
            import vllm
            import vllm.ir as ir
            _STATE["vllm_version"] = getattr(vllm, "__version__", "unknown")
        except Exception as e:  # noqa: BLE001
            why = f"vLLM is not importable ({type(e).__name__}: {e})"
            _ROUTES.update((r.vllm_op, r) for r in _all_routes(False, why))
            log.warning("loomnb plug-in: %s", why)
            return
        steps = ([(_ir_route, n, functools.partial(_register_ir, ir, n)) for n in IR_OPS]
                 + [(_oot_route, c, functools.partial(_register_oot, c)) for c in CUSTOM_OPS])
        for make, key, step in steps:
            warn = True  # a vLLM without what the plug-in needs, or one that refused it
            try:
                (routed, why), warn = step(), False
            except _Missing as e:
                routed, why = False, str(e)
            except Exception as e:  # noqa: BLE001 - vLLM refused it (its own checks)
                routed, why = False, f"registration failed ({type(e).__name__}: {e})"
            r = make(key, routed, why)
            _ROUTES[r.vllm_op] = r
            if warn:
                log.warning("loomnb plug-in: %s not routed: %s", r.vllm_op, why)
        log.info("loomnb plug-in (vLLM %s): %s", _STATE["vllm_version"], "; ".join(
            f"{r.vllm_op}: " + ("routed" if r.routed else f"not routed ({r.reason})")
            for r in routes()))


def routes():
    """What this process's :func:`register` did, one :class:`Route` per vLLM op, in a fixed
    order. Before :func:`register` has run, every op is listed as not routed, saying so."""
    with LOCK:
        if not _STATE["registered"]:
            return _all_routes(False, "register() has not run in this process (vLLM runs it "
                                      "when it starts)")
        return list(_ROUTES.values())


def engine_kwargs(config="loomnb", *, ops=None):
    """Keyword arguments for ``vllm.LLM(...)`` (or ``EngineArgs``) selecting one configuration.

    * ``"default"``: ``{}`` -- vLLM 0.24's default: torch.compile with Inductor generating the
      norms', SiLU-and-mul's and RoPE's kernels from their torch-native forms.
    * ``"vllm_ops"``: vLLM's own CUDA ops -- IR priority ``vllm_c`` for both norms and
      ``custom_ops ["none", "+silu_and_mul", "+rotary_embedding"]``.
    * ``"loomnb"``: as ``"vllm_ops"`` with loomnb first -- IR priority ``["loomnb", "vllm_c",
      "native"]``, and ``"+SiluAndMul"`` / ``"+RotaryEmbedding"`` for the ops this loomnb has
      (:func:`loomnb_op`), vLLM's own op for the others. The plug-in must be loaded
      (the installed entry point, or ``VLLM_PLUGINS=loomnb``).

    ``ops`` (``"loomnb"`` only): the vLLM ops given to loomnb, a subset of :data:`OPS`
    (``"rms_norm"``, ``"fused_add_rms_norm"``, ``"SiluAndMul"``, ``"RotaryEmbedding"``); the
    others take vLLM's own CUDA op, as in ``"vllm_ops"``. Default: all of them. One op at a
    time is how an engine-level difference is traced to an op.

    Merge ``compilation_config`` with your own settings if you pass any.
    """
    if config not in CONFIGS:
        raise LoomnbValueError(f"{PLUGIN}.engine_kwargs: argument 'config' must be one of "
                               f"{', '.join(map(repr, CONFIGS))}; got {config!r}")
    if ops is not None:
        ops = tuple(ops) if not isinstance(ops, str) else (ops,)
        unknown = [o for o in ops if o not in OPS]
        if unknown or config != "loomnb":
            raise LoomnbValueError(
                f"{PLUGIN}.engine_kwargs: argument 'ops' must be a subset of {', '.join(OPS)} "
                f"with config='loomnb'; got {ops!r} with config={config!r}")
    if config == "default":
        return {}
    ours = set(OPS if ops is None else ops) if config == "loomnb" else set()
    custom = ["none"]
    for cls_name, (_, vllm_name, loomnb_name, params, _) in CUSTOM_OPS.items():
        mine = cls_name in ours and loomnb_op(loomnb_name, params)[0] is not None
        custom.append(f"+{cls_name}" if mine else f"+{vllm_name}")
    return {"ir_op_priority": {name: ([PROVIDER] if name in ours else []) + ["vllm_c", "native"]
                               for name in IR_OPS},
            "compilation_config": {"custom_ops": custom}}


def _reset():
    """Forget registration, routes, counts and the cached routing decisions (tests only: vLLM's
    own registries are not undone)."""
    with LOCK:
        _decide.cache_clear()
        _STATE.update(registered=False, vllm_version=None)
        _ROUTES.clear()
        _reset_modes()
        reset_counts()
