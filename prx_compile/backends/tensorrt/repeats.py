"""Build each distinct engine once: structurally identical partitions share one engine.

A diffusers DiT is a stack of blocks that compute the same thing on different weights. With
``weights: inputs`` those weights are engine inputs, so after Torch-TensorRT partitions the step
(engines between the ops kept in PyTorch) the partitions of blocks 1..N-1 are the same graph: PRX's
16 blocks give a static set 17 partitions of which 15 are one graph, a range set 53 of which about
five are distinct. Nothing here knows PRX: a partition's ``structure_key`` is its graph with the node
names taken out (placeholders by position, results by index), its input specs, and the value of
every constant it holds, so the same holds for FLUX's two block kinds or SD3's one.

``SharedEngines`` wraps Torch-TensorRT's per-partition converter: the first partition of each key is
built, every later one gets the same engine module (one engine, one execution context, called once per
block with that block's weights bound at the call). Two partitions get one engine only when their keys
are equal, and equal keys mean the same graph on the same inputs; any doubt (a nested module, a
constant too large to hash) makes the key unique, which builds that partition as before.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.fx as fx

#: constants larger than this are not hashed (a partition holding one is built on its own)
MAX_HASHED_BYTES = 16 * 2**20


def structure_key(gm: fx.GraphModule, inputs: list[Any] | tuple[Any, ...] = ()) -> str | None:
    """A digest of what ``gm`` computes on ``inputs``, blind to node and attribute names.

    gm: one partition (a flat GraphModule: placeholders, get_attr, call_function, output).
    inputs: its input specs (Torch-TensorRT ``Input``: shape or min/opt/max shapes, dtype, format).
    Returns None when the partition cannot be keyed safely (it is then never shared).
    """
    index: dict[fx.Node, int] = {}
    parts: list[str] = [repr([_spec(i) for i in inputs])]

    def enc(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return f"%{index[a]}"
        if isinstance(a, (list, tuple)):
            return type(a).__name__, [enc(x) for x in a]
        if isinstance(a, dict):
            return sorted((str(k), enc(v)) for k, v in a.items())
        if isinstance(a, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
            return str(a)
        if a is None or isinstance(a, (bool, int, float, str, slice)):
            return repr(a)
        if isinstance(a, torch.SymInt | torch.SymFloat | torch.SymBool):
            return f"sym:{a}"
        raise _Unkeyable

    try:
        for node in gm.graph.nodes:
            index[node] = len(index)
            if node.op == "placeholder":
                parts.append(f"in {_meta(node)}")
            elif node.op == "get_attr":
                parts.append(f"const {_tensor_digest(_attr(gm, node.target))}")
            elif node.op in ("call_function", "call_method"):
                parts.append(f"{node.op} {_target(node.target)} {enc(node.args)} {enc(node.kwargs)}")
            elif node.op == "output":
                parts.append(f"out {enc(node.args)}")
            else:  # call_module: a nested graph or module is not keyed
                return None
    except _Unkeyable:
        return None
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class _Unkeyable(Exception):
    pass


def _target(t: Any) -> str:
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._opname}.{t._overloadname}"
    if isinstance(t, str):
        return t
    module = getattr(t, "__module__", None)
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None)
    if module is None or name is None:
        raise _Unkeyable
    return f"{module}.{name}"


def _meta(node: fx.Node) -> str:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return f"{tuple(str(d) for d in v.shape)} {v.dtype} {tuple(str(s) for s in v.stride())}"
    return repr(type(v).__name__) if not isinstance(v, int | float | bool) else f"{type(v).__name__}"


def _spec(inp: Any) -> tuple:
    """The parts of a Torch-TensorRT Input that shape an engine (its name left out)."""
    if isinstance(inp, torch.Tensor):
        return ("tensor", tuple(inp.shape), str(inp.dtype))
    fields = ("shape", "dtype", "format", "shape_mode", "is_shape_tensor")
    return tuple(str(getattr(inp, f, None)) for f in fields)


def _attr(gm: torch.nn.Module, qualname: str) -> Any:
    obj: Any = gm
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _tensor_digest(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        raise _Unkeyable
    nbytes = t.numel() * t.element_size()
    if nbytes > MAX_HASHED_BYTES or t.is_meta or t.layout != torch.strided:
        raise _Unkeyable
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{tuple(t.shape)} {t.dtype} {hashlib.sha256(data).hexdigest()}"


class SharedEngines:
    """A per-partition converter that converts each distinct partition once, ``workers`` at a time.

    ``wrap(convert)`` takes Torch-TensorRT's ``convert_module(module, inputs, settings=..., name=...)``
    and returns this object, which Torch-TensorRT then calls in its place (``shim.building``).

    With ``workers`` > 1 a new partition is converted in a thread while Torch-TensorRT goes on to
    the next one: the call returns a ``Building`` stand-in at once (Torch-TensorRT 2.11 only sets it
    as the partition's child and may mark its outputs unowned), and ``finish(gm)`` waits for the
    conversions and puts each engine in its stand-ins' places. Use it as a context manager, so that
    a failed compile does not leave conversions running.

    After a build: ``built`` (partitions converted, in order), ``shared`` (partition name -> the
    built partition whose engine it runs), ``seconds`` (conversion time per built partition),
    ``ops`` (its call_function targets, counted: which partition a long conversion was) and
    ``wall_s`` (from the first conversion's start to the last one's end).
    """

    def __init__(self, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers
        self._convert: Callable[..., torch.nn.Module] | None = None
        self._by_key: dict[str, tuple[str, torch.nn.Module]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._spans: list[tuple[float, float]] = []
        self.built: list[str] = []
        self.shared: dict[str, str] = {}
        self.seconds: dict[str, float] = {}
        self.ops: dict[str, collections.Counter] = {}

    def wrap(self, convert: Callable[..., torch.nn.Module]) -> SharedEngines:
        self._convert = convert
        return self

    @property
    def wall_s(self) -> float:
        return max(e for _, e in self._spans) - min(s for s, _ in self._spans) if self._spans else 0.0

    def __enter__(self) -> SharedEngines:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:  # a failed compile: drop what has not started, wait for the rest
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __call__(self, module: fx.GraphModule, inputs: Any, *args: Any, **kwargs: Any) -> torch.nn.Module:
        if self._convert is None:
            raise RuntimeError("SharedEngines.wrap(convert) was not called")
        name = str(kwargs.get("name", f"partition_{len(self.built) + len(self.shared)}"))
        key = structure_key(module, list(inputs))
        if key is not None and key in self._by_key:
            first, engine = self._by_key[key]
            self.shared[name] = first
            return engine
        self.built.append(name)
        self.ops[name] = collections.Counter(
            str(n.target).removeprefix("aten.") for n in module.graph.nodes if n.op == "call_function"
        )
        if self.workers == 1:
            engine = self._timed(name, module, inputs, args, kwargs)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="prx-build")
            context = (torch.is_grad_enabled(), _current_cuda_device())  # both are per thread
            future = self._pool.submit(self._in_thread, context, name, module, inputs, args, kwargs)
            engine = Building(name, future)
        if key is not None:
            self._by_key[key] = (name, engine)
        return engine

    def finish(self, gm: torch.nn.Module) -> None:
        """Wait for the conversions still running and set each engine where its stand-in is in
        ``gm`` (the partitioned module Torch-TensorRT returned). Raises the first conversion's error."""
        try:
            engines: dict[int, torch.nn.Module] = {}
            for name, child in list(gm._modules.items()):  # _modules: a shared child under each name
                if isinstance(child, Building):
                    if id(child) not in engines:
                        engines[id(child)] = child.result()
                    gm._modules[name] = engines[id(child)]
        finally:
            self.__exit__()

    def _in_thread(self, context: tuple[bool, int | None], name: str, *call: Any) -> torch.nn.Module:
        grad, device = context
        with torch.set_grad_enabled(grad), torch.cuda.device(device) if device is not None else _nothing():
            return self._timed(name, *call)

    def _timed(self, name: str, module: Any, inputs: Any, args: Any, kwargs: Any) -> torch.nn.Module:
        t0 = time.perf_counter()
        engine = self._convert(module, inputs, *args, **kwargs)
        t1 = time.perf_counter()
        self.seconds[name] = t1 - t0
        self._spans.append((t0, t1))
        return engine


class Building(torch.nn.Module):
    """Stands in for a partition's engine while it is converted in a thread (``SharedEngines``)."""

    def __init__(self, name: str, future: Future) -> None:
        super().__init__()
        self.partition, self._future, self._unowned = name, future, None

    def set_output_tensors_as_unowned(self, enabled: bool) -> None:  # what compile_module may call
        self._unowned = enabled

    def result(self) -> torch.nn.Module:
        engine = self._future.result()
        if self._unowned is not None:
            engine.set_output_tensors_as_unowned(self._unowned)
        return engine

    def forward(self, *args: Any) -> Any:
        raise RuntimeError(f"the engine of {self.partition!r} is still being built (SharedEngines.finish)")


def _current_cuda_device() -> int | None:
    return torch.cuda.current_device() if torch.cuda.is_available() else None


_nothing = contextlib.nullcontext
