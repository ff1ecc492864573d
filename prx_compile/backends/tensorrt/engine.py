"""TensorRT engines run from PyTorch through TensorRT's own Python bindings: no Torch-TensorRT.

    engine = Engine(serialized, record, name, device, runtime_cache=None, arena=None)
    out = engine(*inputs)      # CUDA tensors in ``record["inputs"]`` order -> new output tensor(s)

Torch-TensorRT builds the engines (``shim``); running, saving, loading and refitting them needs only
TensorRT: ``tensorrt_rtx`` beside Torch-TensorRT-RTX, ``tensorrt`` beside Torch-TensorRT
(``bindings``). A process that loads an artifact never imports Torch-TensorRT, 3.8 s of a server's
cold start on the H200 (``benchmarks/results/cold_start_v19_h200.json``).

An engine's execution context is made once: on TensorRT-RTX from the saved runtime cache (its JIT
kernels; ``runtime_cache_bytes`` gives it back to save) and, where a ``DeviceArena`` is given, on the
arena's memory (TensorRT's ``USER_MANAGED`` strategy). TensorRT deserialises the bytes with its
default ``engine_host_code_allowed = False``: an engine that carries host code (a lean runtime,
plugins) is refused.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
import sys
import threading
from typing import Any

import torch

from ... import schema
from ...errors import BackendUnavailableError, one_line

logger = logging.getLogger(__name__)

#: the Torch-TensorRT distribution -> the TensorRT bindings its engines are built with
_BINDINGS = {"torch-tensorrt-rtx": "tensorrt_rtx", "torch-tensorrt": "tensorrt"}
INSTALL_HINT = (
    "install it on a machine with an NVIDIA GPU: pip install 'prx_compile[tensorrt]' "
    "(or 'prx_compile[tensorrt-rtx]'); or use backend='inductor' or 'eager'."
)


@functools.lru_cache(maxsize=1)
def bindings() -> Any:
    """TensorRT's Python module that runs the engines (``tensorrt_rtx`` or ``tensorrt``, as the
    installed Torch-TensorRT build uses), or BackendUnavailableError saying how to get it."""
    from importlib import metadata

    if not torch.cuda.is_available():
        raise BackendUnavailableError("TensorRT engines need a CUDA GPU, and torch sees none.", INSTALL_HINT)
    names = ["tensorrt_rtx", "tensorrt"]
    for dist, module in _BINDINGS.items():
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        names.remove(module)
        names.insert(0, module)
        break
    errors = []
    for name in names:
        try:
            return importlib.import_module(name)
        except Exception as e:  # ImportError, or OSError when TensorRT's libraries are missing
            errors.append(f"{name}: {type(e).__name__}: {one_line(e, 140)}")
    raise BackendUnavailableError(
        f"TensorRT's Python bindings cannot be imported here ({'; '.join(errors)}).", INSTALL_HINT
    )


def _logger() -> Any:
    """The logger TensorRT is given: Torch-TensorRT's where this process has imported it (a process
    that builds; TensorRT keeps the first logger it was given, and warns once per runtime made with
    another), else one of ours at WARNING."""
    built = sys.modules.get("torch_tensorrt.logging")
    if getattr(built, "TRT_LOGGER", None) is not None:
        return built.TRT_LOGGER
    return _own_logger()


@functools.lru_cache(maxsize=1)
def _own_logger() -> Any:
    t = bindings()
    return t.Logger(t.Logger.WARNING)


def versions() -> dict[str, str]:
    """The TensorRT that runs the engines: its version and its package (``tensorrt_rtx``, ...)."""
    t = bindings()
    return {"tensorrt": str(getattr(t, "__version__", "?")), "tensorrt_package": t.__name__}


# -- dtypes ----------------------------------------------------------------------------------------
_DTYPE_NAMES = ("float32", "float16", "bfloat16", "int8", "uint8", "int32", "int64", "bool", "float8_e4m3fn")
_TRT_TO_TORCH = {  # TensorRT DataType member -> torch dtype (members a version lacks are skipped)
    "FLOAT": torch.float32,
    "HALF": torch.float16,
    "BF16": torch.bfloat16,
    "INT8": torch.int8,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "FP8": torch.float8_e4m3fn,
}


def dtype_name(name: str) -> str | None:
    """``float16`` for ``float16``, ``torch.float16`` or ``<class 'numpy.float16'>``-like names that
    end in a known dtype; None otherwise."""
    short = re.split(r"[.' >]+", name.strip(" '<>"))[-1]
    return short if short in _DTYPE_NAMES else None


def torch_dtype_of(name: Any) -> torch.dtype:
    """The torch dtype a ``weight_name_map`` entry names (a torch/numpy dtype or its name)."""
    short = dtype_name(str(name))
    if short is None:
        raise ValueError(f"not a dtype an engine weight can have: {str(name)[:60]!r}")
    return getattr(torch, short)


def _torch_dtype(trt_dtype: Any) -> torch.dtype:
    t = bindings()
    for member, dtype in _TRT_TO_TORCH.items():
        if getattr(t.DataType, member, None) == trt_dtype:
            return dtype
    raise ValueError(f"TensorRT dtype {trt_dtype} has no torch dtype here")


def _trt_dtype(dtype: torch.dtype) -> Any:
    t = bindings()
    for member, d in _TRT_TO_TORCH.items():
        if d == dtype and hasattr(t.DataType, member):
            return getattr(t.DataType, member)
    raise ValueError(f"torch dtype {dtype} has no TensorRT dtype here")


# -- the record an engine is recreated from --------------------------------------------------------
_BINDING = re.compile(r"[A-Za-z0-9_.:\-]{1,200}")
_NAMES = schema.List(schema.Str(200, pattern=_BINDING.pattern, what="a binding name"), max_len=10_000)
ENGINE_RECORD = schema.Dict(
    {
        "inputs": _NAMES,
        "outputs": _NAMES,
        "weight_name_map": schema.Map(
            schema.Str(499),
            schema.Tuple(
                schema.Str(299),
                schema.Str(299, test=lambda s: dtype_name(s) is not None, what="a dtype name"),
            ),
            max_len=100_000,
        ),
        "requires_output_allocator": schema.Bool(),
        # written by 0.19 and earlier (Torch-TensorRT's flag); outputs are new tensors every call now
        "outputs_unowned": schema.Bool(),
    }
)


def check_engine_record(rec: Any) -> dict[str, Any]:
    """Validate a saved engine record (``schema.SchemaError``, a ValueError naming the field)."""
    return schema.check(ENGINE_RECORD, rec, "engine record")


# -- the engine ------------------------------------------------------------------------------------
class Engine(torch.nn.Module):
    """One TensorRT engine and its execution context, called as a module.

    forward(*inputs): one tensor per name of ``input_names``, in that order: CUDA tensors of the
    engine's dtypes (shape inputs: integer tensors, read on the host) -> the outputs, in
    ``output_names`` order, new tensors each call (one tensor when the engine has one output).
    Runs on the caller's stream (on a side stream the caller then waits for, when the caller is on
    the legacy default stream, which TensorRT would synchronise); capturable in a CUDA graph.
    """

    def __init__(
        self,
        serialized: bytes,
        record: dict[str, Any],
        name: str,
        device: torch.device,
        runtime_cache: bytes | None = None,
        arena: DeviceArena | None = None,
    ) -> None:
        super().__init__()
        record = check_engine_record(record)
        if record["requires_output_allocator"]:  # nonzero, boolean masks: prx_compile's steps have none
            raise ValueError(
                f"engine {name!r} has data-dependent output shapes, which prx_compile's runtime does not "
                "run: keep the op that makes them in PyTorch (torch_executed_ops)"
            )
        t = bindings()
        self.name, self.device, self.record = name, device, record
        self.serialized_engine = bytes(serialized)
        self.input_names, self.output_names = list(record["inputs"]), list(record["outputs"])
        self.weight_name_map = dict(record["weight_name_map"])
        with torch.cuda.device(device):
            self.engine = t.Runtime(_logger()).deserialize_cuda_engine(self.serialized_engine)
            if self.engine is None:
                raise ValueError(f"TensorRT could not deserialise engine {name!r}")
            names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
            inputs = [n for n in names if self.engine.get_tensor_mode(n) == t.TensorIOMode.INPUT]
            if sorted(inputs) != sorted(self.input_names) or sorted(names) != sorted(
                self.input_names + self.output_names
            ):
                raise ValueError(f"engine {name!r} has other inputs and outputs than its record names")
            self.shape_inputs = {n for n in self.input_names if self.engine.is_shape_inference_io(n)}
            shape_outputs = [n for n in self.output_names if self.engine.is_shape_inference_io(n)]
            if shape_outputs:  # forward binds every output on the GPU
                raise ValueError(f"engine {name!r}: output {shape_outputs[0]!r} is a shape on the host")
            self._runtime: tuple[Any, Any] | None = None  # (runtime config, runtime cache), TensorRT-RTX
            self.context = self._new_context(runtime_cache, arena)
        self.input_dtypes = [_torch_dtype(self.engine.get_tensor_dtype(n)) for n in self.input_names]
        self.output_dtypes = [_torch_dtype(self.engine.get_tensor_dtype(n)) for n in self.output_names]
        self.refitted = False  # refit since the build: serialized_engine holds the old weights
        self._placeholder: dict[torch.dtype, torch.Tensor] = {}  # the address bound for empty tensors
        self._side: torch.cuda.Stream | None = None

    def _new_context(self, runtime_cache: bytes | None, arena: DeviceArena | None) -> Any:
        """The execution context: from ``runtime_cache`` on TensorRT-RTX, on ``arena``'s memory."""
        t = bindings()
        if hasattr(self.engine, "create_runtime_config"):  # TensorRT-RTX: a runtime cache
            cfg = self.engine.create_runtime_config()
            cache = cfg.create_runtime_cache()
            if runtime_cache and cache.deserialize(runtime_cache) is False:  # its kernels JIT-compile again
                logger.warning("engine %r: TensorRT-RTX refused its saved runtime cache", self.name)
            cfg.set_runtime_cache(cache)
            if arena is not None:
                cfg.set_execution_context_allocation_strategy(
                    t.ExecutionContextAllocationStrategy.USER_MANAGED
                )
            self._runtime = (cfg, cache)  # kept as long as the context lives
            context = self.engine.create_execution_context(cfg)
        elif arena is not None:
            context = self.engine.create_execution_context(t.ExecutionContextAllocationStrategy.USER_MANAGED)
        else:
            context = self.engine.create_execution_context()
        if context is None:
            raise ValueError(f"TensorRT could not create an execution context for engine {self.name!r}")
        if arena is not None:
            arena.attach(self, context)
        return context

    def runtime_cache_bytes(self) -> bytes | None:
        """The TensorRT-RTX runtime cache (the kernels its context compiled), None on full TensorRT."""
        if self._runtime is None:
            return None
        data = self._runtime[1].serialize()
        return bytes(memoryview(data)) if data is not None else None

    def setup_engine(self) -> None:
        """What Torch-TensorRT's ``compile_module`` calls with ``lazy_engine_init``. Nothing to do: an
        Engine deserialises its engine and makes its context when it is made."""

    def set_output_tensors_as_unowned(self, enabled: bool) -> None:
        """What Torch-TensorRT's ``compile_module`` calls on the engines whose outputs leave the
        graph. Nothing to do: every call returns new output tensors."""

    def _address(self, t: torch.Tensor) -> int:
        if t.numel():
            return t.data_ptr()
        if t.dtype not in self._placeholder:  # TensorRT needs an address even for an empty tensor
            self._placeholder[t.dtype] = torch.empty(1, dtype=t.dtype, device=self.device)
        return self._placeholder[t.dtype].data_ptr()

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        if len(inputs) != len(self.input_names):
            raise ValueError(f"engine {self.name!r} takes {len(self.input_names)} inputs, got {len(inputs)}")
        with torch.cuda.device(self.device):  # the calling thread may have another GPU selected
            return self._run(inputs)

    def _run(self, inputs: tuple) -> torch.Tensor | list[torch.Tensor]:
        ctx, held = self.context, []  # held: what TensorRT reads, alive until the launch is queued
        for name, x, dtype in zip(self.input_names, inputs, self.input_dtypes, strict=True):
            if name in self.shape_inputs:  # shape tensors are read on the host
                host = torch.as_tensor(x).detach().to("cpu", dtype).contiguous().numpy()  # its own dtype
                held.append(host)
                ctx.set_tensor_address(name, host.ctypes.data)
                continue
            if not isinstance(x, torch.Tensor):  # a Python number, as Torch-TensorRT's runtime takes it
                x = torch.tensor(x, device=self.device)
            if x.dtype != dtype or x.device != self.device:
                got = f"{x.dtype} on {x.device}"
                raise ValueError(f"engine {self.name!r}: input {name!r} must be a CUDA {dtype}, not {got}")
            x = x.contiguous()
            held.append(x)
            if not ctx.set_input_shape(name, tuple(x.shape)):
                shape = tuple(x.shape)
                raise ValueError(f"engine {self.name!r}: input {name!r} of shape {shape} is out of its range")
            ctx.set_tensor_address(name, self._address(x))
        outputs = []
        for name, dtype in zip(self.output_names, self.output_dtypes, strict=True):
            shape = tuple(ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise RuntimeError(f"engine {self.name!r}: output {name!r} has an unresolved shape {shape}")
            out = torch.empty(shape, dtype=dtype, device=self.device)
            ctx.set_tensor_address(name, self._address(out))
            outputs.append(out)
        caller = torch.cuda.current_stream(self.device)
        stream = caller
        if caller == torch.cuda.default_stream(self.device):
            if self._side is None:
                self._side = torch.cuda.Stream(self.device)
            stream = self._side
            stream.wait_stream(caller)
        if not ctx.execute_async_v3(stream.cuda_stream):
            raise RuntimeError(f"TensorRT could not run engine {self.name!r}")
        if stream is not caller:
            caller.wait_stream(stream)
        return outputs[0] if len(outputs) == 1 else outputs

    def __deepcopy__(self, memo: dict) -> Engine:
        """A new engine from the same bytes (with the refit weights, after a refit) and runtime cache,
        with a context of its own."""
        data = engine_bytes(self, True) if self.refitted else self.serialized_engine
        return Engine(data, self.record, self.name, self.device, self.runtime_cache_bytes())

    def __getstate__(self) -> dict:
        raise TypeError(f"engine {self.name!r} is not picklable: save the compiled module with save_compiled")

    def extra_repr(self) -> str:
        return f"{self.name!r}, {len(self.input_names)} inputs, {len(self.output_names)} outputs"


def engine_bytes(engine: Engine, refittable: bool) -> bytes:
    """The serialized engine; a refittable one with the weights refits changed since the build."""
    if not refittable:
        return engine.serialized_engine
    t = bindings()
    cfg = engine.engine.create_serialization_config()
    if hasattr(t.SerializationFlag, "EXCLUDE_WEIGHTS"):
        cfg.clear_flag(t.SerializationFlag.EXCLUDE_WEIGHTS)
    if hasattr(t.SerializationFlag, "INCLUDE_REFIT"):
        cfg.set_flag(t.SerializationFlag.INCLUDE_REFIT)
    return bytes(engine.engine.serialize_with_config(cfg))


def refit_weights(engine: Engine, weights: dict[str, torch.Tensor]) -> None:
    """Refit the named engine weights of one live engine in place (others keep their values).

    weights: engine weight name -> flat contiguous CUDA tensor in the engine's dtype.
    """
    t = bindings()
    refitter = t.Refitter(engine.engine, _logger())
    for name, w in weights.items():
        tw = t.Weights(_trt_dtype(w.dtype), w.data_ptr(), w.numel())
        if not refitter.set_named_weights(name, tw, t.TensorLocation.DEVICE):
            raise RuntimeError(f"TensorRT refused new values for engine weight {name!r}")
    missing = list(refitter.get_missing_weights())
    if missing:
        raise RuntimeError(f"TensorRT needs these weights refit together: {missing[:5]} ...")
    if not refitter.refit_cuda_engine():
        raise RuntimeError("TensorRT refit_cuda_engine() failed")
    engine.refitted = True
    torch.cuda.synchronize()


# -- one block of activation memory per engine set -------------------------------------------------
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
        self._contexts: list[tuple[Any, Any]] = []  # (engine, context)
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """The largest attached context's memory (the block holds at least one byte)."""
        return 0 if self.block is None else self.size

    def attach(self, engine: Any, context: Any) -> None:
        """Record a ``USER_MANAGED`` context of ``engine`` (anything with a TensorRT ``.engine``):
        it runs once ``allocate`` ran."""
        with self._lock:
            self._contexts.append((engine, context))

    def allocate(self) -> None:
        """One block for every attached context (again after more were attached)."""
        with self._lock:
            self.size = max([context_memory_bytes(e) for e, _ in self._contexts] + [0])
            if self.block is None or self.size > self.block.numel():
                self.block = None  # the old one back to the allocator before the new one is taken
                self.block = torch.empty(max(self.size, 1), dtype=torch.uint8, device=self.device)
            for _, context in self._contexts:
                _set_device_memory(context, self.block)


def _set_device_memory(context: Any, block: torch.Tensor) -> None:
    if hasattr(context, "set_device_memory"):  # TensorRT >= 10.1, TensorRT-RTX
        context.set_device_memory(block.data_ptr(), block.numel())
    else:
        context.device_memory = block.data_ptr()


def context_memory_bytes(module: Any) -> int:
    """Device memory the engine's execution context holds for activations (0 when unknown)."""
    engine = getattr(module, "engine", None)
    for attr in ("device_memory_size_v2", "device_memory_size"):
        size = getattr(engine, attr, None)
        if isinstance(size, int):
            return size
    return 0
