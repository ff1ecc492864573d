"""Every Torch-TensorRT / TensorRT API this project depends on, in one place.

Checked against Torch-TensorRT 2.11 (and its TensorRT-RTX build), with the changes of 2.12-2.14 read
from their sources: ``use_explicit_typing`` was removed from ``dynamo.compile`` (explicit typing is
the default), ``PythonTorchTensorRTModule`` is gone in 2.13. torch_tensorrt is imported lazily, here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ... import schema
from ...errors import BackendUnavailableError

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "install it on a machine with an NVIDIA GPU: pip install 'prx_compile[tensorrt]' "
    "(or 'prx_compile[tensorrt-rtx]'); or use backend='inductor' or 'eager'."
)
#: the Torch-TensorRT line this release is checked against ([first, last) of major.minor), and the
#: environment variable that lets a user try another one anyway, at their own risk
CHECKED = ((2, 11), (2, 12))
UNCHECKED_ENV = "PRX_COMPILE_UNCHECKED_TORCH_TENSORRT"
PACKAGES = ("torch-tensorrt", "torch-tensorrt-rtx")


def installed_version() -> tuple[str, str] | None:
    """(package, version) of the installed Torch-TensorRT distribution (either build), read from its
    metadata without importing it; None when neither is installed."""
    from importlib import metadata

    for name in PACKAGES:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_version(found: tuple[str, str] | None = None) -> None:
    """BackendUnavailableError, in one line naming the installed and the checked versions and the pip
    command, when the installed Torch-TensorRT is outside ``CHECKED`` (its runtime classes and
    settings changed in 2.13 and 2.14); ``$PRX_COMPILE_UNCHECKED_TORCH_TENSORRT=1`` skips the check."""
    found = found if found is not None else installed_version()
    if found is None or os.environ.get(UNCHECKED_ENV, "").strip() == "1":
        return
    name, version = found
    parts = re.match(r"(\d+)\.(\d+)", version)
    mm = (int(parts[1]), int(parts[2])) if parts else None
    lo, hi = CHECKED
    if mm is not None and lo <= mm < hi:
        return
    checked = f"{lo[0]}.{lo[1]}"
    raise BackendUnavailableError(
        f"{name} {version} is installed; this prx_compile is checked against Torch-TensorRT {checked} "
        f"(with torch {checked}) only.",
        f"pip install '{name}>={checked},<{hi[0]}.{hi[1]}' 'torch>={checked},<{hi[0]}.{hi[1]}' "
        f"(or pip install 'prx_compile[tensorrt]'); to try {version} anyway, at your own risk, set "
        f"{UNCHECKED_ENV}=1.",
    )


@functools.lru_cache(maxsize=1)
def torch_tensorrt():
    """The torch_tensorrt module, or BackendUnavailableError saying how to get it (also for a
    Torch-TensorRT outside the checked line: ``check_version``)."""
    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            "backend='tensorrt' needs a CUDA GPU, and torch sees none.", INSTALL_HINT
        )
    check_version()
    try:
        import torch_tensorrt as ttrt
    except Exception as e:  # ImportError, or OSError when TensorRT's libraries are missing
        raise BackendUnavailableError(
            f"backend='tensorrt' needs Torch-TensorRT, which cannot be imported here "
            f"({type(e).__name__}: {e}).",
            INSTALL_HINT,
        ) from e
    return ttrt


def trt():
    torch_tensorrt()  # installs the TensorRT (or TensorRT-RTX) proxy module as ``tensorrt``
    import tensorrt

    return tensorrt


def versions() -> dict[str, str]:
    ttrt, t = torch_tensorrt(), trt()
    return {
        "torch_tensorrt": getattr(ttrt, "__version__", "?"),
        "tensorrt": getattr(t, "__version__", "?"),
        "tensorrt_package": getattr(ttrt, "tensorrt_package_name", "") or "tensorrt",
    }


def compile_settings(
    required: dict[str, Any], optional: dict[str, Any], compile_fn: Any = None
) -> dict[str, Any]:
    """Keyword arguments for ``torch_tensorrt.dynamo.compile``.

    required: settings correctness depends on; one this Torch-TensorRT does not take raises
        BackendUnavailableError naming it. optional: left out (logged) where unknown.
    """
    fn = compile_fn or torch_tensorrt().dynamo.compile
    params = inspect.signature(fn).parameters
    missing = sorted(k for k in required if k not in params)
    if missing:
        raise BackendUnavailableError(
            f"this Torch-TensorRT ({getattr(torch_tensorrt(), '__version__', '?')}) has no setting(s) "
            f"{missing}, which compile_prx needs to be correct.",
            "install Torch-TensorRT 2.11 (the version this release is checked against).",
        )
    dropped = sorted(k for k in optional if k not in params)
    if dropped:
        logger.info("Torch-TensorRT has no setting(s) %s: left at their defaults", dropped)
    return {**required, **{k: v for k, v in optional.items() if k in params}}


@contextlib.contextmanager
def lowering_passes(passes: list[Any]) -> Iterator[None]:
    """Within the block, ``passes`` (functions ``(gm, settings) -> gm``) run after Torch-TensorRT's
    own post-lowering passes: added with its registration API (``_aten_lowering_pass``) and removed
    with ``_remove_lowering_pass`` when the block ends."""
    torch_tensorrt()
    from torch_tensorrt.dynamo.lowering.passes import _aten_lowering_pass as registry

    for fn in passes:
        registry._aten_lowering_pass(fn)
    try:
        yield
    finally:
        for fn in passes:
            registered = registry.ATEN_POST_LOWERING_PASSES.passes
            if fn in registered:
                registry._remove_lowering_pass(index=registered.index(fn))


def engine_classes() -> tuple[type, ...]:
    rt = torch_tensorrt().dynamo.runtime
    return tuple(
        c
        for c in (getattr(rt, "PythonTorchTensorRTModule", None), getattr(rt, "TorchTensorRTModule", None))
        if c is not None
    )


def weight_name_map(module: torch.nn.Module) -> dict[str, Any]:
    """engine weight name -> [state-dict key, dtype], as Torch-TensorRT recorded it at build."""
    wmap = getattr(module, "weight_name_map", None) or {}
    return {k: v for k, v in wmap.items() if k != "constant_mapping"}


def engine_bytes(module: torch.nn.Module, refittable: bool) -> bytes:
    """The serialized engine; a refittable one with the weights refits changed since the build."""
    if not refittable:
        return bytes(module.serialized_engine)
    t = trt()
    engine = module.engine
    cfg = engine.create_serialization_config()
    if hasattr(t.SerializationFlag, "EXCLUDE_WEIGHTS"):
        cfg.clear_flag(t.SerializationFlag.EXCLUDE_WEIGHTS)
    if hasattr(t.SerializationFlag, "INCLUDE_REFIT"):
        cfg.set_flag(t.SerializationFlag.INCLUDE_REFIT)
    return bytes(engine.serialize_with_config(cfg))


def refit_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Refit the named engine weights of one live engine in place (others keep their values).

    weights: engine weight name -> flat contiguous CUDA tensor in the engine's dtype.
    """
    t = trt()
    from torch_tensorrt.logging import TRT_LOGGER

    refitter = t.Refitter(module.engine, TRT_LOGGER)
    for name, w in weights.items():
        tw = t.Weights(_trt_dtype(w.dtype), w.data_ptr(), w.numel())
        if not refitter.set_named_weights(name, tw, t.TensorLocation.DEVICE):
            raise RuntimeError(f"TensorRT refused new values for engine weight {name!r}")
    missing = list(refitter.get_missing_weights())
    if missing:
        raise RuntimeError(f"TensorRT needs these weights refit together: {missing[:5]} ...")
    if not refitter.refit_cuda_engine():
        raise RuntimeError("TensorRT refit_cuda_engine() failed")
    torch.cuda.synchronize()


def torch_dtype_of(weight_dtype: Any) -> torch.dtype:
    """Torch dtype for the dtype a weight_name_map stores (numpy dtype or torch dtype)."""
    from torch_tensorrt._enums import dtype as ttrt_dtype

    return ttrt_dtype._from(weight_dtype).to(torch.dtype)


def _trt_dtype(d: torch.dtype):
    t = trt()
    return {
        torch.float32: t.float32,
        torch.float16: t.float16,
        torch.bfloat16: t.bfloat16,
        torch.int32: t.int32,
        torch.int8: t.int8,
        torch.bool: t.bool,
    }[d]


# -- TensorRT-RTX runtime cache (its JIT kernels) ---------------------------------------------------
def has_runtime_cache(module: torch.nn.Module) -> bool:
    return hasattr(module.engine, "create_runtime_config")


def use_runtime_cache(module: torch.nn.Module, blob: bytes | None, arena: DeviceArena | None = None) -> None:
    """Give the engine module an execution context whose TensorRT-RTX runtime cache starts from
    ``blob`` (None: empty), so kernels JIT-compiled in an earlier process are reused, and that runs
    on ``arena``'s memory (None: its own). No-op on full TensorRT. The config and cache are kept on
    the module as long as the context lives."""
    if not has_runtime_cache(module):
        return
    cfg = module.engine.create_runtime_config()
    cache = cfg.create_runtime_cache()
    if blob:
        cache.deserialize(blob)
    cfg.set_runtime_cache(cache)
    if arena is not None:
        cfg.set_execution_context_allocation_strategy(trt().ExecutionContextAllocationStrategy.USER_MANAGED)
    module._prx_runtime = (cfg, cache)
    module.context = module.engine.create_execution_context(cfg)
    if arena is not None and module.context is not None:
        arena.attach(module)
    if hasattr(module, "runtime_states"):
        module.runtime_states.context_changed = True


def runtime_cache_bytes(module: torch.nn.Module) -> bytes | None:
    runtime = getattr(module, "_prx_runtime", None)
    if runtime is None:
        return None
    data = runtime[1].serialize()
    return bytes(memoryview(data)) if data is not None else None


# -- engine modules from bytes (no pickle) -----------------------------------------------------------
_BINDING = re.compile(r"[A-Za-z0-9_.:\-]{1,200}")


def engine_record(module: torch.nn.Module) -> dict[str, Any]:
    """JSON-able facts needed to recreate an engine module from its bytes."""
    return {
        "inputs": list(module.input_names),
        "outputs": list(module.output_names),
        "weight_name_map": {k: [v[0], str(v[1])] for k, v in weight_name_map(module).items()},
        "requires_output_allocator": bool(getattr(module, "requires_output_allocator", False)),
        "outputs_unowned": bool(getattr(module, "output_tensors_are_unowned", False)),
    }


def check_engine_record(rec: Any) -> dict[str, Any]:
    """Validate a saved engine record (``schema.SchemaError``, a ValueError naming the field)."""
    return schema.check(ENGINE_RECORD, rec, "engine record")


_DTYPE_NAMES = ("float32", "float16", "bfloat16", "int8", "int32", "int64", "bool")


def _dtype_name(name: str) -> str | None:
    short = name.split(".")[-1]
    return short if short in _DTYPE_NAMES else None


_NAMES = schema.List(schema.Str(200, pattern=_BINDING.pattern, what="a binding name"), max_len=10_000)
ENGINE_RECORD = schema.Dict(
    {
        "inputs": _NAMES,
        "outputs": _NAMES,
        "weight_name_map": schema.Map(
            schema.Str(499),
            schema.Tuple(
                schema.Str(299),
                schema.Str(299, test=lambda s: _dtype_name(s) is not None, what="a dtype name"),
            ),
            max_len=100_000,
        ),
        "requires_output_allocator": schema.Bool(),
        "outputs_unowned": schema.Bool(),
    }
)


def engine_module(
    serialized: bytes,
    record: dict[str, Any],
    name: str,
    device: torch.device,
    runtime_cache: bytes | None = None,
    arena: DeviceArena | None = None,
):
    """A Python-runtime engine module around serialized engine bytes (record from ``engine_record``),
    its execution context on ``arena``'s memory where one is given (only where ``lazy_engine_init``
    lets the context be made once, here).

    On TensorRT-RTX its execution context starts from ``runtime_cache`` (the JIT kernels saved by
    ``runtime_cache_bytes``). Where Torch-TensorRT has ``lazy_engine_init`` (2.11) that is the one
    context made; without it the module makes a default context first, and this one replaces it.
    (A ``copy.deepcopy`` of the module goes through Torch-TensorRT's own ``setup_engine``: a default
    context, no runtime cache.)

    TensorRT deserialises the bytes with its default ``engine_host_code_allowed = False``: an engine
    that carries host code (a lean runtime, plugins) is refused."""
    ttrt = torch_tensorrt()
    from torch_tensorrt.dynamo import CompilationSettings
    from torch_tensorrt.dynamo.utils import to_torch_tensorrt_device

    wmap = {k: [v[0], getattr(torch, _dtype_name(v[1]))] for k, v in record["weight_name_map"].items()}
    lazy = "lazy_engine_init" in {f.name for f in dataclasses.fields(CompilationSettings)}
    settings = CompilationSettings(device=to_torch_tensorrt_device(device), use_python_runtime=True)
    if lazy:  # the context is made below, once: not a default one (a JIT without the cache) first
        settings.lazy_engine_init = True
    cls = ttrt.dynamo.runtime.PythonTorchTensorRTModule
    kwargs = {
        "name": name,
        "settings": settings,
        "weight_name_map": wmap,
        "requires_output_allocator": record["requires_output_allocator"],
    }
    params = inspect.signature(cls.__init__).parameters
    module = cls(
        serialized, record["inputs"], record["outputs"], **{k: v for k, v in kwargs.items() if k in params}
    )
    if lazy:
        _setup_engine(module, runtime_cache, arena)
    else:
        use_runtime_cache(module, runtime_cache, arena)
    if module.engine is None:
        raise ValueError(f"TensorRT could not deserialise engine {name!r}")
    if record["outputs_unowned"]:
        module.set_output_tensors_as_unowned(True)
    return module


def _setup_engine(
    module: torch.nn.Module, runtime_cache: bytes | None, arena: DeviceArena | None = None
) -> None:
    """``PythonTorchTensorRTModule.setup_engine`` of Torch-TensorRT 2.11, with the execution context
    made by ``use_runtime_cache``: on TensorRT-RTX a context's creation compiles its kernels, so a
    default context first would compile them all once more, without the cache (measured on the H200:
    0.16-0.88 s for a default context, 0.04-0.06 s for one from the saved cache).

    Left out of 2.11's version: the target-platform assert (``check_engine_record`` and the artifact's
    GPU/version check stand in for it) and the weight-streaming budget (``engine_module``'s settings
    leave weight streaming off)."""
    ttrt, t = torch_tensorrt(), trt()
    from torch_tensorrt._enums import dtype
    from torch_tensorrt.logging import TRT_LOGGER

    module.engine = t.Runtime(TRT_LOGGER).deserialize_cuda_engine(module.serialized_engine)
    if module.engine is None:
        return
    module.initialized = True
    if has_runtime_cache(module):
        use_runtime_cache(module, runtime_cache, arena)
    elif arena is not None:
        strategy = t.ExecutionContextAllocationStrategy.USER_MANAGED
        module.context = module.engine.create_execution_context(strategy)
        if module.context is not None:
            arena.attach(module)
    else:
        module.context = module.engine.create_execution_context()
    if module.context is None:
        raise ValueError("TensorRT could not create an execution context")
    engine, names_in, names_out = module.engine, module.input_names, module.output_names
    if engine.num_io_tensors != len(names_in) + len(names_out):
        raise ValueError(f"the engine has {engine.num_io_tensors} inputs and outputs, its record names other")
    module.input_dtypes = [dtype._from(engine.get_tensor_dtype(n)) for n in names_in]
    module.input_shapes = [engine.get_tensor_shape(n) for n in names_in]
    module.output_dtypes = [dtype._from(engine.get_tensor_dtype(n)).to(torch.dtype) for n in names_out]
    module.output_shapes = [engine.get_tensor_shape(n) for n in names_out]
    if module.requires_output_allocator:
        module.create_output_allocator()
    if ttrt.runtime.get_cudagraphs_mode():
        module.cudagraph = torch.cuda.CUDAGraph()
    module.is_shape_inference_io = {n: engine.is_shape_inference_io(n) for n in names_in}


@contextlib.contextmanager
def building(wrap: Any, release_memory: bool = True) -> Iterator[None]:
    """Within the block (one ``torch_tensorrt.dynamo.compile``; one build at a time, a lock):

    * each partition is converted by ``wrap(convert_module)`` (e.g. ``repeats.SharedEngines().wrap``)
      instead of Torch-TensorRT's own ``convert_module``: 2.11's ``compile_module`` calls the name it
      imported, once per partition, and sets what it returns as that partition's child;
    * a ``torch_tensorrt.Input`` made without a tensor gets zeros broadcast from one element as its
      example instead of ``torch.rand`` of its whole shape on the CPU. Torch-TensorRT makes one per
      input of every partition (with weights as inputs: every weight, again for each partition):
      14.3 s of a 1.17 B-parameter build on the H200 (``profile_build_h200.txt``). The examples give
      shapes and dtypes; the one place 2.11 runs a partition on them (``repair_double_inputs``, for
      float64 inputs) reads its output's dtype only;
    * ``repair_double_inputs`` (``truncate_double``) returns at once for a partition with no float64
      input, as 2.11's does after moving every input's example to the GPU first (with weights as
      inputs: every weight, for each partition: ~2 s of the range set's first call, under a
      sampler, in ``profile_build_v10_range_h200.txt``);
    * with ``release_memory=False``, the ``gc.collect()`` + device sync + ``empty_cache`` that 2.11
      runs after each engine's conversion (``release_host_and_device_memory``, to free the host
      copies of weights an engine holds) is skipped: with weights as engine inputs an engine holds
      none, and the collection cost 0.44 s per engine on the H200, holding the GIL that the other
      conversions need (``profile_build_range_h200.txt``)."""
    torch_tensorrt()
    from torch_tensorrt._Input import Input
    from torch_tensorrt.dynamo import _compiler
    from torch_tensorrt.dynamo.conversion import _conversion

    with _CONVERT_LOCK:
        original, example = _compiler.convert_module, Input.example_tensor
        release = getattr(_conversion, "release_host_and_device_memory", None)
        repair = getattr(_compiler, "repair_double_inputs", None)
        _compiler.convert_module = wrap(original)
        Input.example_tensor = _zeros_example
        if release is not None and not release_memory:
            _conversion.release_host_and_device_memory = _keep_memory
        if repair is not None:
            _compiler.repair_double_inputs = _only_doubles(repair)
        try:
            yield
        finally:
            _compiler.convert_module, Input.example_tensor = original, example
            if release is not None:
                _conversion.release_host_and_device_memory = release
            if repair is not None:
                _compiler.repair_double_inputs = repair


def _only_doubles(repair: Any) -> Any:
    """``repair_double_inputs`` run only for a partition with a float64 input (the others it returns
    unchanged, as 2.11's does, without making their examples on the device first)."""

    def run(parent: Any, submodule: Any, inputs: Any, device: Any, name: str | None = None) -> Any:
        if not any(is_float64(i) for i in inputs):
            return inputs
        return repair(parent, submodule, inputs, device, name)

    return run


def is_float64(inp: Any) -> bool:
    """Whether a ``torch_tensorrt.Input`` is a float64 tensor (a shape tensor is not)."""
    if getattr(inp, "is_shape_tensor", False):
        return False
    return inp.dtype.to(torch.dtype, use_default=True) == torch.float64


def decompositions(settings: dict[str, Any]) -> dict[Any, Any]:
    """The decomposition table ``torch_tensorrt.dynamo.compile`` applies for ``settings``."""
    torch_tensorrt()
    from torch_tensorrt.dynamo.lowering import get_decompositions

    params = inspect.signature(get_decompositions).parameters
    options = {"enable_experimental_decompositions": False, "decompose_attention": False}
    kwargs = {k: settings.get(k, v) for k, v in options.items() if k in params}
    return get_decompositions(**kwargs)


@contextlib.contextmanager
def decomposed(ep: Any) -> Iterator[None]:
    """Within the block, ``ep.run_decompositions(...)`` returns ``ep``: for a program already
    decomposed with ``decompositions(settings)`` (``dynamo.compile`` would trace it once more, the
    same way: ~7 s of the range set's first call, under a sampler, in
    ``profile_build_v10_range_h200.txt``)."""
    ep.run_decompositions = lambda *args, **kwargs: ep  # shadows the method, on this instance only
    try:
        yield
    finally:
        del ep.run_decompositions


def _keep_memory() -> None:
    """Stands in for Torch-TensorRT's ``release_host_and_device_memory`` during a build (``building``)."""


def _zeros_example(self: Any, optimization_profile_field: str | None = None) -> torch.Tensor:
    """``Input.example_tensor`` of 2.11 (the shape it picks), as zeros broadcast from one element."""
    shape = self.shape
    if isinstance(shape, dict):
        shape = shape[optimization_profile_field or "opt_shape"]
    return torch.zeros((), dtype=self.dtype.to(torch.dtype, use_default=True)).expand(tuple(shape))


_CONVERT_LOCK = threading.Lock()


class DeviceArena:
    """One block of device memory that the execution contexts of one engine set run on.

    A set's engines run one after another on one stream (the step's order, or its CUDA graph), so
    their contexts need the largest one's activation memory, not the sum. Each context is made with
    TensorRT's ``USER_MANAGED`` allocation strategy and ``attach``-ed here while the set is built or
    loaded; ``allocate()`` then takes one block of the largest size from PyTorch's allocator
    (512-byte aligned; TensorRT asks for 256) and points every context at it, before any of them
    runs. Two threads must not run the same set at once (they already share its contexts)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.block: torch.Tensor | None = None
        self.size = 0
        self._modules: list[torch.nn.Module] = []
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """The largest attached context's memory (the block holds at least one byte)."""
        return 0 if self.block is None else self.size

    def attach(self, module: torch.nn.Module) -> None:
        """Record ``module``, whose context was made ``USER_MANAGED``: it runs once ``allocate`` ran."""
        with self._lock:
            self._modules.append(module)

    def allocate(self) -> None:
        """One block for every attached context (again after more were attached)."""
        with self._lock:
            self.size = max([context_memory_bytes(m) for m in self._modules] + [0])
            if self.block is None or self.size > self.block.numel():
                self.block = None  # the old one back to the allocator before the new one is taken
                self.block = torch.empty(max(self.size, 1), dtype=torch.uint8, device=self.device)
            for m in self._modules:
                _set_device_memory(m.context, self.block)


def _set_device_memory(context: Any, block: torch.Tensor) -> None:
    if hasattr(context, "set_device_memory"):  # TensorRT >= 10.1, TensorRT-RTX
        context.set_device_memory(block.data_ptr(), block.numel())
    else:
        context.device_memory = block.data_ptr()


def context_memory_bytes(module: torch.nn.Module) -> int:
    """Device memory the engine's execution context holds for activations (0 when unknown)."""
    engine = getattr(module, "engine", None)
    for attr in ("device_memory_size_v2", "device_memory_size"):
        size = getattr(engine, attr, None)
        if isinstance(size, int):
            return size
    return 0


def one_context(convert: Any, arena: DeviceArena | None = None) -> Any:
    """``convert`` (Torch-TensorRT's ``convert_module``) whose engine module gets one execution
    context, made with an empty TensorRT-RTX runtime cache (``use_runtime_cache``) and on ``arena``'s
    memory. Left alone, Torch-TensorRT makes a default context first, and on TensorRT-RTX each
    context creation compiles the engine's kernels. Where Torch-TensorRT has no ``lazy_engine_init``,
    ``convert`` as it is (each context then keeps its own memory)."""
    from torch_tensorrt.dynamo import CompilationSettings

    if "lazy_engine_init" not in {f.name for f in dataclasses.fields(CompilationSettings)}:
        return convert

    def run(module: Any, inputs: Any, *args: Any, settings: Any, **kwargs: Any) -> Any:
        lazy = dataclasses.replace(settings, lazy_engine_init=True)  # Torch-TensorRT's stays as it is
        engine = convert(module, inputs, *args, settings=lazy, **kwargs)
        _setup_engine(engine, None, arena)
        if engine.engine is None:
            raise RuntimeError(f"TensorRT could not deserialise the engine it built for {kwargs.get('name')}")
        return engine

    return run
