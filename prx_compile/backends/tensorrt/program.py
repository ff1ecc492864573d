"""A compiled step as plain data: calls over named values, and the small interpreter that runs it.

The tensorrt backend keeps what Torch-TensorRT partitioned (engines, and the PyTorch ops left between
them) as a ``Program``, whether it built the engines or loaded them, so one object runs, saves and
refits. A Program is JSON: ``Program.from_json`` validates every field, and running one can only call
one of its own engines or an op of ``OPS``, an explicit table of the exact PyTorch ops our lowering and
Torch-TensorRT leave between engines. Every op there is functional (no in-place, no ``out=``) and works
on tensors in memory; none reads or writes a file. No Python code is generated from a Program and no
name is resolved outside that table.

Values are named ``in:<input>`` (one of the step's inputs, ``ModelSpec.inputs``), ``w:<parameter
FQN>`` (a parameter of the transformer, read live at every call), ``c:<name>`` (a constant tensor) or
``v<n>`` (a step's result).
Arguments are JSON: ``{"ref": value}``, numbers, booleans, null, ``{"list": [...]}``,
``{"tuple": [...]}``, ``{"float": "inf"|"-inf"|"nan"}``, ``{"dtype": name}`` and ``{"str": word}`` (an
op's option such as a kernel name: at most 20 of ``[a-z0-9_]``).
"""

from __future__ import annotations

import math
import operator
import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ... import schema
from ...ops import registry

aten = torch.ops.aten


def _ops() -> dict[str, Callable]:
    overloads = [
        *registry.overloads(),  # every op prx_compile keeps in PyTorch, declared once
        aten.sym_size.int,
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.permute.default,
        aten.transpose.int,
        aten.t.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.slice.Tensor,
        aten.select.int,
        aten.expand.default,
        aten.alias.default,
        aten.clone.default,
        aten._to_copy.default,
        aten.cat.default,
        aten.stack.default,
        aten.split.Tensor,
        aten.split_with_sizes.default,
        aten.add.Tensor,
        aten.sub.Tensor,
        aten.mul.Tensor,
        aten.div.Tensor,
        aten.neg.default,
        aten.eq.Scalar,
        aten.ne.Scalar,
        aten.logical_not.default,
        aten.bitwise_not.default,
        aten.any.dim,
        aten.where.self,
    ]
    table: dict[str, Callable] = {op_name(op): op for op in overloads}
    for fn in (operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv):
        table[op_name(fn)] = fn
    return table


def op_name(target: Any) -> str:
    """The table key of an FX call target: ``aten.view.default``, ``operator.getitem``."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    if getattr(target, "__module__", None) == "_operator":
        return f"operator.{target.__name__}"
    return repr(target)


OPS: dict[str, Callable] = _ops()
#: Steps that only route values (not counted as work kept in PyTorch in reports).
BOOKKEEPING = {"operator.getitem", "aten.sym_size.int"} | {k for k in OPS if k.startswith("operator.")}

_VALUE = re.compile(r"in:[a-z_]+|w:[A-Za-z0-9_.]{1,200}|c:[A-Za-z0-9_.]{1,200}|v[0-9]{1,7}")
_ENGINE = re.compile(r"[A-Za-z0-9_]{1,100}")
_WORD = re.compile(r"[a-z0-9_]{1,20}")
_DTYPES = {
    str(d).split(".")[-1]: d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8)
}
_MAX_DEPTH = 8
_MAX_STEPS = 100_000


_ARG = schema.Later("_check_arg")  # values and references: checked with the names they may use
_STEP = schema.Dict(
    {
        "op": schema.Str(80),
        "engine": schema.OneOf(
            schema.Null(), schema.Str(100, pattern=_ENGINE.pattern, what="an engine name")
        ),
        "args": schema.List(_ARG, max_len=10_000),
        "kwargs": schema.Map(
            schema.Str(41, pattern=r"[a-z][a-z0-9_]{0,40}", what="a keyword name"), _ARG, 64
        ),
        "out": schema.Str(8, pattern=r"v[0-9]{1,7}", what="a result name v<n>"),
    }
)
_PROGRAM = schema.Dict(
    {
        "inputs": schema.List(schema.Str(40, pattern=r"[a-z_]{1,40}", what="an input name"), max_len=16),
        "steps": schema.List(_STEP, max_len=_MAX_STEPS),
        "output": _ARG,
        "segments": schema.Int(0, _MAX_STEPS),
    }
)


class ProgramError(ValueError):
    """A Program (or its JSON) is malformed; the message names the step and the field."""


@dataclass
class Step:
    """One call: ``out = fn(*args, **kwargs)``, fn an engine (op "engine") or ``OPS[op]``."""

    op: str
    args: list
    kwargs: dict
    out: str
    engine: str | None = None


@dataclass
class Program:
    """inputs: activation names in order; steps; output: encoded result; segments: how many PyTorch
    segments Torch-TensorRT made (for reports)."""

    inputs: list[str]
    steps: list[Step]
    output: Any
    segments: int = 0
    #: read from JSON (an artifact or a cache entry): runs bounded, every failure an ArtifactError
    untrusted: bool = field(default=False, repr=False, compare=False)
    _frees: tuple = field(default=(None, []), init=False, repr=False, compare=False)
    _checked: set = field(default_factory=set, init=False, repr=False, compare=False)

    # -- running --------------------------------------------------------------------------------
    def run(
        self,
        inputs: Mapping[str, Any],
        params: Mapping[str, torch.Tensor],
        engines: Mapping[str, Callable],
        constants: Mapping[str, torch.Tensor],
    ) -> Any:
        """Run the steps: inputs by activation name, params by FQN, constants by name.

        A Program read from JSON (``untrusted``) runs under ``_Guard`` until these input shapes have
        run once, and any failure is an ArtifactError naming the step."""
        env: dict[str, Any] = {}

        def val(a):
            if isinstance(a, dict):
                ((kind, v),) = a.items()
                if kind == "ref":
                    if v.startswith("v"):
                        return env[v]
                    if v.startswith("w:"):
                        return params[v[2:]]
                    if v.startswith("in:"):
                        return inputs[v[3:]]
                    return constants[v[2:]]
                if kind == "list":
                    return [val(x) for x in v]
                if kind == "tuple":
                    return tuple(val(x) for x in v)
                if kind == "float":
                    return float(v)
                if kind == "str":
                    return v
                return _DTYPES[v]
            return a

        guard = signature = None
        if self.untrusted:  # only a Program read from JSON pays for the shapes check
            signature = tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(inputs.items()))
            if signature not in self._checked:
                guard = _Guard([*inputs.values(), *params.values(), *constants.values()])
        at = None  # the step running, for the error
        try:
            for at, done in zip(self.steps, self.frees(), strict=True):
                fn = engines[at.engine] if at.op == "engine" else OPS[at.op]
                args = [val(a) for a in at.args]
                kwargs = {k: val(v) for k, v in at.kwargs.items()}
                if guard is not None and at.op != "engine":
                    guard.before(fn, args, kwargs)
                env[at.out] = fn(*args, **kwargs)
                if guard is not None:
                    if at.op == "engine":  # what an engine makes is the artifact's engine, not the Program
                        guard.given(env[at.out])
                    guard.after(env[at.out])
                for name in done:  # a result no later step reads: its memory can be reused now
                    if guard is not None:
                        guard.drop(env[name])
                    del env[name]
            at = None
            out = val(self.output)
            if self.untrusted:
                _check_output(out)
        except Exception as e:
            if not self.untrusted:
                raise
            from ...errors import ArtifactError, one_line

            where = "its output" if at is None else f"{at.out} ({at.engine if at.op == 'engine' else at.op})"
            raise ArtifactError(
                f"the artifact's program failed at {where}: {type(e).__name__}: {one_line(e)}",
                "load it with rebuild=True (its engines and program are then built again here).",
            ) from e
        if guard is not None:
            self._checked.add(signature)
        return out

    def frees(self) -> list[list[str]]:
        """For each step, the results to drop after it: those no later step and not the output read.
        Without it a step would hold every intermediate to its end, and a CUDA graph of it their sum
        (7.2 GB at 1024² batch 2 on the full PRX) instead of the most alive at once."""
        if self._frees[0] is not self.steps:  # computed once per list of steps
            last: dict[str, int] = {}
            for i, st in enumerate(self.steps):
                last[st.out] = i  # a result nothing reads goes right after its step
                for a in [*st.args, *st.kwargs.values()]:
                    for v in _step_refs(a):
                        last[v] = i
            kept = set(_step_refs(self.output))
            frees: list[list[str]] = [[] for _ in self.steps]
            for v, i in last.items():
                if v not in kept:
                    frees[i].append(v)
            self._frees = (self.steps, frees)
        return self._frees[1]

    # -- facts ----------------------------------------------------------------------------------
    def refs(self, prefix: str) -> set[str]:
        """Names this program reads with ``prefix`` ("w:" parameters, "c:" constants, "in:" inputs)."""
        found: set[str] = set()

        def walk(a):
            if isinstance(a, dict):
                ((kind, v),) = a.items()
                if kind == "ref" and v.startswith(prefix):
                    found.add(v[len(prefix) :])
                elif kind in ("list", "tuple"):
                    for x in v:
                        walk(x)

        for st in self.steps:
            for a in [*st.args, *st.kwargs.values()]:
                walk(a)
        walk(self.output)
        return found

    def engine_names(self) -> list[str]:
        return list(dict.fromkeys(st.engine for st in self.steps if st.op == "engine"))

    def torch_ops(self) -> dict[str, int]:
        """Ops run by PyTorch between engines (routing steps left out), with counts."""
        return dict(Counter(st.op for st in self.steps if st.op != "engine" and st.op not in BOOKKEEPING))

    # -- JSON -----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": list(self.inputs),
            "steps": [
                {"op": s.op, "engine": s.engine, "args": s.args, "kwargs": s.kwargs, "out": s.out}
                for s in self.steps
            ],
            "output": self.output,
            "segments": self.segments,
        }

    @classmethod
    def from_json(
        cls, data: Any, *, engines: set[str], params: set[str], constants: set[str], inputs: tuple[str, ...]
    ) -> Program:
        """A validated Program; ProgramError naming the field for anything unexpected.

        engines, params, constants, inputs: the names that exist (engine files, the transformer's
        parameter FQNs, saved constants, the model's step inputs). Every reference must name one of
        them or an earlier step's result.
        """
        try:  # the shape of every field; what the names refer to is checked below
            schema.check(_PROGRAM, data, "program")
        except schema.SchemaError as e:
            raise ProgramError(str(e)) from e
        allowed = inputs
        inputs, steps_data = data["inputs"], data["steps"]
        unknown = [n for n in inputs if n not in allowed]
        if unknown or len(set(inputs)) != len(inputs):
            raise ProgramError(f"program.inputs {[n[:40] for n in inputs][:8]} are not inputs of this model")
        known = {
            "in": set(inputs),
            "w": params,
            "c": constants,
        }
        defined: set[str] = set()
        steps = []
        for i, s in enumerate(steps_data):
            where = f"program.steps[{i}]"
            op, engine, out = s["op"], s["engine"], s["out"]
            if op == "engine":
                if engine not in engines:
                    raise ProgramError(
                        f"{where}.engine={str(engine)[:80]!r} is not an engine of this artifact"
                    )
            elif op not in OPS or engine is not None:
                raise ProgramError(f"{where}.op={str(op)[:80]!r} is not an allowed operator")
            if op == "engine" and s["kwargs"]:
                raise ProgramError(f"{where}: an engine takes no keyword arguments")
            for a in [*s["args"], *s["kwargs"].values()]:
                _check_arg(a, known, defined, where, 0)
            if out in defined:
                raise ProgramError(f"{where}.out={str(out)[:80]!r} must be a new result name v<n>")
            defined.add(out)
            steps.append(Step(op, list(s["args"]), dict(s["kwargs"]), out, engine))
        _check_arg(data["output"], known, defined, "program.output", 0)
        return cls(list(inputs), steps, data["output"], data["segments"], untrusted=True)


#: a loaded Program's result may be at most this many times the largest tensor it was given (its
#: inputs, the weights, constants and the engines' results), and its live results together this
#: many times all it was given (at least a few MiB either way)
GROWTH = 16
MAX_TENSOR_BYTES = 64 * 2**30
MAX_INT = 2**63
#: the most items a list a step makes may hold, and the most results one step may return (a JSON
#: list holds at most 4096 too): sized from the arguments before the step runs
MAX_ITEMS = 4096


class _Guard:
    """Bounds on one run of a Program read from JSON, so that a hostile one fails in well under a
    second instead of exhausting memory: each op's result is sized on meta tensors before it runs
    (no allocation), integers stay below ``MAX_INT``, and the storages the results hold together are
    counted as they are made and dropped."""

    def __init__(self, given: list[Any]):
        self.largest = self.total = 0
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, results holding it]
        self.live_bytes = 0
        self.given(given)

    def given(self, tensors: Any) -> None:
        """Tensors the Program did not make (inputs, weights, constants, an engine's results)."""
        sizes = [t.numel() * t.element_size() for t in _tensors(tensors)]
        self.largest, self.total = max([self.largest, *sizes]), self.total + sum(sizes)
        self.max_bytes = min(MAX_TENSOR_BYTES, max(2**22, GROWTH * self.largest))
        self.max_live = max(2**24, GROWTH * self.total)

    def before(self, fn: Callable, args: list, kwargs: dict) -> None:
        _count_items(fn, args, kwargs)  # what sizing on meta tensors would itself allocate
        meta = torch.utils._pytree.tree_map(_as_meta, (args, kwargs))
        for t in _tensors(fn(*meta[0], **meta[1])):
            size = t.numel() * t.element_size()
            if size > self.max_bytes:
                raise ValueError(
                    f"a result of {size} bytes, more than this program may make ({self.max_bytes})"
                )

    def after(self, out: Any) -> None:
        if isinstance(out, int) and not isinstance(out, bool) and abs(out) >= MAX_INT:
            raise ValueError(f"an integer result of {out.bit_length()} bits")
        for t in _tensors(out):
            key = t.untyped_storage().data_ptr()
            entry = self.live.setdefault(key, [t.untyped_storage().nbytes(), 0])
            if entry[1] == 0:
                self.live_bytes += entry[0]
            entry[1] += 1
        if self.live_bytes > self.max_live:
            raise ValueError(f"its results hold {self.live_bytes} bytes, more than it may ({self.max_live})")

    def drop(self, out: Any) -> None:
        for t in _tensors(out):
            entry = self.live.get(t.untyped_storage().data_ptr())
            if entry is not None:
                entry[1] -= 1
                if entry[1] == 0:
                    self.live_bytes -= entry[0]


def _count_items(fn: Callable, args: list, kwargs: dict) -> None:
    """ValueError where a step would make more than ``MAX_ITEMS`` Python objects (a string: characters),
    worked out from its arguments alone: a list or string repeated (``operator.mul``) or joined
    (``operator.add``), a tensor split into views (``aten.split.Tensor``)."""
    seqs = [a for a in args if isinstance(a, (list, tuple, str))]
    if fn is operator.mul and seqs:
        times = next((a for a in args if isinstance(a, int) and not isinstance(a, bool)), 1)
        n = len(seqs[0]) * max(times, 0)
    elif fn is operator.add and len(seqs) == 2:
        n = len(seqs[0]) + len(seqs[1])
    elif fn is aten.split.Tensor and args and isinstance(args[0], torch.Tensor):
        size = args[1] if len(args) > 1 else kwargs.get("split_size", 1)
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        if not isinstance(size, int) or not isinstance(dim, int) or not -args[0].dim() <= dim < args[0].dim():
            return  # the op refuses it itself, allocating nothing
        n = -(-args[0].shape[dim] // size) if size > 0 else 0
    else:
        return
    if n > MAX_ITEMS:
        raise ValueError(f"a result of {n} items, more than a step may make ({MAX_ITEMS})")


def _as_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta")
    return x


def _tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _check_output(out: Any) -> None:
    """A step's output is a tensor, or a tuple of tensors (what the caller takes apart)."""
    items = out if isinstance(out, (list, tuple)) else [out]
    if not items or not all(isinstance(t, torch.Tensor) for t in items):
        raise TypeError(f"the output is {type(out).__name__}, not a tensor")


def _step_refs(a: Any) -> Iterator[str]:
    """The step results (``v<n>``) an encoded argument reads."""
    if isinstance(a, dict):
        ((kind, v),) = a.items()
        if kind == "ref" and v.startswith("v"):
            yield v
        elif kind in ("list", "tuple"):
            for x in v:
                yield from _step_refs(x)


def _check_arg(a: Any, known: dict[str, set[str]], defined: set[str], where: str, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise ProgramError(f"{where}: arguments nest deeper than {_MAX_DEPTH}")
    if a is None or isinstance(a, bool) or isinstance(a, int) and abs(a) < 1 << 62:
        return
    if isinstance(a, float) and math.isfinite(a):
        return
    if not isinstance(a, dict) or len(a) != 1:
        raise ProgramError(f"{where}: argument {str(a)[:80]!r} is not an allowed value")
    ((kind, v),) = a.items()
    if kind == "ref":
        if not isinstance(v, str) or not _VALUE.fullmatch(v):
            raise ProgramError(f"{where}: {str(v)[:80]!r} is not a value name")
        if v.startswith("v"):
            ok = v in defined
        else:
            prefix, name = v.split(":", 1)
            ok = name in known[prefix]
        if not ok:
            raise ProgramError(f"{where}: {v[:80]!r} is not defined before this step")
    elif kind in ("list", "tuple"):
        if not isinstance(v, list) or len(v) > 4096:
            raise ProgramError(f"{where}: {kind} must be a list of at most 4096 values")
        for x in v:
            _check_arg(x, known, defined, where, depth + 1)
    elif kind == "float":
        if not isinstance(v, str) or v not in ("inf", "-inf", "nan"):
            raise ProgramError(f"{where}: float {str(v)[:20]!r} is not inf, -inf or nan")
    elif kind == "dtype":
        if not isinstance(v, str) or v not in _DTYPES:
            raise ProgramError(f"{where}: dtype {str(v)[:20]!r} is not one of {sorted(_DTYPES)}")
    elif kind == "str":
        if not isinstance(v, str) or not _WORD.fullmatch(v):
            raise ProgramError(f"{where}: string {str(v)[:20]!r} is not a word of [a-z0-9_] (at most 20)")
    else:
        raise ProgramError(f"{where}: argument kind {str(kind)[:20]!r} is not allowed")


# -- from a partitioned FX graph (build time) ---------------------------------------------------
def from_graph_module(
    gm: fx.GraphModule,
    *,
    engines: set[str],
    weight_names: list[str] | None,
    params: Mapping[str, torch.Tensor],
    inputs: tuple[str, ...],
) -> tuple[Program, dict[str, torch.Tensor]]:
    """The Program of a partitioned GraphModule, and the constants it needs.

    gm: Torch-TensorRT's output: placeholders (``inputs``, the step's, then ``weights_<i>``), engine
        children (``engines``), PyTorch segments (GraphModule children, inlined here), getitem.
    weight_names: parameter FQNs in ``weights_<i>`` order (None when weights are baked in).
    params: the transformer's parameters by FQN: a ``get_attr`` of one of them (same storage)
        becomes a live ``w:`` reference, any other tensor a constant.

    Raises ProgramError naming the node when an op is not in ``OPS``.
    """
    by_storage = {(p.data_ptr(), tuple(p.shape), p.dtype, tuple(p.stride())): n for n, p in params.items()}
    constants: dict[str, torch.Tensor] = {}
    steps: list[Step] = []
    allowed, inputs = inputs, []
    segments = 0

    def tensor_ref(t: torch.Tensor, hint: str) -> dict:
        key = (t.data_ptr(), tuple(t.shape), t.dtype, tuple(t.stride()))
        if key in by_storage:
            return {"ref": "w:" + by_storage[key]}
        name = re.sub(r"[^A-Za-z0-9_.]", "_", hint)[:150] or "const"
        while name in constants and constants[name] is not t:
            name += "_"
        constants[name] = t
        return {"ref": "c:" + name}

    def encode(a: Any, env: dict[fx.Node, Any]) -> Any:
        if isinstance(a, fx.Node):
            return env[a]
        if isinstance(a, (list, tuple)):
            return {"list" if isinstance(a, list) else "tuple": [encode(x, env) for x in a]}
        if isinstance(a, torch.dtype):
            name = str(a).split(".")[-1]
            if name not in _DTYPES:
                raise ProgramError(f"dtype {a} cannot be saved")
            return {"dtype": name}
        if isinstance(a, float) and not math.isfinite(a):
            return {"float": str(a)}
        if isinstance(a, str) and _WORD.fullmatch(a):  # an op's option, such as a kernel's name
            return {"str": a}
        if a is None or isinstance(a, (bool, int, float)):
            return a
        if isinstance(a, torch.memory_format) and a == torch.contiguous_format:
            return None  # the default of every op that takes one
        raise ProgramError(f"argument {a!r} of type {type(a).__name__} is not supported between engines")

    def emit(op: str, args: list, kwargs: dict, engine: str | None = None) -> dict:
        out = f"v{len(steps)}"
        steps.append(Step(op, args, kwargs, out, engine))
        return {"ref": out}

    def walk(graph_module: fx.GraphModule, env: dict[fx.Node, Any], top: bool) -> Any:
        nonlocal segments
        for node in graph_module.graph.nodes:
            if node.op == "placeholder":
                if not top:
                    continue  # bound by the caller
                if node.name in allowed:
                    inputs.append(node.name)
                    env[node] = {"ref": "in:" + node.name}
                elif weight_names is not None and re.fullmatch(r"weights_[0-9]+", node.name):
                    env[node] = {"ref": "w:" + weight_names[int(node.name.split("_")[1])]}
                else:
                    raise ProgramError(f"unexpected graph input {node.name!r}")
            elif node.op == "get_attr":
                env[node] = tensor_ref(_attr(graph_module, node.target), node.target)
            elif node.op == "call_module":
                args = [encode(a, env) for a in node.args]
                if node.target in engines:
                    env[node] = emit("engine", args, {}, node.target)
                else:
                    sub = graph_module.get_submodule(node.target)
                    if not isinstance(sub, fx.GraphModule):
                        raise ProgramError(f"child {node.target!r} is neither an engine nor a graph")
                    segments += 1
                    holders = [n for n in sub.graph.nodes if n.op == "placeholder"]
                    sub_env = dict(zip(holders, args, strict=True))
                    env[node] = walk(sub, sub_env, top=False)
            elif node.op == "call_function":
                name = op_name(node.target)
                if name not in OPS:
                    raise ProgramError(
                        f"{name} (node {node.name}) runs in PyTorch between engines but is not in "
                        "prx_compile.backends.tensorrt.program.OPS"
                    )
                args = [encode(a, env) for a in node.args]
                kwargs = {k: encode(v, env) for k, v in node.kwargs.items()}
                env[node] = emit(name, args, kwargs)
            elif node.op == "output":
                return encode(node.args[0], env)
            else:
                raise ProgramError(f"node kind {node.op} ({node.name}) is not supported")
        raise ProgramError("graph has no output")

    output = walk(gm, {}, top=True)
    return Program(inputs, steps, output, segments), constants


def _attr(module: torch.nn.Module, qualname: str) -> torch.Tensor:
    for part in qualname.split("."):
        module = getattr(module, part)
    if not isinstance(module, torch.Tensor):
        raise ProgramError(f"attribute {qualname!r} is not a tensor")
    return module
