"""Every public op as a torch custom op, ``torch.ops.loomnb.<name>``, and the per-op preamble
(torch.compile and the eager fast path), both from one decorator.

An op is written as its body: docstring, validation, allocation, one launch. ``@torch_op(inputs,
outputs=..., returns=..., fake=...)`` on it gives the public function, built once at import as
Python source with the body's own parameter list (as :mod:`dataclasses` builds ``__init__``:
no ``*args``/``**kwargs`` binding on the hot path) less the body's last parameter,
``launch_key``. For ``rms_norm`` it reads (comments added)::

    def rms_norm(x, weight, eps, *, out=_d_out, rounding=_d_rounding, stream=_d_stream):
        if _is_compiling():                  # torch.compile: one torch.ops.loomnb node
            return rms_norm.traced(x=x, weight=weight, eps=eps, rounding=rounding, out=out,
                                   stream=stream)
        _k = None
        if stream is None:                   # the eager fast path
            _k = _key3('rms_norm', eps, rounding, x, weight, out)
            if _k is not None:
                _hit = _replay(_k)
                if _hit is not None:
                    return (out if out is not None else _hit[0])
        return _body(x, weight, eps, out=out, rounding=rounding, stream=stream, launch_key=_k)

(``inspect.getsource(loomnb.rms_norm)`` shows it; the preamble's own names start with ``_``, so
no parameter can shadow them), and the body passes ``launch_key`` to its launch(es)
(``_launch.launch(..., key=launch_key)``), which remembers them for the next call with an equal
key. The public function keeps the body's name, docstring and signature (``inspect.signature``
has no ``launch_key``).

**The key** comes from the schema (``_launch.key``: the tensors' data pointers, shapes, strides
and dtypes, ``None`` for an absent one, a ``Tensor[]`` list's tensors as one tuple, in schema
order with the outputs last; the float and str
options, of exact types), so an op declares none of it. Options of other types are checked
first, and a call whose option fails the check takes the checked path, which raises: a ``bool``
must be a bool (``True == 1``), an ``int`` an int (or None for ``int?``); a ``ScalarType`` is
keyed as ``str(dtype)``; a ``bool check_*`` option is no key part but a condition -- a checked
call (``check_scale=True``, ``check_indices=True``) always takes the checked path. One float,
one str and three tensors (the plain norms) use ``_launch.key3``, the same key written out.
A hit returns what the op returns, each output the caller passed or else, in ``outputs`` order,
the one the replay allocated (as ``_launch.fill``). Where an op's fast path differs:

* ``stream_key="logits"``: the key also holds the current stream of ``logits``' device (the op
  keeps a workspace per stream: the sampling ops, and ``paged_decode_attention``'s split
  counters, ``stream_key="query"``); no fast path unless that tensor is a CUDA torch tensor;
* ``optional={"lse": "return_lse"}``: an output computed and returned only when the Python-only
  flag is True or the caller passes it (``paged_decode_attention``); the flag must be a bool
  and is part of the key, and the registered op always computes and returns it;
* ``workspaces_first=1``: the replay allocates that many workspaces before the outputs (a
  workspace the op's first launch writes: ``greedy_verify``);
* a ``Tensor|int`` or ``Tensor|float`` input (``Tensor|float? temperature=None``: a number for
  every row, or a per-row tensor, FlashInfer's sampling arguments) is keyed by its value (with
  its type) or by its tensor's fields; a schema has no union type, so the registered op takes it
  as two arguments, ``Tensor? temperature`` and ``float? temperature__v``, split and joined
  around the call; a ``Generator?`` input takes the checked path unless it is None.

**torch.compile.** While torch.compile (Dynamo) traces a caller, the op calls its
``torch.ops.loomnb`` twin, which Dynamo records as one graph node (no graph break), and the twin
runs loomnb's eager op -- fast path included -- when the compiled graph runs, CUDA-graph
capture included. Direct Python calls never go through the torch dispatcher. The decorator
registers:

* ``loomnb::<name>(<inputs>) -> <outputs>``: the functional form (outputs allocated), whose fake
  implementation is ``fake(*inputs)`` -- what torch.compile and the meta/fake-tensor machinery
  see instead of running the kernel;
* ``loomnb::<name>.out(<inputs>, *, Tensor(z!) out, ...) -> ()`` when the op has outputs, for
  callers that pass them (``out=``);
* ops with no outputs mutate inputs marked ``Tensor(a!)`` in ``inputs`` and return ``()``.

``stream=`` has no place in a traced graph (the graph's stream is the current one): passing
one while compiling raises.

The kernels run on CUDA tensors only. On CPU tensors every ``torch.ops.loomnb`` op has a CPU
kernel that raises :class:`~loomnb.LoomnbTypeError` saying so (instead of torch's
``NotImplementedError`` listing every dispatch key); the CPU reference is
``loomnb.oracle.<name>``, which takes CPU tensors and NumPy arrays.
"""

from __future__ import annotations

import inspect
import linecache

from .. import _adapter as ad
from ..checks import LoomnbTypeError, LoomnbValueError
from . import _launch as L

torch = ad._torch
_LIB = torch.library.Library("loomnb", "DEF") if torch is not None else None
REGISTERED = {}  # name -> the Python op, for tests and listings


def torch_op(inputs, *, outputs=(), returns=None, fake=None, optional=None, stream_key=None,
             workspaces_first=0):
    """The public op of the decorated body, registered as ``torch.ops.loomnb.<its name>``.

    ``inputs``: the schema of its tensor and scalar arguments (names equal to the Python
    keyword names; mutated inputs annotated ``Tensor(a!)``). ``outputs``: names of the ``out``-
    style keyword arguments it allocates when None, in order. ``returns``: the names (outputs or
    mutated inputs) the Python op returns, in order; a single name means a single value.
    ``fake(*inputs)``: the new output tensors of the functional form (shapes and dtypes only).
    ``optional``, ``stream_key``, ``workspaces_first``: see the module docstring.
    """
    outputs, optional = tuple(outputs), dict(optional or {})
    returns = tuple(returns or outputs)
    args = _parse(inputs)

    def deco(body):
        name = body.__name__
        op = _public(body, args, outputs, returns, optional, stream_key, workspaces_first)
        op.traced = (_make_traced(name, inputs, args, outputs, returns, fake, optional)
                     if torch is not None else None)
        REGISTERED[name] = op
        return op
    return deco


def _parse(inputs):
    """``[(type, name, keyword-only)]`` of a schema's inputs (``"Tensor(a!)? residual=None"``:
    type ``"Tensor?"``; ``"Tensor(a!)[] key_caches"``: ``"Tensor[]"``), read without torch."""
    args, kwonly = [], False
    for part in inputs.split(","):
        part = part.strip()
        if part == "*":
            kwonly = True
            continue
        typ, name = part.split("=")[0].split()
        base = typ.split("(")[0].rstrip("?") + ("[]" if typ.endswith("[]") else "") + (
            "?" if typ.endswith("?") else "")
        args.append((base, name, kwonly))
    return args


# ---------------------------------------------------------------- the public op, as source
def _public(body, args, outputs, returns, optional, stream_key, skip):
    """The public function: ``body``'s signature less ``launch_key``, its preamble, then
    ``body(..., launch_key=k)`` (module docstring)."""
    name = body.__name__
    params = list(inspect.signature(body).parameters.values())
    if not params or params[-1].name != "launch_key" or params[-1].kind != params[-1].KEYWORD_ONLY:
        raise TypeError(f"loomnb.{name}: the body's last parameter must be keyword-only "
                        "'launch_key' (the fast path's key, which it passes to its launch)")
    params = params[:-1]
    ns = {"_is_compiling": ad.is_compiling, "_body": body, "_key": L.key, "_key3": L.key3,
          "_either": _either, "_either_ok": _either_ok,
          "_replay": L.replay, "_fill": L.fill, "_stream_of": _current_stream}
    sig, call, star = [], [], False
    for p in params:
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise TypeError(f"loomnb.{name}: parameter {p.name!r}: no *args, **kwargs or "
                            "positional-only parameters")
        if p.name.startswith("_"):
            raise TypeError(f"loomnb.{name}: parameter {p.name!r}: the preamble's own names "
                            "start with '_'")
        if p.kind == p.KEYWORD_ONLY and not star:
            sig.append("*")
            star = True
        if p.default is p.empty:
            sig.append(p.name)
        else:
            ns[f"_d_{p.name}"] = p.default
            sig.append(f"{p.name}=_d_{p.name}")
        call.append(p.name if p.kind == p.POSITIONAL_OR_KEYWORD else f"{p.name}={p.name}")
    traced_kw = ", ".join(f"{n}={n}" for n in [a[1] for a in args] + list(outputs) + ["stream"])
    lines = [f"def {name}({', '.join(sig)}):",
             "    if _is_compiling():"]
    if optional:  # the twin always returns the optional output: drop it unless asked for
        want = _want_expr(optional)
        kept = [i for i, r in enumerate(returns) if r not in optional]
        lines += [f"        _res = {name}.traced({traced_kw})",
                  f"        return _res if {want} else _res[{kept[0]}]"]
    else:
        lines += [f"        return {name}.traced({traced_kw})"]
    lines += ["    _k = None"]
    lines += _fast_path(name, args, outputs, returns, optional, stream_key, skip)
    lines += [f"    return _body({', '.join(call)}, launch_key=_k)"]
    source, filename = "\n".join(lines) + "\n", f"<loomnb.{name} preamble>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), ns)  # tracebacks and inspect.getsource show it
    op = ns[name]
    op.__module__, op.__qualname__, op.__doc__ = body.__module__, body.__qualname__, body.__doc__
    return op


def _want_expr(optional):
    return " and ".join(f"({f} is True or {o} is not None)" for o, f in optional.items())


def _fast_path(name, args, outputs, returns, optional, stream_key, skip):
    """Source lines of the fast path: the conditions, the key, the replay and its returns."""
    conds, exact, loose, tensors = ["stream is None"], [], [], []
    for typ, n, _ in args:
        if typ.startswith("Tensor|"):  # a number or a tensor: keyed by value or by tensor
            conds.append(f"_either_ok({n})")
            exact.append(f"_either({n})")
        elif typ.startswith("Tensor"):
            tensors.append(n)
        elif typ == "bool" and n.startswith("check_"):
            conds.append(f"{n} is False")
        elif typ == "bool":
            conds.append(f"type({n}) is bool")
            exact.append(n)
        elif typ in ("int", "int?"):
            conds.append(f"type({n}) is int" if typ == "int" else
                         f"({n} is None or type({n}) is int)")
            exact.append(n)
        elif typ == "Generator?":  # a generator draws a seed every call: the checked path
            conds.append(f"{n} is None")
        elif typ == "ScalarType":
            exact.append(f"str({n})")
        elif typ in ("float", "float?", "str"):
            loose.append(n)
        else:
            raise TypeError(f"loomnb.{name}: no fast-path rule for schema type {typ!r}")
    tensors += outputs
    for flag in optional.values():
        conds.append(f"type({flag}) is bool")
    pre = []
    if stream_key:
        conds.append(f"(_h := _stream_of({stream_key})) is not None")
        exact.insert(0, "_h")
    if optional:
        pre = [f"        _want = {_want_expr(optional)}"]
        exact.append("_want")
    if (not exact and len(tensors) == 3 and len(loose) == 2
            and [t for t, n, _ in args if n in loose] == ["float", "str"]):
        make = f"_key3({name!r}, {loose[0]}, {loose[1]}, {', '.join(tensors)})"
    else:
        tag = f"({name!r}, {', '.join(exact)})" if exact else repr(name)
        scalars = ", ".join(loose) + ("," if len(loose) == 1 else "")
        make = f"_key({tag}, ({scalars}), {', '.join(tensors)})"
    lines = [f"    if {' and '.join(conds)}:", *pre, f"        _k = {make}",
             "        if _k is not None:", "            _hit = _replay(_k)",
             "            if _hit is not None:"]
    if optional:
        base = [o for o in outputs if o not in optional]
        lines += ["                if _want:",
                  *_hit_lines(outputs, returns, skip, "                    "),
                  *_hit_lines(base, [r for r in returns if r not in optional], skip,
                        "                ")]
    else:
        lines += _hit_lines(outputs, returns, skip, "                ")
    return lines


def _hit_lines(outputs, returns, skip, pad):
    """Lines returning ``returns`` after a replay: each output the caller's, or else the next
    of the replay's allocations (after ``skip`` workspaces), in ``outputs`` order."""
    if len(outputs) == 1:
        o = outputs[0]
        vals = {o: f"({o} if {o} is not None else _hit[{skip}])"}
        lines = []
    else:
        vals = {}
        lines = ([f"{pad}{', '.join(outputs)} = _fill(_hit{f'[{skip}:]' if skip else ''}, "
                  f"{', '.join(outputs)})"] if outputs else [])
    got = [vals.get(r, r) for r in returns]
    return lines + [f"{pad}return {', '.join(got)}"]


def _either_ok(v):
    """A ``Tensor|int`` / ``Tensor|float`` argument the fast path can key: a number of an exact
    type, None, or a CUDA torch tensor."""
    return type(v) in (int, float) or v is None or (
        torch is not None and isinstance(v, torch.Tensor) and v.is_cuda)


def _either(v):
    """The key part of such an argument: the number (with its type) or the tensor's fields."""
    if isinstance(v, (int, float)) or v is None:
        return (type(v), v)
    return (v.data_ptr(), v.shape, v.stride(), v.dtype)


def _split_unions(inputs):
    """The registered schema of ``inputs``: each ``Tensor|int n`` / ``Tensor|float n`` becomes
    ``Tensor? n, int? n__v`` (a schema has no union type), with ``=None`` defaults where the
    argument has a default; returns (schema, {n: its number type})."""
    parts, unions = [], {}
    for part in inputs.split(","):
        part = part.strip()
        if not part.startswith("Tensor|"):
            parts.append(part)
            continue
        typ, rest = part.split(None, 1)
        name = rest.split("=")[0].strip()
        num = typ[len("Tensor|"):].rstrip("?")
        unions[name] = num
        default = "=None" if "=" in rest else ""
        parts += [f"Tensor? {name}{default}", f"{num}? {name}__v{default}"]
    return ", ".join(parts), unions


def _current_stream(x):
    """The current stream's handle on ``x``'s device, for a key, or None when ``x`` is not a
    CUDA torch tensor (no fast path)."""
    if torch is None or not isinstance(x, torch.Tensor) or not x.is_cuda:
        return None
    return torch._C._cuda_getCurrentRawStream(x.get_device())


# ---------------------------------------------------------------- torch.ops.loomnb.<name>
def _make_traced(name, inputs, args, outputs, returns, fake, optional):
    inputs, unions = _split_unions(inputs)
    params = tuple(m for _, n, kw in args if not kw
                   for m in ((n, n + "__v") if n in unions else (n,)))
    kwonly = tuple(m for _, n, kw in args if kw
                   for m in ((n, n + "__v") if n in unions else (n,)))

    def joined(kw):  # the registered op's split arguments back as the Python op's
        for n in unions:
            t, v = kw.pop(n, None), kw.pop(n + "__v", None)
            kw[n] = t if t is not None else v
        return kw

    def split(kw):  # the Python op's arguments as the registered op's
        for n, num in unions.items():
            v = kw.get(n)
            is_t = isinstance(v, torch.Tensor)
            kw[n] = v if is_t else None
            kw[n + "__v"] = None if is_t or v is None else (float(v) if num == "float" else int(v))
        return kw
    if outputs:
        ret = "Tensor" if len(outputs) == 1 else "(" + ", ".join("Tensor" for _ in outputs) + ")"
        _LIB.define(f"{name}({inputs}) -> {ret}")
        star = "" if "*" in inputs else ", *"
        letters = "zyxwv"
        outs = ", ".join(f"Tensor({letters[i]}!) {o}" for i, o in enumerate(outputs))
        _LIB.define(f"{name}.out({inputs}{star}, {outs}) -> ()")
    else:
        _LIB.define(f"{name}({inputs}) -> ()")
    always = {flag: True for flag in optional.values()}  # the registered op returns them all

    def run(*args, **kwargs):  # the eager implementation behind torch.ops.loomnb.<name>
        kw = joined(dict(zip(params, args), **kwargs))
        res = REGISTERED[name](**kw, **always)
        if not outputs:
            return None
        full = dict(kw, **dict(zip(returns, res if len(returns) > 1 else (res,))))
        vals = tuple(full[o] for o in outputs)
        return vals[0] if len(vals) == 1 else vals

    def run_out(*args, **kwargs):
        REGISTERED[name](**joined(dict(zip(params, args), **kwargs)), **always)

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
        kw = split(dict(kw))
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
