"""Every public op as a torch custom op, ``torch.ops.loomnb.<name>``, registered by one decorator.

``@torch_op(inputs, outputs=..., returns=..., fake=...)`` on a public op registers:

* ``loomnb::<name>(<inputs>) -> <outputs>``: the functional form (outputs allocated), whose fake
  implementation is ``fake(*inputs)`` -- what torch.compile and the meta/fake-tensor machinery
  see instead of running the kernel;
* ``loomnb::<name>.out(<inputs>, *, Tensor(z!) out, ...) -> ()`` when the op has outputs, for
  callers that pass them (``out=``);
* ops with no outputs mutate inputs marked ``Tensor(a!)`` in ``inputs`` and return ``()``.

The op itself begins with ``if ad.is_compiling(): return <op>.traced(...)``: while torch.compile
(Dynamo) traces a caller, the op calls its ``torch.ops.loomnb`` twin, which Dynamo records as one
graph node (no graph break), and the twin runs loomnb's eager op -- fast path included -- when
the compiled graph runs, CUDA-graph capture included. Direct Python calls never go through the
torch dispatcher.

``stream=`` has no place in a traced graph (the graph's stream is the current one): passing
one while compiling raises.

The kernels run on CUDA tensors only. On CPU tensors every ``torch.ops.loomnb`` op has a CPU
kernel that raises :class:`~loomnb.LoomnbTypeError` saying so (instead of torch's
``NotImplementedError`` listing every dispatch key); the CPU reference is
``loomnb.oracle.<name>``, which takes CPU tensors and NumPy arrays.
"""

from __future__ import annotations

from .. import _adapter as ad
from ..checks import LoomnbTypeError, LoomnbValueError

torch = ad._torch
_LIB = torch.library.Library("loomnb", "DEF") if torch is not None else None
REGISTERED = {}  # name -> the Python op, for tests and listings


def torch_op(inputs, *, outputs=(), returns=None, fake=None, eager=None):
    """Register the decorated public op as ``torch.ops.loomnb.<its name>``.

    ``inputs``: the schema of its tensor and scalar arguments (names equal to the Python
    keyword names; mutated inputs annotated ``Tensor(a!)``). ``outputs``: names of the ``out``-
    style keyword arguments it allocates when None, in order. ``returns``: the names (outputs or
    mutated inputs) the Python op returns, in order; a single name means a single value.
    ``fake(*inputs)``: the new output tensors of the functional form (shapes and dtypes only).
    ``eager(**kwargs)``: what the registered op runs, returning ``returns`` (default: the Python
    op itself) -- for an op whose Python return depends on an option that is not in the schema
    (``paged_decode_attention(..., return_lse=)``: the registered op always returns both).
    """
    def deco(fn):
        fn.traced = _make_traced(fn.__name__, inputs, tuple(outputs), tuple(returns or outputs),
                                 fake, eager) if torch is not None else None
        REGISTERED[fn.__name__] = fn
        return fn
    return deco


def _arg_names(inputs):
    """(positional argument names, keyword-only argument names) of a schema's inputs."""
    schema = torch._C.parse_schema(f"loomnb::probe({inputs}) -> ()")
    return (tuple(a.name for a in schema.arguments if not a.kwarg_only),
            tuple(a.name for a in schema.arguments if a.kwarg_only))


def _make_traced(name, inputs, outputs, returns, fake, eager=None):
    params, kwonly = _arg_names(inputs)
    if outputs:
        ret = "Tensor" if len(outputs) == 1 else "(" + ", ".join("Tensor" for _ in outputs) + ")"
        _LIB.define(f"{name}({inputs}) -> {ret}")
        star = "" if "*" in inputs else ", *"
        letters = "zyxwv"
        outs = ", ".join(f"Tensor({letters[i]}!) {o}" for i, o in enumerate(outputs))
        _LIB.define(f"{name}.out({inputs}{star}, {outs}) -> ()")
    else:
        _LIB.define(f"{name}({inputs}) -> ()")

    def run(*args, **kwargs):  # the eager implementation behind torch.ops.loomnb.<name>
        kw = dict(zip(params, args), **kwargs)
        res = (eager or REGISTERED[name])(**kw)
        if not outputs:
            return None
        full = dict(kw, **dict(zip(returns, res if len(returns) > 1 else (res,))))
        vals = tuple(full[o] for o in outputs)
        return vals[0] if len(vals) == 1 else vals

    def run_out(*args, **kwargs):
        (eager or REGISTERED[name])(**dict(zip(params, args), **kwargs))

    def on_cpu(*args, **kwargs):  # what torch would otherwise answer with NotImplementedError
        raise LoomnbTypeError(f"torch.ops.loomnb.{name}: loomnb's torch ops run on CUDA tensors, "
                              f"and got CPU tensors; move them to the GPU (.cuda()), or compute "
                              f"on the CPU with loomnb.oracle.{name} (same arguments; CPU "
                              f"tensors or NumPy arrays)")

    _LIB.impl(name, run, "CUDA")
    _LIB.impl(name, on_cpu, "CPU")
    if outputs:
        _LIB.impl(name + ".out", run_out, "CUDA")
        _LIB.impl(name + ".out", on_cpu, "CPU")
        torch.library.register_fake(f"loomnb::{name}", fake, lib=_LIB)
        torch.library.register_fake(f"loomnb::{name}.out", lambda *a, **k: None, lib=_LIB)
    else:
        torch.library.register_fake(f"loomnb::{name}", lambda *a, **k: None, lib=_LIB)
    packet = getattr(torch.ops.loomnb, name)
    functional, out_form = packet.default, (packet.out if outputs else None)

    def traced(**kw):
        """The op inside a torch.compile trace: one call of its torch.ops.loomnb twin."""
        if kw.pop("stream", None) is not None:
            raise LoomnbValueError(f"loomnb.{name}: argument 'stream' must be None under "
                                   "torch.compile (the graph runs on the current stream)")
        args = [kw[p] for p in params]
        options = {p: kw[p] for p in kwonly}
        if not outputs:
            functional(*args, **options)
            vals = {}
        elif all(kw[o] is None for o in outputs):
            res = functional(*args, **options)
            vals = dict(zip(outputs, (res,) if len(outputs) == 1 else res))
        else:
            made = fake(*args, **options)
            made = (made,) if len(outputs) == 1 else made
            vals = {o: (kw[o] if kw[o] is not None else m) for o, m in zip(outputs, made)}
            out_form(*args, **options, **vals)
        got = tuple(vals[r] if r in vals else kw[r] for r in returns)
        return got[0] if len(got) == 1 else got

    return traced
