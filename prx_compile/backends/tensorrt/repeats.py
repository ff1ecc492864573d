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

import hashlib
import time
from collections.abc import Callable
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
    """A per-partition converter that converts each distinct partition once.

    ``wrap(convert)`` takes Torch-TensorRT's ``convert_module(module, inputs, settings=..., name=...)``
    and returns this object, which Torch-TensorRT then calls in its place (``shim.converting_with``).

    After a build: ``built`` (partitions converted, in order), ``shared`` (partition name -> the
    built partition whose engine it runs), ``seconds`` (conversion time per built partition).
    """

    def __init__(self) -> None:
        self._convert: Callable[..., torch.nn.Module] | None = None
        self._by_key: dict[str, tuple[str, torch.nn.Module]] = {}
        self.built: list[str] = []
        self.shared: dict[str, str] = {}
        self.seconds: dict[str, float] = {}

    def wrap(self, convert: Callable[..., torch.nn.Module]) -> SharedEngines:
        self._convert = convert
        return self

    def __call__(self, module: fx.GraphModule, inputs: Any, *args: Any, **kwargs: Any) -> torch.nn.Module:
        if self._convert is None:
            raise RuntimeError("SharedEngines.wrap(convert) was not called")
        name = str(kwargs.get("name", f"partition_{len(self.built) + len(self.shared)}"))
        key = structure_key(module, list(inputs))
        if key is not None and key in self._by_key:
            first, engine = self._by_key[key]
            self.shared[name] = first
            return engine
        t0 = time.perf_counter()
        engine = self._convert(module, inputs, *args, **kwargs)
        self.seconds[name] = time.perf_counter() - t0
        self.built.append(name)
        if key is not None:
            self._by_key[key] = (name, engine)
        return engine
