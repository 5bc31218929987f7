"""The vLLM plug-in (``loomnb.integrations.vllm``) and the A/B benchmark's plumbing.

Without vLLM (CI's CPU machine) the plug-in's own logic is tested against a fake ``vllm``
package made here: the IR-op and CustomOp registries with the checks vLLM 0.24.0's
``register_impl`` makes, so registration, the listing, argument routing and fallback counting
run for real. The implementations' signatures are compared with a copy of vLLM 0.24.0's native
ones. ``benchmarks/bench_vllm_ab.py --dry-run`` runs the A/B's fresh-process plumbing with a fake
engine. Tests that need vLLM itself skip, saying so; the ``gpu`` tests run the implementations
on CUDA tensors (bit-equal to loomnb's ops and the oracle, graph capture, the traced form).
"""

import contextlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import Tensor  # noqa: E402
from torch.library import infer_schema  # noqa: E402

import loomnb  # noqa: E402
import loomnb.integrations.vllm as V  # noqa: E402
import loomnb.integrations.vllm.fallbacks as F  # noqa: E402
from loomnb import LoomnbValueError  # noqa: E402

pytestmark = pytest.mark.nosim
REPO = Path(__file__).resolve().parent.parent
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _scratch_in_tmp_path(tmp_path, monkeypatch):
    """bench_vllm_ab.py's scratch folders (tempfile.mkdtemp: the entry point, the children's
    outputs) go under the test's tmp_path, in this process and in the ones it starts."""
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


# ---------------------------------------------------------------------------------------------
# vLLM 0.24.0's native IR implementations, signatures only: copied from the vllm-0.24.0 wheel
# (version 0.24.0, commit ee0da84ab), vllm/ir/ops/layernorm.py. vLLM's IrOpImpl requires
# infer_schema(impl) == infer_schema(native) (vllm/ir/op.py, IrOpImpl.__init__).
def native_rms_norm(x: Tensor, weight: Tensor | None, epsilon: float,
                    variance_size: int | None = None) -> Tensor:
    raise AssertionError("signature only")


def native_fused_add_rms_norm(x: Tensor, x_residual: Tensor, weight: Tensor | None,
                              epsilon: float, variance_size: int | None = None
                              ) -> tuple[Tensor, Tensor]:
    raise AssertionError("signature only")


NATIVE = {"rms_norm": native_rms_norm, "fused_add_rms_norm": native_fused_add_rms_norm}
NATIVE_SCHEMAS = {  # what torch 2.13's infer_schema makes of them
    "rms_norm": "(Tensor x, Tensor? weight, float epsilon, SymInt? variance_size=None) -> Tensor",
    "fused_add_rms_norm": "(Tensor x, Tensor x_residual, Tensor? weight, float epsilon, "
                          "SymInt? variance_size=None) -> (Tensor, Tensor)",
}


@pytest.mark.parametrize("name", list(NATIVE))
def test_implementations_have_vllm_0_24_native_signatures(name):
    impl, supports, _, _ = V.IR_OPS[name]
    assert infer_schema(NATIVE[name], mutates_args=[]) == NATIVE_SCHEMAS[name]
    assert infer_schema(impl, mutates_args=[]) == NATIVE_SCHEMAS[name]
    # supports_args: the native parameter names and defaults (vLLM checks both)
    native_params = [(p.name, p.default) for p in inspect.signature(NATIVE[name]).parameters.values()]
    assert [(p.name, p.default) for p in inspect.signature(supports).parameters.values()] == native_params


# ---------------------------------------------------------------------------------------------
# A fake vllm package: the parts the plug-in touches, with vLLM 0.24.0's registration checks.
class FakeImpl:
    def __init__(self, provider, impl_fn, supported, supports_args, inplace):
        self.provider, self.impl_fn, self.supported = provider, impl_fn, supported
        self._supports_args, self.inplace = supports_args, inplace

    def supports_args(self, *args):
        return self._supports_args is None or self._supports_args(*args)


class FakeIrOp:
    """vLLM's IrOp registry as far as the plug-in goes: ``impls``, ``register_impl`` (rejecting a
    schema other than the native one, supports_args with other names or defaults, a taken
    provider name, inplace on an op that does not allow it) and a priority ``dispatch``."""

    def __init__(self, native, allow_inplace):
        self.native, self.allow_inplace = native, allow_inplace
        self.impls = {"native": FakeImpl("native", native, True, None, False)}

    def register_impl(self, provider, *, supported=True, supports_args=None, inplace=False):
        def deco(fn):
            assert provider not in self.impls, f"provider {provider} already registered"
            if infer_schema(fn, mutates_args=[]) != infer_schema(self.native, mutates_args=[]):
                raise ValueError(f"{provider}: schema does not match the native one")
            if supports_args is not None:
                want = [(p.name, p.default) for p in inspect.signature(self.native).parameters.values()]
                got = [(p.name, p.default) for p in inspect.signature(supports_args).parameters.values()]
                if want != got:
                    raise ValueError(f"{provider}: supports_args parameters {got} != {want}")
            assert not inplace or self.allow_inplace
            self.impls[provider] = impl = FakeImpl(provider, fn, supported, supports_args, inplace)
            return impl
        return deco

    def dispatch(self, priority, *args):
        for p in priority:
            impl = self.impls[p]
            if impl.supported and impl.supports_args(*args):
                return impl
        return self.impls["native"]


CALLS = []  # which implementation the fake CustomOps ran


class FakeCustomOp:
    registry_oot = {}
    custom_ops = ["none"]  # what the fake vllm.config's compilation config holds

    @classmethod
    def enabled(cls):  # vLLM 0.24's rule (model_executor/custom_op.py): by cls.name
        ops = FakeCustomOp.custom_ops
        return (("all" in ops or f"+{cls.name}" in ops)) and f"-{cls.name}" not in ops

    def dispatch_forward(self, compile_native=False):  # vLLM calls it from CustomOp.__init__
        return self.forward_cuda if self.enabled() else "native"

    @classmethod
    def register_oot(cls, op_cls=None, name=None):
        def deco(c):
            reg = name if name is not None else cls.__name__
            assert reg not in FakeCustomOp.registry_oot, f"Duplicate op name: {reg}"
            c.name = reg
            FakeCustomOp.registry_oot[reg] = c
            return c
        return deco(op_cls) if op_cls is not None else deco


class SiluAndMul(FakeCustomOp):
    name = "silu_and_mul"

    def forward_cuda(self, x):
        CALLS.append("vllm silu_and_mul")
        d = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :d]) * x[..., d:2 * d]


class RotaryEmbedding(FakeCustomOp):
    def __init__(self, head_size, cos_sin_cache, is_neox_style=True):
        self.head_size, self.cos_sin_cache, self.is_neox_style = head_size, cos_sin_cache, is_neox_style
        self.use_flashinfer = False

    def _match_cos_sin_cache_dtype(self, query):
        return self.cos_sin_cache.to(query.dtype)

    def forward_cuda(self, positions, query, key=None):
        CALLS.append("vllm rotary_embedding")
        return query, key


@pytest.fixture
def fake_vllm(monkeypatch):
    """Install the fake vllm modules; the plug-in's state is reset around the test."""
    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__path__ = []
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    platform = types.SimpleNamespace(cuda=True)
    platform.is_cuda = lambda: platform.cuda
    ops = types.SimpleNamespace(rms_norm=FakeIrOp(native_rms_norm, False),
                                fused_add_rms_norm=FakeIrOp(native_fused_add_rms_norm, True))
    vllm = module("vllm", __version__="0.24.0")
    vllm.ir = module("vllm.ir", ops=ops)
    vllm.platforms = module("vllm.platforms", current_platform=platform)
    module("vllm.model_executor")
    module("vllm.model_executor.custom_op", op_registry_oot=FakeCustomOp.registry_oot,
           CustomOp=FakeCustomOp)
    module("vllm.config", get_cached_compilation_config=lambda: types.SimpleNamespace(
        custom_ops=FakeCustomOp.custom_ops))
    monkeypatch.setattr(FakeCustomOp, "custom_ops", ["none"])
    module("vllm.model_executor.layers")
    module("vllm.model_executor.layers.activation", SiluAndMul=SiluAndMul)
    module("vllm.model_executor.layers.rotary_embedding")
    module("vllm.model_executor.layers.rotary_embedding.base", RotaryEmbedding=RotaryEmbedding)
    FakeCustomOp.registry_oot.clear()
    CALLS.clear()
    V._reset()
    yield types.SimpleNamespace(ops=ops, platform=platform, oot=FakeCustomOp.registry_oot)
    V._reset()
    FakeCustomOp.registry_oot.clear()


def _traced_stub(fn):
    fn.traced = fn  # stands for the torch custom op every loomnb op carries
    return fn


@pytest.fixture
def loomnb_ops(monkeypatch):
    """loomnb.silu_and_mul / rotary_embedding as plain-torch stubs (recording their calls), so
    the CustomOp routes run on the CPU whether or not those families exist in this checkout."""
    @_traced_stub
    def silu_and_mul(x, out=None, *, stream=None):
        d = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :d]) * x[..., d:]

    @_traced_stub
    def apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache,
                                      is_neox=True, *, query_out=None, key_out=None, stream=None):
        CALLS.append(("loomnb apply_rope", head_size, is_neox))
        return query.clone(), key.clone()  # new tensors, as the out-of-place op returns

    monkeypatch.setattr(loomnb, "silu_and_mul", silu_and_mul, raising=False)
    monkeypatch.setattr(loomnb, "apply_rope_with_cos_sin_cache", apply_rope_with_cos_sin_cache,
                        raising=False)
    monkeypatch.setattr(F, "_CUDA", "cpu")  # route CPU tensors: the stubs run anywhere
    return types.SimpleNamespace(silu_and_mul=silu_and_mul,
                                 apply_rope_with_cos_sin_cache=apply_rope_with_cos_sin_cache)


def routes():
    return {r.vllm_op: r for r in V.routes()}


# ---------------------------------------------------------------------------------------------
def test_routes_before_register_say_so():
    V._reset()
    rs = V.routes()
    assert [r.vllm_op for r in rs] == ["vllm.ir.ops.rms_norm", "vllm.ir.ops.fused_add_rms_norm",
                                       "SiluAndMul", "RotaryEmbedding"]
    assert all(not r.routed and "register() has not run" in r.reason for r in rs)


def test_register_routes_the_norms(fake_vllm):
    V.register()
    rs = routes()
    for name, inplace in (("rms_norm", False), ("fused_add_rms_norm", True)):
        r = rs[f"vllm.ir.ops.{name}"]
        assert r.routed and r.reason == "registered", r
        assert r.enable == f"ir_op_priority={{'{name}': ['loomnb', 'vllm_c', 'native']}}"
        impl = getattr(fake_vllm.ops, name).impls["loomnb"]
        assert impl.impl_fn is V.IR_OPS[name][0] and impl.supported and impl.inplace is inplace
    assert V.report()["vllm_version"] == "0.24.0" and V.report()["registered"]
    proc = V.report()["process"]  # no torch.distributed here: rank 0 of 1
    assert proc["pid"] == os.getpid() and (proc["rank"], proc["world_size"]) == (0, 1)
    assert "  process: rank 0 of 1, pid" in V.summary()


def test_register_twice_changes_nothing(fake_vllm, loomnb_ops):
    V.register()
    before = V.routes()
    V.register()
    assert V.routes() == before
    V._STATE["registered"] = False  # a second register() run in the same process
    V.register()
    assert V.routes() == before
    assert set(fake_vllm.ops.rms_norm.impls) == {"native", "loomnb"}


def test_not_cuda_platform_registers_unsupported(fake_vllm):
    fake_vllm.platform.cuda = False
    V.register()
    r = routes()["vllm.ir.ops.rms_norm"]
    assert not r.routed and "not CUDA" in r.reason
    assert fake_vllm.ops.rms_norm.impls["loomnb"].supported is False


def test_a_vllm_that_refuses_the_signature_leaves_the_op_to_vllm(fake_vllm, caplog):
    """A vLLM whose native signature differs (here ``eps`` for ``epsilon``) refuses the
    registration itself (its ``register_impl`` compares the schemas): nothing of loomnb's is
    registered for that op, the listing and the log say why, the other op is unaffected."""
    def other_native(x: Tensor, weight: Tensor | None, eps: float,
                     variance_size: int | None = None) -> Tensor:
        raise AssertionError

    fake_vllm.ops.rms_norm = FakeIrOp(other_native, False)
    with caplog.at_level("WARNING", logger="vllm.loomnb"):
        V.register()
    r = routes()["vllm.ir.ops.rms_norm"]
    assert not r.routed and r.reason == ("registration failed (ValueError: loomnb: schema does "
                                         "not match the native one)")
    assert set(fake_vllm.ops.rms_norm.impls) == {"native"}
    assert "vllm.ir.ops.rms_norm not routed: registration failed" in caplog.text
    assert routes()["vllm.ir.ops.fused_add_rms_norm"].routed


def test_a_vllm_without_the_classes_says_so(fake_vllm, loomnb_ops, monkeypatch, caplog):
    """A vLLM without a module, class or IR op the plug-in needs: that op is not routed, with a
    clear reason in the listing and a warning in the log; the others are registered."""
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.activation", None)
    del fake_vllm.ops.fused_add_rms_norm
    with caplog.at_level("WARNING", logger="vllm.loomnb"):
        V.register()
    rs = routes()
    assert rs["SiluAndMul"].reason.startswith(
        "this vLLM has no vllm.model_executor.layers.activation.SiluAndMul (")
    assert rs["vllm.ir.ops.fused_add_rms_norm"].reason == ("this vLLM has no "
                                                         "vllm.ir.ops.fused_add_rms_norm")
    assert not rs["SiluAndMul"].routed and not rs["vllm.ir.ops.fused_add_rms_norm"].routed
    assert rs["RotaryEmbedding"].routed and rs["vllm.ir.ops.rms_norm"].routed
    assert "SiluAndMul not routed: this vLLM has no" in caplog.text
    assert "vllm.ir.ops.fused_add_rms_norm not routed: this vLLM has no" in caplog.text


def test_vllm_not_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    V._reset()
    try:
        V.register()
        rs = V.routes()
        assert len(rs) == 4 and all(not r.routed and "vLLM is not importable" in r.reason for r in rs)
    finally:
        V._reset()


def test_missing_loomnb_ops_are_listed_and_left_to_vllm(fake_vllm, monkeypatch):
    monkeypatch.delattr(loomnb, "silu_and_mul", raising=False)
    monkeypatch.delattr(loomnb, "apply_rope_with_cos_sin_cache", raising=False)
    V.register()
    rs = routes()
    assert not rs["SiluAndMul"].routed
    assert rs["SiluAndMul"].reason == "loomnb has no silu_and_mul in this version"
    assert rs["RotaryEmbedding"].reason == ("loomnb has no apply_rope_with_cos_sin_cache in this "
                                            "version")
    assert fake_vllm.oot == {}
    assert V.engine_kwargs("loomnb")["compilation_config"]["custom_ops"] == [
        "none", "+silu_and_mul", "+rotary_embedding"]


def test_loomnb_op_with_other_parameters_is_not_routed(fake_vllm, loomnb_ops, monkeypatch):
    @_traced_stub
    def apply_rope_with_cos_sin_cache(positions, q, k, head_size, cos_sin_cache, is_neox):
        raise AssertionError

    monkeypatch.setattr(loomnb, "apply_rope_with_cos_sin_cache", apply_rope_with_cos_sin_cache)
    V.register()
    r = routes()["RotaryEmbedding"]
    assert not r.routed and "leading parameters" in r.reason
    assert "RotaryEmbedding" not in fake_vllm.oot and "SiluAndMul" in fake_vllm.oot


def test_another_plugins_class_is_kept(fake_vllm, loomnb_ops):
    class Theirs(SiluAndMul):
        pass

    fake_vllm.oot["SiluAndMul"] = Theirs
    V.register()
    r = routes()["SiluAndMul"]
    assert not r.routed and "another plug-in already replaced SiluAndMul" in r.reason
    assert fake_vllm.oot["SiluAndMul"] is Theirs


def test_silu_and_mul_class_routes_and_falls_back(fake_vllm, loomnb_ops):
    V.register()
    r = routes()["SiluAndMul"]
    assert r.routed and r.enable.startswith("compilation_config={'custom_ops': ['none', '+SiluAndMul']}")
    cls = fake_vllm.oot["SiluAndMul"]
    assert issubclass(cls, SiluAndMul) and cls.name == "SiluAndMul"  # vLLM enables it by that name
    op = cls()
    x = torch.randn(3, 8, dtype=BF16)
    want = torch.nn.functional.silu(x[:, :4]) * x[:, 4:]
    assert torch.equal(op.forward_cuda(x), want) and CALLS == []          # loomnb's
    op.forward_cuda(x.float())                                            # fp32: vLLM's
    op.forward_cuda(torch.randn(3, 7, dtype=BF16))                        # odd: vLLM's
    op.forward_cuda(torch.randn(8, 3, dtype=BF16).t())                    # strided: vLLM's
    assert CALLS == ["vllm silu_and_mul"] * 3
    assert V.routed_counts() == {"silu_and_mul": 1}
    assert V.fallback_counts() == {"silu_and_mul": {  # the plug-in's reason, then the op's own
        "activation dtype float32 (routed: bfloat16, float16)": 1,
        "loomnb.silu_and_mul: argument 'x' must be of shape [..., 2*d] (an even last "
        "dimension); got shape [2, 7]": 1,
        "loomnb.silu_and_mul: argument 'x' must be contiguous in its last dimension (stride 1); "
        "got strides (1, 3) (in elements)": 1}}


def test_rotary_embedding_class_routes_and_falls_back(fake_vllm, loomnb_ops):
    V.register()
    cls = fake_vllm.oot["RotaryEmbedding"]
    assert issubclass(cls, RotaryEmbedding) and cls.name == "RotaryEmbedding"
    cache = torch.randn(32, 64, dtype=torch.float32)
    op = cls(64, cache, is_neox_style=True)
    qkv = torch.randn(5, (9 + 3 + 3) * 64, dtype=BF16)
    q, k = qkv[:, :576], qkv[:, 576:768]                       # views of the fused QKV buffer
    positions = torch.arange(5)
    qo, ko = op.forward_cuda(positions, q, k)                  # loomnb's: new tensors returned
    assert qo is not q and ko is not k and torch.equal(qo, q) and torch.equal(ko, k)
    assert CALLS == [("loomnb apply_rope", 64, True)]
    op.forward_cuda(positions.int(), q, k)                     # int32 positions: vLLM's
    assert op.forward_cuda(positions, q, None) == (q, None)    # no key: vLLM's, in place
    op.use_flashinfer = True
    op.forward_cuda(positions, q, k)                           # FlashInfer path: vLLM's
    assert CALLS[1:] == ["vllm rotary_embedding"] * 3
    assert V.routed_counts() == {"rotary_embedding": 1}
    assert V.fallback_counts() == {"rotary_embedding": {
        "loomnb.apply_rope_with_cos_sin_cache: argument 'positions' must be of dtype int64; "
        "got dtype int32": 1,
        "key is None (the out-of-place form rotates a query and a key)": 1,
        "vLLM selected its FlashInfer rotary path": 1}}


@pytest.mark.parametrize("custom_ops, want", [
    (["none", "+SiluAndMul"], "loomnb"),
    (["none", "+silu_and_mul"], "vllm"),          # vLLM's own CUDA op, as without the plug-in
    (["none"], None),                              # vLLM's torch-native forward
    (["all"], "loomnb"),
    (["all", "-silu_and_mul"], None),
    (["all", "-SiluAndMul"], None),
    (["none", "+SiluAndMul", "+silu_and_mul"], "loomnb"),
])
def test_custom_op_mode(custom_ops, want):
    assert V.custom_op_mode(custom_ops, "SiluAndMul", "silu_and_mul") == want


def test_replaced_custom_ops_keep_vllms_own_names(fake_vllm, loomnb_ops, monkeypatch):
    """The plug-in replaces the CustomOp class for every configuration; "+silu_and_mul" and
    "+rotary_embedding" must still run vLLM's own CUDA ops (an A/B giving loomnb one op at a
    time relies on it), "none" alone the torch-native forward, "+SiluAndMul" loomnb."""
    V.register()
    silu, rope = fake_vllm.oot["SiluAndMul"], fake_vllm.oot["RotaryEmbedding"]
    x = torch.randn(3, 8, dtype=BF16)
    qkv = torch.randn(5, 15 * 64, dtype=BF16)
    q, k, pos, cache = qkv[:, :576], qkv[:, 576:768], torch.arange(5), torch.randn(32, 64)
    for ops, enabled, who in ((["none", "+silu_and_mul", "+rotary_embedding"], True, "vllm"),
                              (["none", "+SiluAndMul", "+RotaryEmbedding"], True, "loomnb"),
                              (["none"], False, None)):
        monkeypatch.setattr(FakeCustomOp, "custom_ops", ops)
        CALLS.clear()
        assert silu.enabled() is enabled and rope.enabled() is enabled
        s_op, r_op = silu(), rope(64, cache)
        s_fwd, r_fwd = s_op.dispatch_forward(), r_op.dispatch_forward()
        if not enabled:
            assert s_fwd == r_fwd == "native"
            continue
        s_fwd(x)
        qo, ko = r_fwd(pos, q, k)
        if who == "vllm":
            assert CALLS == ["vllm silu_and_mul", "vllm rotary_embedding"] and qo is q
        else:
            assert CALLS == [("loomnb apply_rope", 64, True)] and qo is not q
    modes = {"vllm": 1, "loomnb": 1, "native": 1}  # one instance of each class per setting
    assert V.custom_op_modes() == {"SiluAndMul": modes, "RotaryEmbedding": modes}
    assert V.report()["custom_op_modes"] == V.custom_op_modes()
    assert "SiluAndMul instances by forward: loomnb 1, native 1, vllm 1" in V.summary()
    V.reset_counts()  # counts only: the modes were decided at construction and stay
    assert V.custom_op_modes()["SiluAndMul"] == modes


def test_ir_dispatch_falls_back_by_priority_and_counts(fake_vllm, monkeypatch):
    """With priority ['loomnb', 'vllm_c', 'native'], arguments loomnb does not take go to the next
    provider, and each decision is counted by its reason."""
    monkeypatch.setattr(F, "_CUDA", "cpu")
    V.register()
    op = fake_vllm.ops.rms_norm
    op.register_impl("vllm_c", supports_args=lambda x, weight, epsilon, variance_size=None:
                     variance_size is None)(native_rms_norm)
    prio = ["loomnb", "vllm_c", "native"]
    x, w = torch.randn(4, 64, dtype=BF16), torch.randn(64, dtype=BF16)
    assert op.dispatch(prio, x, w, 1e-6).provider == "loomnb"
    assert op.dispatch(prio, x.float(), w.float(), 1e-6).provider == "vllm_c"
    assert op.dispatch(prio, x, None, 1e-6).provider == "vllm_c"
    assert op.dispatch(prio, x, w.float() + 1, 1e-6).provider == "vllm_c"     # GemmaRMSNorm
    assert op.dispatch(prio, x, w, 1e-6, 32).provider == "native"             # variance_size
    assert V.routed_counts() == {"rms_norm": 1}
    assert V.fallback_counts()["rms_norm"] == {
        "activation dtype float32 (routed: bfloat16, float16)": 1,
        "weight is None (has_weight=False)": 1,
        "loomnb.rms_norm: argument 'weight' must be of the same dtype as 'x' (bfloat16); got "
        "dtype float32": 1,                                                       # GemmaRMSNorm
        "variance_size set (var_hidden_size)": 1}
    V.reset_counts()
    assert V.routed_counts() == {} and V.fallback_counts() == {}
    text = V.summary()
    assert "vllm.ir.ops.rms_norm -> loomnb.rms_norm(..., rounding='once')" in text and "routed" in text


# ---------------------------------------------------------------------------------------------
# The fallback checks themselves (metadata only)
def _x(*shape, dtype=BF16, device="cpu"):
    return torch.empty(*shape, dtype=dtype, device=device)


def _big():
    return torch.empty(4, 10, 10, 10, dtype=BF16)[:, :3, :2, :8]


OP_RMS = "loomnb.rms_norm: argument"
OP_FUSED = "loomnb.fused_add_rms_norm: argument"
RMS_CASES = [  # (x, weight, eps, variance_size, residual) -> reason: the plug-in's or the op's own
    ("plain", lambda: (_x(5, 576), _x(576), 1e-5, None, None), None),
    ("fused", lambda: (_x(5, 576), _x(576), 1e-5, None, _x(5, 576)), None),
    ("one token", lambda: (_x(1, 576), _x(576), 1e-5, None, None), None),
    ("1-D", lambda: (_x(576), _x(576), 1e-5, None, None), None),
    ("per-head view", lambda: (_x(5, 1152)[:, :576].view(5, 9, 64), _x(64), 1e-6, None, None), None),
    ("three strided dims", lambda: (_big(), _x(8), 1e-6, None, None),
     f"{OP_RMS} 'x' must be leading dimensions that merge into at most two strided dimensions; "
     "got shape (2, 3, 2, 8) with strides (1000, 100, 10, 1)"),  # the token dimension read as 2
    ("last dim strided", lambda: (_x(576, 5).t(), _x(576), 1e-5, None, None),
     f"{OP_RMS} 'x' must be contiguous in its last dimension (stride 1); got strides (1, 5) "
     "(in elements)"),
    ("fp32", lambda: (_x(5, 576, dtype=torch.float32), _x(576, dtype=torch.float32), 1e-5, None, None),
     "activation dtype float32 (routed: bfloat16, float16)"),
    ("fp16", lambda: (_x(5, 576, dtype=torch.float16), _x(576, dtype=torch.float16), 1e-5, None, None),
     None),
    ("no weight", lambda: (_x(5, 576), None, 1e-5, None, None), "weight is None (has_weight=False)"),
    ("variance_size", lambda: (_x(5, 576), _x(576), 1e-5, 64, None), "variance_size set (var_hidden_size)"),
    ("gemma weight", lambda: (_x(5, 576), _x(576, dtype=torch.float32), 1e-5, None, None),
     f"{OP_RMS} 'weight' must be of the same dtype as 'x' (bfloat16); got dtype float32"),
    ("weight length", lambda: (_x(5, 576), _x(512), 1e-5, None, None),
     f"{OP_RMS} 'weight' must be of shape [576] ([hidden_size]); got shape [512]"),
    ("weight strided", lambda: (_x(5, 576), _x(1152)[::2], 1e-5, None, None),
     f"{OP_RMS} 'weight' must be contiguous (stride 1); got stride 2"),
    ("residual dtype", lambda: (_x(5, 576), _x(576), 1e-5, None, _x(5, 576, dtype=torch.float16)),
     f"{OP_FUSED} 'residual' must be of the same dtype as 'x' (bfloat16); got dtype float16"),
    ("residual strided", lambda: (_x(5, 576), _x(576), 1e-5, None, _x(576, 5).t()),
     f"{OP_FUSED} 'residual' must be contiguous in its last dimension (stride 1); got strides "
     "(1, 5) (in elements)"),
    ("residual broadcast", lambda: (_x(5, 576), _x(576), 1e-5, None, _x(1, 576).expand(5, 576)),
     f"{OP_FUSED} 'residual' must be an array whose elements do not overlap each other; got "
     "shape (2, 576) with strides (0, 1) (in elements)"),
    ("eps nan", lambda: (_x(5, 576), _x(576), float("nan"), None, None),
     f"{OP_RMS} 'eps' must be finite and >= 0; got nan"),
    ("eps negative", lambda: (_x(5, 576), _x(576), -1e-6, None, None),
     f"{OP_RMS} 'eps' must be finite and >= 0; got -1e-06"),
    ("eps bool", lambda: (_x(5, 576), _x(576), True, None, None),
     f"{OP_RMS} 'eps' must be a real number; got True"),
    ("weight off CUDA", lambda: (_x(5, 576), _x(576, device="meta"), 1e-5, None, None),
     "weight is not a CUDA tensor"),
]


@pytest.mark.parametrize("make,want", [c[1:] for c in RMS_CASES], ids=[c[0] for c in RMS_CASES])
def test_rms_norm_fallback_reasons(monkeypatch, make, want):
    monkeypatch.setattr(F, "_CUDA", "cpu")
    x, w, eps, vs, res = make()
    assert V.rms_norm_fallback_reason(x, w, eps, vs, res) == want


def test_rms_norm_not_routed_off_cuda():
    assert V.rms_norm_fallback_reason(_x(5, 576), _x(576), 1e-5) == "not a CUDA tensor"


def test_routing_is_the_ops_own_validation(monkeypatch):
    """One source of truth: what the op's validation raises is the reason, and what it accepts
    is routed -- a layout the op learns to take needs no change in the plug-in."""
    from loomnb.checks import LoomnbValueError as Err
    from loomnb.ops import norm
    monkeypatch.setattr(F, "_CUDA", "cpu")
    V._reset()  # forget cached decisions
    x, w = _x(5, 576), _x(576)
    assert V.rms_norm_fallback_reason(x, w, 1e-5) is None

    def narrower(op, x_obj, weight_obj, eps):
        raise Err(f"{op}: argument 'x' must be narrower; got {list(x_obj.shape)}")

    monkeypatch.setattr(norm, "_inputs", narrower)
    V._reset()
    try:
        assert V.rms_norm_fallback_reason(x, w, 1e-5) == ("loomnb.rms_norm: argument 'x' must be "
                                                         "narrower; got [2, 576]")
    finally:
        monkeypatch.undo()
        V._reset()


def test_decisions_are_cached_by_metadata(monkeypatch):
    """A decision depends on the call's metadata only: a second call with the same metadata (a
    new num_tokens included) asks the op no more."""
    monkeypatch.setattr(F, "_CUDA", "cpu")
    V._reset()
    for n in (5, 17, 1823):
        assert V.rms_norm_fallback_reason(_x(n, 576), _x(576), 1e-5) is None
        assert V.silu_and_mul_fallback_reason(_x(n, 7)).startswith("loomnb.silu_and_mul:")
    info = F._decide.cache_info()
    assert (info.misses, info.hits) == (2, 4)
    V._reset()


def test_reasons_on_fake_tensors_with_a_symbolic_token_dimension(monkeypatch):
    """What vLLM's lowering pass passes: fake tensors whose token dimension is symbolic. The
    check decides without guarding on it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)
    monkeypatch.setattr(F, "_CUDA", "cpu")
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)

    def fake(t, dynamic=True):
        dims = [DimDynamic.DYNAMIC if dynamic else DimDynamic.STATIC] + [DimDynamic.STATIC] * (t.dim() - 1)
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))

    x, res, w = fake(_x(5, 576)), fake(_x(5, 576)), fake(_x(576), dynamic=False)
    qkv, w64 = fake(_x(5, 960)), fake(_x(64), dynamic=False)
    with mode:
        q = qkv[:, :576].view(-1, 9, 64)
    pos, cache = fake(torch.arange(5)), fake(_x(32, 64), dynamic=False)
    odd = mode.from_tensor(_x(5, 576), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.STATIC, DimDynamic.DYNAMIC]))
    assert isinstance(x.shape[0], torch.SymInt)
    V._reset()
    for active in (False, True):  # the lowering pass may ask with the fake mode active
        with mode if active else contextlib.nullcontext():
            assert V.rms_norm_fallback_reason(x, w, 1e-5) is None
            assert V.rms_norm_fallback_reason(x, w, 1e-5, x_residual=res) is None
            assert V.rms_norm_fallback_reason(q, w64, 1e-5) is None
            assert V.rms_norm_fallback_reason(x, fake(_x(64), dynamic=False), 1e-5).startswith(
                "loomnb.rms_norm: argument 'weight' must be of shape [576]")
            assert V.rotary_embedding_fallback_reason(pos, q, qkv[:, 576:768], 64, cache) is None
            assert V.rms_norm_fallback_reason(odd, w, 1e-5) == F.SYMBOLIC
    assert env.guards == []


OP_ROPE = "loomnb.apply_rope_with_cos_sin_cache: argument"


def test_rotary_embedding_fallback_reasons(monkeypatch):
    monkeypatch.setattr(F, "_CUDA", "cpu")
    qkv = _x(5, 15 * 64)
    q, k, pos = qkv[:, :576], qkv[:, 576:768], torch.arange(5)
    cache = _x(32, 64)
    reason = V.rotary_embedding_fallback_reason
    assert reason(pos, q, k, 64, cache) is None
    assert reason(pos, q.view(5, 9, 64), k.view(5, 3, 64), 64, cache) is None
    assert reason(pos, q, k, 64, _x(32, 32)) is None                          # partial rotary
    assert reason(pos, q, k, 64, _x(32, 62)) is None
    # what the op takes and the plug-in's own rules once refused: routed now
    assert reason(pos, q, k, 64, cache.float()) is None                      # a float32 cache
    assert reason(pos, q, qkv[:, 576:832], 64, cache) is None                # 4 key heads for 9
    assert reason(pos, q.view(5, 9, 64), qkv[:, 576:].view(5, 6, 64)[:, ::2], 64, cache) is None
    # the plug-in's own reasons
    assert reason(pos, q, None, 64, cache).startswith("key is None")
    assert reason(pos, q.float(), k.float(), 64, cache.float()).startswith("activation dtype float32")
    assert reason(pos.to("meta"), q, k, 64, cache) == "positions is not a CUDA tensor"
    # the op's own: its messages (the token dimension read as 2)
    assert reason(pos, q, k, 64, _x(32, 66)) == (f"{OP_ROPE} 'cos_sin_cache' must be rot_dim <= "
                                                 "head_size = 64; got rot_dim 66")
    assert reason(pos, q, k, 64, _x(32, 0)) == (f"{OP_ROPE} 'cos_sin_cache' must be an even "
                                                "rot_dim = cos_sin_cache.shape[1] >= 2; got shape "
                                                "[32, 0]")
    assert reason(pos, q, k, 60, cache) == (f"{OP_ROPE} 'query' must be a last dimension that is "
                                            "a positive multiple of head_size = 60; got shape "
                                            "[2, 576]")
    assert reason(pos.view(1, 5), q, k, 64, cache).startswith(f"{OP_ROPE} 'query' must be 3-D")
    assert reason(pos.int(), q, k, 64, cache) == (f"{OP_ROPE} 'positions' must be of dtype "
                                                  "int64; got dtype int32")
    assert reason(pos, q, k.float(), 64, cache) == (f"{OP_ROPE} 'key' must be of the same dtype "
                                                    "as 'query' (bfloat16); got dtype float32")
    assert reason(pos, q, k, 64, cache, 1) == f"{OP_ROPE} 'is_neox' must be a bool; got 1"


def test_silu_and_mul_fallback_reasons(monkeypatch):
    assert V.silu_and_mul_fallback_reason(_x(3, 8)) == "not a CUDA tensor"
    monkeypatch.setattr(F, "_CUDA", "cpu")
    assert V.silu_and_mul_fallback_reason(_x(3, 8)) is None
    assert V.silu_and_mul_fallback_reason(_x(2, 3, 8)) is None
    assert V.silu_and_mul_fallback_reason(_x(3, 8, dtype=torch.float16)) is None
    assert V.silu_and_mul_fallback_reason(_x(3, 16)[:, :8]) is None  # rows of a wider buffer
    assert V.silu_and_mul_fallback_reason(_big()) == (
        "loomnb.silu_and_mul: argument 'x' must be leading dimensions that merge into at most "
        "two strided dimensions; got shape (2, 3, 2, 4) with strides (1000, 100, 10, 1)")


# ---------------------------------------------------------------------------------------------
# What vLLM's compile path sees
def test_lowering_trace_calls_the_loomnb_custom_ops():
    """vLLM's lowering pass traces an implementation with make_fx on fake tensors: each norm
    must become one torch.ops.loomnb node with rounding='once' (and the in-place fused add
    mutates its inputs, as vLLM's own vllm_c implementation does)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    with FakeTensorMode():
        x = torch.empty(5, 576, dtype=BF16, device="cuda")
        w = torch.empty(576, dtype=BF16, device="cuda")
    gm = make_fx(lambda x, w: V.ir_rms_norm(x, w, 1e-5), tracing_mode="fake")(x, w)
    assert "torch.ops.loomnb.rms_norm.default(x_1, w_1, 1e-05, rounding = 'once')" in gm.code
    gm = make_fx(lambda x, r, w: V.ir_fused_add_rms_norm(x.clone(), r.clone(), w, 1e-5),
                 tracing_mode="fake")(x, x, w)
    assert "torch.ops.loomnb.fused_add_rms_norm.default(clone, clone_1, w_1, 1e-05, rounding = 'once')" in gm.code
    assert "return (clone, clone_1)" in gm.code


def test_eager_calls_go_straight_to_the_python_op():
    """Eager, real tensors: the implementation calls loomnb's Python op (no dispatcher hop). On a
    CPU tensor that op's own check answers -- the dispatcher path would find no CPU kernel."""
    with pytest.raises(loomnb.LoomnbTypeError, match="host torch tensor"):
        V.ir_rms_norm(_x(2, 8), _x(8), 1e-5)
    with pytest.raises(loomnb.LoomnbTypeError, match="host torch tensor"):
        V.ir_fused_add_rms_norm(_x(2, 8), _x(2, 8), _x(8), 1e-5)


def test_customop_decision_is_counted_once_per_trace(fake_vllm, loomnb_ops):
    """Under torch.compile (fullgraph, as vLLM compiles) the CustomOp's decision is made and
    counted once at trace time; eager calls count each time."""
    V.register()
    op = fake_vllm.oot["SiluAndMul"]()
    compiled = torch.compile(lambda x: op.forward_cuda(x), fullgraph=True, backend="eager")
    x = torch.randn(4, 8, dtype=BF16)
    want = torch.nn.functional.silu(x[:, :4]) * x[:, 4:]
    assert torch.equal(compiled(x), want) and torch.equal(compiled(x), want)
    assert V.routed_counts() == {"silu_and_mul": 1}
    op.forward_cuda(x)
    assert V.routed_counts() == {"silu_and_mul": 2}
    odd = torch.randn(4, 7, dtype=BF16)  # the op's own reason, asked at trace time
    compiled = torch.compile(lambda x: op.forward_cuda(x), fullgraph=True, backend="eager")
    for _ in range(2):
        CALLS.clear()  # the fake's record of vLLM's forward: Dynamo guards on it
        compiled(odd)
    assert CALLS == ["vllm silu_and_mul"]
    assert V.fallback_counts() == {"silu_and_mul": {
        "loomnb.silu_and_mul: argument 'x' must be of shape [..., 2*d] (an even last dimension); "
        "got shape [2, 7]": 1}}


def test_rope_decision_under_dynamo_with_a_dynamic_token_dimension(fake_vllm, loomnb_ops):
    """vLLM's compile: the token dimension marked dynamic, RoPE's inputs views of one QKV
    buffer. The decision is made once at trace time, asks the op, and specialises nothing."""
    V.register()
    op = fake_vllm.oot["RotaryEmbedding"](64, torch.randn(32, 64))

    def forward(positions, qkv):
        return op.forward_cuda(positions, qkv[:, :576], qkv[:, 576:768])

    compiled = torch.compile(forward, fullgraph=True, backend="eager")
    for n in (5, 9, 17):
        qkv, pos = torch.randn(n, 15 * 64, dtype=BF16), torch.arange(n)
        torch._dynamo.mark_dynamic(qkv, 0)
        torch._dynamo.mark_dynamic(pos, 0)
        CALLS.clear()  # the stub's record: Dynamo guards on it
        qo, ko = compiled(pos, qkv)
        assert qo.shape == (n, 576) and ko.shape == (n, 192)
    assert V.routed_counts() == {"rotary_embedding": 1} and V.fallback_counts() == {}


# ---------------------------------------------------------------------------------------------
def test_engine_kwargs(monkeypatch, loomnb_ops):
    assert V.engine_kwargs("default") == {}
    assert V.engine_kwargs("vllm_ops") == {
        "ir_op_priority": {"rms_norm": ["vllm_c", "native"], "fused_add_rms_norm": ["vllm_c", "native"]},
        "compilation_config": {"custom_ops": ["none", "+silu_and_mul", "+rotary_embedding"]}}
    assert V.engine_kwargs("loomnb") == {
        "ir_op_priority": {"rms_norm": ["loomnb", "vllm_c", "native"],
                           "fused_add_rms_norm": ["loomnb", "vllm_c", "native"]},
        "compilation_config": {"custom_ops": ["none", "+SiluAndMul", "+RotaryEmbedding"]}}
    with pytest.raises(LoomnbValueError, match="argument 'config' must be one of"):
        V.engine_kwargs("fast")
    # one op at a time: the others take vLLM's own CUDA ops
    assert V.engine_kwargs("loomnb", ops=("rms_norm", "fused_add_rms_norm")) == {
        "ir_op_priority": {"rms_norm": ["loomnb", "vllm_c", "native"],
                           "fused_add_rms_norm": ["loomnb", "vllm_c", "native"]},
        "compilation_config": {"custom_ops": ["none", "+silu_and_mul", "+rotary_embedding"]}}
    assert V.engine_kwargs("loomnb", ops="RotaryEmbedding") == {
        "ir_op_priority": {"rms_norm": ["vllm_c", "native"], "fused_add_rms_norm": ["vllm_c", "native"]},
        "compilation_config": {"custom_ops": ["none", "+silu_and_mul", "+RotaryEmbedding"]}}
    assert V.engine_kwargs("loomnb", ops=V.OPS) == V.engine_kwargs("loomnb")
    for bad in (("silu_and_mul",), ("rms_norm",)):
        cfg = "loomnb" if bad == ("silu_and_mul",) else "vllm_ops"
        with pytest.raises(LoomnbValueError, match="argument 'ops' must be a subset"):
            V.engine_kwargs(cfg, ops=bad)


def test_entry_point_is_declared():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    eps = meta["project"]["entry-points"]["vllm.general_plugins"]
    assert eps == {"loomnb": "loomnb.integrations.vllm:register"}
    module, func = eps["loomnb"].split(":")
    assert getattr(importlib.import_module(module), func) is V.register


def test_this_loomnbs_ops_are_routable():
    """The real ops (not the stubs) have the parameters and torch custom ops the CustomOp routes
    call, so a vLLM run with this checkout routes all four ops."""
    for _, _, name, params, _ in V.CUSTOM_OPS.values():
        fn, why = V.loomnb_op(name, params)
        assert fn is getattr(loomnb, name) and why is None, why


def test_importing_loomnb_imports_neither_vllm_nor_the_plugin(tmp_path):
    """A ``vllm`` package that records being imported sits first on the path: ``import loomnb``
    and ``import loomnb.integrations.vllm`` must not touch it (only register() does)."""
    fake = tmp_path / "vllm"
    fake.mkdir()
    marker = tmp_path / "imported"
    (fake / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    code = ("import sys, loomnb; a = 'loomnb.integrations.vllm' in sys.modules; "
            "import loomnb.integrations.vllm; print(a)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path), str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False" and not marker.exists()


def test_against_the_installed_vllm():
    """Where vLLM is installed (the GPU machine's vLLM 0.24.0): the live native signatures equal
    the copies above, and register() routes both norms."""
    try:
        import vllm  # noqa: F401
        import vllm.ir
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"vLLM is not importable here ({type(e).__name__}); the plug-in's live "
                    "checks run where vLLM 0.24 is installed")
    from vllm.platforms import current_platform
    for name in NATIVE:
        native = getattr(vllm.ir.ops, name).impls["native"].impl_fn
        assert infer_schema(native, mutates_args=[]) == NATIVE_SCHEMAS[name]
    V._reset()
    try:
        V.register()
        norms = [r for r in V.routes() if r.vllm_op.startswith("vllm.ir.ops.")]
        if current_platform.is_cuda():
            assert len(norms) == 2 and all(r.routed for r in norms), V.summary()
        else:
            assert all(not r.routed and "not CUDA" in r.reason for r in norms), V.summary()
        for name in NATIVE:
            assert getattr(vllm.ir.ops, name).impls["loomnb"].impl_fn is V.IR_OPS[name][0]
    finally:
        V._reset()


# ---------------------------------------------------------------------------------------------
# The A/B benchmark's plumbing with its fake engine
def _bench():
    spec = importlib.util.spec_from_file_location("bench_vllm_ab", REPO / "benchmarks" / "bench_vllm_ab.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_bench_dry_run_end_to_end(tmp_path):
    """Fresh processes for (a), (b), (c) in both orders; (c) finds the plug-in's entry point
    through the generated .dist-info and gets VLLM_PLUGINS=loomnb, the others none; tokens
    compared, with an injected divergence reported at its prompt and position with both runs'
    logprobs of both tokens; TPOT, tokens/s, init time and launches per step for every run."""
    out = tmp_path / "ab.json"
    env = dict(os.environ, LOOMNB_FAKE_DIVERGE="loomnb:3:5")
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_vllm_ab.py"), "--dry-run",
                        "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    runs = res["runs"]
    assert [(r["order"], r["config"]) for r in runs] == [
        ("forward", "default"), ("forward", "vllm_ops"), ("forward", "loomnb"),
        ("reversed", "loomnb"), ("reversed", "vllm_ops"), ("reversed", "default")]
    assert len({r["pid"] for r in runs} | {res["parent_pid"]}) == 7  # six fresh processes
    for r in runs:
        plugin = r["config"] == "loomnb"
        assert r["env"]["VLLM_PLUGINS"] == ("loomnb" if plugin else "")
        assert r["env"]["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
        assert r["env"]["VLLM_DISABLE_COMPILE_CACHE"] == "1"
        if plugin:
            assert "loomnb = loomnb.integrations.vllm:register" in r["entry_points"]
        assert r["engine_kwargs"] == V.engine_kwargs(r["config"])
        assert r["plugin"]["loaded"] is plugin
        assert set(r["timing"]) == {"1", "8", "64"}
        speed = {"default": 1.0, "vllm_ops": 0.95, "loomnb": 0.9}[r["config"]]  # the fake's
        for batch, v in r["timing"].items():
            assert v["tpot_ms"] == pytest.approx(0.04 * speed)
            assert v["tokens_per_s"] == pytest.approx(int(batch) * 256 / (1e-3 + 256 * 4e-5 * speed))
        assert r["init_s"] == 0.5
        assert r["launches"]["1"]["loomnb_per_step"] == (61 if plugin else 0)
        assert len(r["check"]["tokens"]) == 8 and all(len(t) == 32 for t in r["check"]["tokens"])
    a = res["analysis"]
    c_vs_b = [t for t in a["tokens"] if t["a"].startswith("loomnb/") and t["b"].startswith("vllm_ops/")]
    assert len(c_vs_b) == 2 and not a["targets"]["tokens_c_identical_to_b"]
    d = c_vs_b[0]["first_divergences"]
    assert [(x["prompt"], x["position"]) for x in d] == [(3, 5)]
    ta, tb = d[0]["tokens"]["loomnb/forward"], d[0]["tokens"]["vllm_ops/forward"]
    assert ta != tb
    assert d[0]["logprobs"]["loomnb/forward"] == {str(ta): -0.25, str(tb): -2.5}
    assert d[0]["logprobs"]["vllm_ops/forward"] == {str(ta): -1.75, str(tb): -0.25}
    assert all(t["identical"] for t in a["tokens_across_orders"])
    assert set(a["tpot"]) == {"forward", "reversed"}
    for order in ("forward", "reversed"):
        for batch in ("1", "8", "64"):
            assert a["tpot"][order][batch]["loomnb_speedup_vs_faster_peer"] == pytest.approx(0.95 / 0.9)
    assert a["targets"]["tpot_target_met"] and a["targets"]["all_runs_completed"]
    assert "TPOT (ms)" in p.stdout and "first divergence 3@5" in p.stdout


def test_bench_tensor_parallel_collects_every_ranks_report(tmp_path):
    """--tensor-parallel-size 2: vLLM gets tensor_parallel_size=2 and NVLink multicast off; the
    plug-in's report comes from both workers (the fake engine's ranks 0 and 1), and the target
    says it was loaded in every rank; a report missing a rank fails it."""
    out = tmp_path / "tp.json"
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_vllm_ab.py"), "--dry-run",
                        "--configs", "vllm_ops,loomnb", "--orders", "forward",
                        "--tensor-parallel-size", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    for r in res["runs"]:
        assert r["env"]["NCCL_NVLS_ENABLE"] == "0" and len(r["plugin_per_rank"]) == 2
    ranks = res["analysis"]["plugin_per_rank"]
    assert list(ranks) == ["loomnb/forward"] and ranks["loomnb/forward"]["ranks"] == [0, 1]
    assert ranks["loomnb/forward"]["devices"] == ["cuda:0", "cuda:1"]
    assert res["analysis"]["targets"]["plugin_in_every_rank"]
    bench = _bench()
    run = next(r for r in res["runs"] if r["config"] == "loomnb")
    run["plugin_per_rank"] = run["plugin_per_rank"][:1]
    assert not bench.plugin_ranks([run], {"tensor_parallel_size": 2})["loomnb/forward"]["loaded_in_every_rank"]


def test_bench_one_op_at_a_time(tmp_path):
    """The ISOLATED configurations give one op family to loomnb each (the plug-in loaded, the
    engine arguments of engine_kwargs(ops=...)), check tokens only, and each is compared with
    (b): a divergence injected into the norms' run is traced to the norms."""
    out = tmp_path / "iso.json"
    env = dict(os.environ, LOOMNB_FAKE_DIVERGE="loomnb_norms:0:17")
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_vllm_ab.py"), "--dry-run",
                        "--configs", "vllm_ops,loomnb_norms,loomnb_silu,loomnb_rope",
                        "--orders", "forward", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert [r["config"] for r in res["runs"]] == ["vllm_ops", "loomnb_norms", "loomnb_silu",
                                                  "loomnb_rope"]
    for r in res["runs"][1:]:
        assert r["env"]["VLLM_PLUGINS"] == "loomnb" and r["plugin"]["loaded"]
        assert r["timing"] == {} and r["launches"] == {}
    assert res["runs"][1]["engine_kwargs"] == V.engine_kwargs(
        "loomnb", ops=("rms_norm", "fused_add_rms_norm"))
    assert res["runs"][3]["engine_kwargs"]["compilation_config"]["custom_ops"] == [
        "none", "+silu_and_mul", "+RotaryEmbedding"]
    t = res["analysis"]["targets"]
    assert t["tokens_identical_to_b_with_only"] == {"loomnb_norms": False, "loomnb_silu": True,
                                                    "loomnb_rope": True}
    assert t["all_runs_completed"]


def test_bench_control_plugins(fake_vllm, loomnb_ops, monkeypatch):
    """The A/B's control plug-in: ``vllm_rope_copy`` runs vLLM's RoPE on contiguous copies;
    ``rope_check`` returns loomnb's result and counts, on the device, the 16-bit values where
    vLLM's op on the same inputs differs (here: a loomnb stub that is exact, then one that is
    off in one value), also under torch.compile; ``rope_plain`` calls loomnb's RoPE alone."""
    sys.path.insert(0, str(REPO))
    import benchmarks.bench_vllm_ab as ab
    qkv = torch.randn(3, 15 * 4, dtype=BF16)
    q, k, pos, cache = qkv[:, :36], qkv[:, 36:48], torch.arange(3), torch.randn(8, 4)
    monkeypatch.setenv("LOOMNB_AB_CONTROL", "vllm_rope_copy")
    ab.register_control()
    op = fake_vllm.oot.pop("RotaryEmbedding")(4, cache)
    qo, ko = op.forward_cuda(pos, q, k)
    assert qo.is_contiguous() and qo.data_ptr() != q.data_ptr() and torch.equal(qo, q)
    assert CALLS == ["vllm rotary_embedding"]
    monkeypatch.setenv("LOOMNB_AB_CONTROL", "rope_check")
    monkeypatch.setattr(ab, "_ROPE_NE", None)
    ab.register_control()
    op = fake_vllm.oot["RotaryEmbedding"](4, cache)
    qo, ko = op.forward_cuda(pos, q, k)
    assert torch.equal(qo, q) and CALLS[-2:] == [("loomnb apply_rope", 4, True),
                                                 "vllm rotary_embedding"]
    assert ab._ROPE_NE.tolist() == [0, 144]  # 3 x 36 query and 3 x 12 key values
    off = loomnb_ops.apply_rope_with_cos_sin_cache

    def one_off(*a, **kw):
        qo, ko = off(*a, **kw)
        qo[1, 2] += 1
        return qo, ko

    monkeypatch.setattr(loomnb, "apply_rope_with_cos_sin_cache", one_off)
    compiled = torch.compile(lambda p, x, y: op.forward_cuda(p, x, y), fullgraph=True,
                             backend="inductor")
    compiled(pos, q, k)
    compiled(pos, q, k)
    assert ab._ROPE_NE.tolist() == [2, 3 * 144]
    fake_vllm.oot.pop("RotaryEmbedding")
    monkeypatch.setenv("LOOMNB_AB_CONTROL", "rope_plain")  # loomnb's RoPE alone
    ab.register_control()
    CALLS.clear()
    qo, ko = fake_vllm.oot["RotaryEmbedding"](4, cache).forward_cuda(pos, q, k)
    assert qo is not q and CALLS == [("loomnb apply_rope", 4, True)]


def test_bench_checks_each_runs_custom_op_forwards():
    """The A/B reads which forward each CustomOp instance got and flags a loomnb run whose
    forwards are not what its configuration asks for (as the plug-in's class selection once
    gave vLLM's torch-native SiLU-and-mul to ``loomnb_rope``)."""
    ab = _bench()
    run = {"config": "loomnb_rope", "order": "forward",
           "plugin": {"custom_op_modes": {"SiluAndMul": {"vllm": 1},
                                          "RotaryEmbedding": {"loomnb": 1}}}}
    assert ab.run_forwards(run)["as_configured"]
    run["plugin"]["custom_op_modes"]["SiluAndMul"] = {"native": 1}
    f = ab.run_forwards(run)
    assert not f["as_configured"] and f["want"] == {"SiluAndMul": "vllm", "RotaryEmbedding": "loomnb"}
    run = {"config": "loomnb", "order": "forward",
           "plugin": {"custom_op_modes": {"SiluAndMul": {"loomnb": 2}, "RotaryEmbedding": {"loomnb": 1}}}}
    assert ab.run_forwards(run)["as_configured"]
    assert ab.run_forwards({"config": "loomnb", "order": "forward", "plugin": {}}) is None


def test_bench_merge_of_one_order_per_run(tmp_path):
    """Each order in its own run (one GPU command each), then --merge: one result with both
    orders' comparisons, as if run together."""
    bench = [sys.executable, str(REPO / "benchmarks" / "bench_vllm_ab.py"), "--dry-run"]
    for order in ("forward", "reversed"):
        p = subprocess.run(bench + ["--orders", order, "--out", str(tmp_path / f"{order}.json")],
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout + p.stderr
    p = subprocess.run(bench + ["--merge", str(tmp_path / "forward.json"), str(tmp_path / "reversed.json"),
                                "--out", str(tmp_path / "both.json")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    a = json.loads((tmp_path / "both.json").read_text())["analysis"]
    assert set(a["tpot"]) == {"forward", "reversed"} and len(a["tokens"]) == 6
    assert len(a["tokens_across_orders"]) == 3 and a["targets"]["tokens_c_identical_to_b"]


def test_bench_launch_count_cancels_the_prefill():
    bench = _bench()

    class Eng:
        def profile(self, prompts, n):  # 3 kernels per step + 5 once (prefill and set-up)
            return {"_ZN6loomnb3ops_norm": [2 * n + 1, 3.0 * n], "other": [n + 4, 10.0 * n + 7],
                    "Memcpy HtoD (Pageable -> Device)": [n, 1.0]}

    got = bench.launches(Eng(), ["p"], [8, 24])
    assert (got["loomnb_per_step"], got["kernels_per_step"]) == (2, 3)
    assert (got["loomnb_us_per_step"], got["device_us_per_step"]) == (3.0, 13.0)
    assert got["top_kernels"][0]["name"] == "other"

    class Broken:
        def profile(self, prompts, n):
            raise RuntimeError("no CUPTI")

    assert bench.launches(Broken(), ["p"], [8, 24]) == {"steps": [8, 24], "error": "RuntimeError: no CUPTI"}


def test_bench_compare_tokens_length_mismatch():
    bench = _bench()
    a = {"config": "loomnb", "order": "forward", "check": {"tokens": [[1, 2, 3]], "logprobs": None}}
    b = {"config": "vllm_ops", "order": "forward", "check": {"tokens": [[1, 2]], "logprobs": None}}
    got = bench.compare_tokens(a, b)
    assert not got["identical"] and got["first_divergences"][0]["position"] == 2
    assert got["first_divergences"][0]["tokens"] == {"loomnb/forward": 3, "vllm_ops/forward": None}


def test_bench_failed_and_hung_processes(tmp_path):
    """A process that fails is reported with its log's tail and makes the exit status 1; one
    that hangs after writing its results is killed at the timeout (its process group) and its
    results are kept, with the exit recorded."""
    out = tmp_path / "ab.json"
    env = dict(os.environ, LOOMNB_FAKE_FAIL="vllm_ops", LOOMNB_FAKE_HANG="default")
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_vllm_ab.py"), "--dry-run",
                        "--orders", "forward", "--timeout", "10", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stdout + p.stderr
    runs = {r["config"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["default"]["exit"] == "timeout" and "timing" in runs["default"]
    assert runs["vllm_ops"]["error"] == "child exited 1"
    assert any("fails to start" in line for line in runs["vllm_ops"]["log_tail"])
    assert runs["loomnb"]["exit"] == 0
    res = json.loads(out.read_text())["analysis"]
    assert res["targets"]["all_runs_completed"] is False
    assert res["tpot"]["forward"]["1"]["tpot_ms"].keys() == {"default", "loomnb"}


def test_bench_rejects_unknown_configs():
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_vllm_ab.py"), "--dry-run",
                        "--configs", "default,fast"], capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "unknown configuration 'fast'" in p.stderr


# ---------------------------------------------------------------------------------------------
# On a GPU: the implementations vLLM calls, on CUDA tensors
def _np(t):
    t = t.detach().cpu()
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == BF16 else t.numpy()


def _same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.gpu
def test_gpu_implementations_equal_loomnb_and_the_oracle():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, 576, generator=g, device="cuda").to(BF16)
    r = torch.randn(37, 576, generator=g, device="cuda").to(BF16)
    w = torch.randn(576, generator=g, device="cuda").to(BF16)
    eps = 1e-5
    assert V.rms_norm_fallback_reason(x, w, eps) is None
    assert V.rms_norm_fallback_reason(x, w, eps, x_residual=r) is None
    y = V.ir_rms_norm(x, w, eps)
    assert _same_bits(y, loomnb.rms_norm(x, w, eps, rounding="once"))
    assert _same_bits(y, torch.ops.loomnb.rms_norm(x, w, eps, rounding="once"))
    np.testing.assert_array_equal(_np(y).view(np.uint16), loomnb.oracle.rms_norm(
        _np(x), _np(w), eps, rounding="once").view(np.uint16))
    x1, r1 = x.clone(), r.clone()
    out = V.ir_fused_add_rms_norm(x1, r1, w, eps)
    assert out[0] is x1 and out[1] is r1
    xo, ro = _np(x).copy(), _np(r).copy()
    loomnb.oracle.fused_add_rms_norm(xo, ro, _np(w), eps, rounding="once")
    np.testing.assert_array_equal(_np(x1).view(np.uint16), xo.view(np.uint16))
    np.testing.assert_array_equal(_np(r1).view(np.uint16), ro.view(np.uint16))


@pytest.mark.gpu
def test_gpu_traced_form_and_graph_capture():
    """The make_fx form vLLM's lowering inserts runs the same kernels; both implementations
    capture into a CUDA graph (vLLM's decode path) and replay to the eager bits."""
    from torch.fx.experimental.proxy_tensor import make_fx
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(8, 576, generator=g, device="cuda").to(BF16)
    r = torch.randn(8, 576, generator=g, device="cuda").to(BF16)
    w = torch.randn(576, generator=g, device="cuda").to(BF16)
    gm = make_fx(lambda x, w: V.ir_rms_norm(x, w, 1e-5), tracing_mode="fake")(x, w)
    assert "torch.ops.loomnb.rms_norm" in gm.code
    assert _same_bits(gm(x, w), loomnb.rms_norm(x, w, 1e-5, rounding="once"))

    want_y = V.ir_rms_norm(x, w, 1e-5)
    want_x, want_r = x.clone(), r.clone()
    V.ir_fused_add_rms_norm(want_x, want_r, w, 1e-5)
    xs, xa, ra = x.clone(), x.clone(), r.clone()  # the graph's static buffers
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on the same buffers, off the capture (as vLLM does)
        V.ir_rms_norm(xs, w, 1e-5)
        V.ir_fused_add_rms_norm(xa, ra, w, 1e-5)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ya = V.ir_rms_norm(xs, w, 1e-5)
        V.ir_fused_add_rms_norm(xa, ra, w, 1e-5)
    xa.copy_(x)
    ra.copy_(r)
    graph.replay()
    torch.cuda.synchronize()
    assert _same_bits(ya, want_y) and _same_bits(xa, want_x) and _same_bits(ra, want_r)
