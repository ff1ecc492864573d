"""The tensorrt backend's plain-Python parts, on the CPU: required settings, weight provenance."""

import inspect

import pytest
import torch

from prx_compile import BackendUnavailableError
from prx_compile.backends.tensorrt import backend as trt_backend
from prx_compile.backends.tensorrt import engine, shim
from prx_compile.backends.tensorrt.backend import TensorRTBackend, _check_provenance, _match_constant
from prx_compile.config import CompileConfig
from prx_compile.ops import LINEAR, PRX_ATTENTION
from prx_compile.shapes import ShapeRange

from .conftest import plan_of


def fake_compile(exported_program, *, attn_bias_is_causal=True, truncate_double=False, device=None, **kwargs):
    """The shape of torch_tensorrt.dynamo.compile's signature, minus options."""


def test_required_settings_are_required(monkeypatch):
    monkeypatch.setattr(shim, "torch_tensorrt", lambda: type("T", (), {"__version__": "9.9"}))
    got = shim.compile_settings(
        {"attn_bias_is_causal": False, "truncate_double": True}, {"decompose_attention": False}, fake_compile
    )
    assert got == {
        "attn_bias_is_causal": False,
        "truncate_double": True,
    }  # an unknown optional one is left out
    assert "kwargs" in inspect.signature(fake_compile).parameters
    with pytest.raises(BackendUnavailableError, match=r"\['immutable_weights'\].*needs to be correct"):
        shim.compile_settings(
            {"immutable_weights": True, "device": "cuda"}, {}, lambda ep, *, device=None: None
        )


def test_constants_are_traced_to_parameters_by_value():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=g)
    b = torch.randn(6, generator=g)
    twin = w.clone()  # same values under another name: ambiguous
    originals = {"model.lin.weight": w, "model.lin.bias": b}
    assert _match_constant(w.t().contiguous(), originals, ["model.lin.weight"]) == ("model.lin.weight", "t")
    assert _match_constant(b.clone(), originals, ["model.lin.bias"]) == ("model.lin.bias", "id")
    assert _match_constant(w + 1, originals, ["model.lin.weight"]) is None
    both = {**originals, "model.other.weight": twin}
    assert _match_constant(w.clone(), both, ["model.lin.weight", "model.other.weight"]) is None


def test_saved_provenance_is_validated():
    params = {"blocks.0.attention.img_qkv_proj.weight": 2, "blocks.0.attention.img_qkv_proj.bias": 1}
    ok = {
        "_frozen_param3": ["blocks.0.attention.img_qkv_proj.weight", "t"],
        "model.blocks.0.attention.img_qkv_proj.weight": ["blocks.0.attention.img_qkv_proj.weight", "id"],
    }
    assert _check_provenance(ok, params) == {k: tuple(v) for k, v in ok.items()}
    for bad in (
        {"x": ["no.such.weight", "t"]},
        {"x": ["blocks.0.attention.img_qkv_proj.weight", "exec"]},
        {"x": [[1], "id"]},
        {"x": ["blocks.0.attention.img_qkv_proj.bias", "t"]},  # only a matrix is transposed
        [],
    ):
        with pytest.raises(ValueError):
            _check_provenance(bad, params)


@pytest.mark.parametrize(
    "shapes,overrides,in_torch",
    [
        (ShapeRange((1, 2), (64, 128), (64, 128), (1, 256)), {}, True),
        (ShapeRange.static(2, 128, 128, 256), {}, True),  # static_linears: torch, the default
        (ShapeRange.static(2, 128, 128, 256), {"static_linears": "tensorrt"}, False),  # fused in TensorRT
        (ShapeRange.static(2, 128, 128, 256), {"range_linears": "tensorrt"}, True),  # each switch its sets
        (ShapeRange((1, 2), (64, 128), (64, 128), (1, 256)), {"range_linears": "tensorrt"}, False),
    ],
)
def test_linears_go_to_pytorch_as_range_and_static_linears_say(monkeypatch, shapes, overrides, in_torch):
    monkeypatch.setattr(shim, "compile_settings", lambda required, optional: {**optional, **required})
    monkeypatch.setattr(trt_backend, "_cuda_device", str)  # no CUDA on this machine
    backend = TensorRTBackend.__new__(TensorRTBackend)  # settings() only: no Torch-TensorRT needed
    backend.plan, backend.shapes = plan_of(CompileConfig(**overrides)), shapes
    backend.config = backend.plan.config
    got = backend.settings()
    assert PRX_ATTENTION in got["torch_executed_ops"]
    assert (LINEAR in got["torch_executed_ops"]) is in_torch
    assert (got.get("min_block_size") == 1) is in_torch


def test_build_example_tensors_are_broadcast_zeros_of_the_shape_torch_tensorrt_picks():
    class TrtDtype:  # torch_tensorrt.dtype's conversion, as Input.example_tensor calls it
        def to(self, kind, use_default=False):
            assert kind is torch.dtype and use_default
            return torch.bfloat16

    static = type("Input", (), {"shape": (3, 4096, 1792), "dtype": TrtDtype()})()
    t = shim._zeros_example(static)
    assert t.shape == (3, 4096, 1792) and t.dtype == torch.bfloat16
    assert t.stride() == (0, 0, 0) and t.untyped_storage().nbytes() == 2  # one element, not 44 MB
    assert not t.any()
    shapes = {"min_shape": (1, 8), "opt_shape": (2, 8), "max_shape": (4, 8)}
    dynamic = type("Input", (), {"shape": shapes, "dtype": TrtDtype()})()
    assert shim._zeros_example(dynamic, "max_shape").shape == (4, 8)
    assert shim._zeros_example(dynamic, "opt_shape").shape == (2, 8)


class _Context:
    def __init__(self):
        self.memory = None

    def set_device_memory(self, ptr, size):
        self.memory = (ptr, size)


class _EngineModule(torch.nn.Module):
    """What DeviceArena reads of an engine module: its engine's context size, its context."""

    def __init__(self, size):
        super().__init__()
        self.engine = type("E", (), {"device_memory_size_v2": size})()
        self.context = _Context()


def test_one_arena_holds_the_largest_context_and_every_context_runs_on_it():
    arena = engine.DeviceArena(torch.device("cpu"))
    modules = [_EngineModule(s) for s in (300, 1000, 40)]
    for m in modules:
        arena.attach(m, m.context)
    assert arena.nbytes == 0 and all(m.context.memory is None for m in modules)  # nothing taken yet
    arena.allocate()
    assert arena.nbytes == 1000  # the largest, not the sum (1340)
    assert {m.context.memory for m in modules} == {(arena.block.data_ptr(), 1000)}
    late = _EngineModule(5000)  # attached later: a larger block, and every context points at it
    arena.attach(late, late.context)
    arena.allocate()
    assert arena.nbytes == 5000
    assert {m.context.memory for m in [*modules, late]} == {(arena.block.data_ptr(), 5000)}


def test_share_context_memory_gives_a_set_one_arena_or_none(monkeypatch):
    monkeypatch.setattr(engine, "bindings", lambda: None)
    shapes = ShapeRange.static(1, 8, 8, 4)
    on = TensorRTBackend(torch.nn.Module(), plan_of(CompileConfig(device="cuda:0")), shapes)._new_arena()
    off = TensorRTBackend(
        torch.nn.Module(), plan_of(CompileConfig(share_context_memory=False)), shapes
    )._new_arena()
    assert isinstance(on, engine.DeviceArena) and on.device == torch.device("cuda", 0) and off is None


def test_building_swaps_torch_tensorrts_hooks_for_the_block_only(monkeypatch):
    """``building`` puts our converter in 2.11's ``compile_module`` and, with weights as inputs,
    takes the per-engine gc.collect + empty_cache out; all of it is put back after the block."""
    import sys
    import types

    released, repaired = [], []

    def repair(parent, submodule, inputs, device, name=None):
        repaired.append(name)
        return [*inputs, "cast"]

    compiler = types.SimpleNamespace(
        convert_module=lambda *a, **k: "torch-tensorrt's", repair_double_inputs=repair
    )
    conversion = types.SimpleNamespace(release_host_and_device_memory=lambda: released.append(1))
    input_cls = type("Input", (), {"example_tensor": lambda self, field=None: "rand"})
    fake = {
        "torch_tensorrt": types.ModuleType("torch_tensorrt"),
        "torch_tensorrt._Input": types.SimpleNamespace(Input=input_cls),
        "torch_tensorrt.dynamo": types.SimpleNamespace(_compiler=compiler),
        "torch_tensorrt.dynamo.conversion": types.SimpleNamespace(_conversion=conversion),
    }
    for name, module in fake.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(shim, "torch_tensorrt", lambda: None)
    originals = (
        compiler.convert_module,
        conversion.release_host_and_device_memory,
        input_cls.example_tensor,
        compiler.repair_double_inputs,
    )

    class TrtDtype:
        def __init__(self, d):
            self.d = d

        def to(self, kind, use_default=False):
            return self.d

    def inp(d, shape_tensor=False):
        return types.SimpleNamespace(dtype=TrtDtype(d), is_shape_tensor=shape_tensor)

    no_double = [inp(torch.bfloat16), inp(torch.int64, shape_tensor=True)]
    one_double = [inp(torch.bfloat16), inp(torch.float64)]

    def wrap(convert):
        return lambda *a, **k: f"ours around {convert()}"

    for release_memory in (False, True):
        with shim.building(wrap, release_memory=release_memory):
            assert compiler.convert_module() == "ours around torch-tensorrt's"
            assert input_cls.example_tensor is shim._zeros_example
            conversion.release_host_and_device_memory()
            # float64 inputs only: the others come back as they are, Torch-TensorRT's repair not run
            assert compiler.repair_double_inputs(None, None, no_double, "cuda", "a") is no_double
            assert compiler.repair_double_inputs(None, None, one_double, "cuda", "b") == [*one_double, "cast"]
        assert released == ([] if not release_memory else [1])
        assert (
            compiler.convert_module,
            conversion.release_host_and_device_memory,
            input_cls.example_tensor,
            compiler.repair_double_inputs,
        ) == originals
    assert repaired == ["b", "b"]


def test_a_program_decomposed_already_is_not_decomposed_again_in_the_block():
    class Program(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.silu(x) * 2

    ep = torch.export.export(Program(), (torch.randn(3),))
    with shim.decomposed(ep):
        assert ep.run_decompositions({}) is ep
    assert "run_decompositions" not in vars(ep)
    assert ep.run_decompositions({}) is not ep  # the method again, after the block


def test_contexts_that_need_no_memory_get_a_one_byte_block_and_report_none():
    arena = engine.DeviceArena(torch.device("cpu"))
    modules = [_EngineModule(0), _EngineModule(0)]
    for m in modules:
        arena.attach(m, m.context)
    arena.allocate()
    assert arena.nbytes == 0 and arena.block.numel() == 1  # TensorRT still gets an address to use
    assert {m.context.memory for m in modules} == {(arena.block.data_ptr(), 1)}


def test_a_torch_tensorrt_outside_the_checked_line_is_refused_in_one_line_before_any_export(monkeypatch):
    """2.13 dropped ``PythonTorchTensorRTModule``, 2.14 ``use_python_runtime``: a user whose pip
    resolved one of them hears so at compile time, with the pip command; an override exists."""
    from prx_compile import BackendUnavailableError, compile_prx
    from prx_compile.tools.testing import make_prx

    monkeypatch.delenv(shim.UNCHECKED_ENV, raising=False)
    shim.check_version(("torch-tensorrt", "2.11.0"))
    shim.check_version(("torch-tensorrt-rtx", "2.11.0+cu130"))
    shim.check_version(None)  # not installed: the import itself says so
    message = (
        r"torch-tensorrt 2.14.0 is installed; this prx_compile is checked against Torch-TensorRT 2.11 "
        r"\(with torch 2.11\) only. Hint: pip install 'torch-tensorrt>=2.11,<2.12' 'torch>=2.11,<2.12'.*"
        r"PRX_COMPILE_UNCHECKED_TORCH_TENSORRT=1"
    )
    with pytest.raises(BackendUnavailableError, match=message):
        shim.check_version(("torch-tensorrt", "2.14.0"))
    with pytest.raises(BackendUnavailableError, match=r"torch-tensorrt-rtx 2.10.1 is installed"):
        shim.check_version(("torch-tensorrt-rtx", "2.10.1"))
    monkeypatch.setenv(shim.UNCHECKED_ENV, "1")
    shim.check_version(("torch-tensorrt", "2.14.0"))  # at the user's own risk
    monkeypatch.delenv(shim.UNCHECKED_ENV)
    # through compile_prx: refused before the model is touched (faked GPU and metadata)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(shim, "installed_version", lambda: ("torch-tensorrt", "2.14.0"))
    shim.torch_tensorrt.cache_clear()
    model = make_prx()
    exported = []
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exported.append(1))
    with pytest.raises(BackendUnavailableError, match="2.14.0 is installed"):
        compile_prx(model, backend="tensorrt")
    assert not exported and next(model.parameters()).device.type == "cpu"
    shim.torch_tensorrt.cache_clear()


def test_engines_need_only_tensorrts_bindings_and_say_in_one_line_when_they_cannot_run(monkeypatch):
    engine.bindings.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailableError) as e:
        engine.bindings()
    assert "CUDA GPU" in str(e.value) and "\n" not in str(e.value).strip()
    engine.bindings.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU, but no TensorRT installed here
    with pytest.raises(BackendUnavailableError, match="TensorRT's Python bindings cannot be imported"):
        engine.bindings()
    engine.bindings.cache_clear()


def test_engine_weight_dtypes_are_read_from_their_names_only():
    import numpy as np

    assert engine.torch_dtype_of("torch.bfloat16") is torch.bfloat16
    assert engine.torch_dtype_of(torch.float16) is torch.float16
    assert engine.torch_dtype_of(np.dtype("float32")) is torch.float32
    assert engine.torch_dtype_of("<class 'numpy.int32'>") is torch.int32
    for bad in ("torch.complex64", "os.system", "__import__('os')", ""):
        with pytest.raises(ValueError, match="not a dtype"):
            engine.torch_dtype_of(bad)


def test_an_engine_with_data_dependent_output_shapes_is_refused_in_one_line_before_tensorrt_is_asked():
    record = {
        "inputs": ["x"],
        "outputs": ["y"],
        "weight_name_map": {},
        "requires_output_allocator": True,
        "outputs_unowned": False,
    }
    with pytest.raises(ValueError, match="data-dependent output shapes.*torch_executed_ops") as e:
        engine.Engine(b"not an engine", record, "e0", torch.device("cpu"))  # no GPU, no TensorRT here
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="engine record"):
        engine.Engine(b"", {**record, "inputs": ["$(x)"]}, "e0", torch.device("cpu"))
