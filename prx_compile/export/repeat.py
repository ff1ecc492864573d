"""Trace one block, repeat it: the exported step of a model with D repeated blocks from an export of
its first block (of each block list the model's spec names).

``torch.export`` traces every block of the model, and each costs the same again: ~0.15 s at static
shapes, ~0.2 s and more over symbolic ones (measured on this project's CPU machine), most of it in
sympy. The blocks of a list are one computation on different weights, so ``repeat_blocks`` exports the
model with the first block of each list only, its carried tensors (``BlockList.carried``) between
two boundary markers (one node for its inputs, one for its outputs: an output nothing reads after
the last block, FLUX's text tokens after its single blocks, still has its place when ``prepare``'s
rules and decompositions drop dead code), and copies that block's nodes once per further block, each
copy reading its own block's weights:

    export(model with each list cut to [block 0], markers around block 0's carried inputs and outputs)
        -> nodes between the markers = block 0 (its operations, in trace order)
        -> copies 1..D-1 chained after it, block i's weight placeholders for block 0's
        -> markers removed; weight placeholders renumbered in the full model's ``weight_tensors`` order

The result is the graph a full export gives: the same operations in the same order on the same
inputs, up to which alias of an input each block reads (a full export chains ``mask.to(bool)`` from
block to block; the copies read the input). ``tests/test_export_repeat.py`` compares the two node by
node and their outputs (after ``prepare``, the last copy keeps that unread output's nodes, which a
prepared full export drops: ``export_step`` drops them too). Where the model is not one this applies
to, it says why and returns None, and the caller exports in full: weights baked into the graph
(``weights="engine"``), a list of fewer than two blocks, blocks whose parameters differ in names,
shapes or dtypes, blocks with forward hooks or different attention processors (an export traces them)
or different plain settings (an eps: baked in), a block called with positional carried tensors, or a
block value used after the block.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, TensorArgument
from torch.utils import _pytree as pytree

from ..models import ModelSpec

logger = logging.getLogger(__name__)


_SCALARS = (int, float, bool, str, type(None))
#: public attributes that change no export: ``training`` (the engines run inference whatever it says),
#: diffusers' ``gradient_checkpointing`` (it acts only with autograd on; an export runs without) and
#: ``lora_scale`` (what diffusers' ``fuse_lora`` last fused with; no forward reads it)
NOT_SETTINGS = frozenset({"training", "gradient_checkpointing", "lora_scale"})
_NOT_PLAIN = object()


def _plain(value: Any) -> Any:
    """``value`` as a setting (a list of scalars as a tuple: a config read from JSON gives lists where
    Python code gives tuples), or ``_NOT_PLAIN``."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (tuple, list)) and len(value) <= 16 and all(isinstance(x, _SCALARS) for x in value):
        return tuple(value)
    return _NOT_PLAIN


def settings(m: torch.nn.Module) -> dict[str, Any]:
    """A module's plain settings: its public attributes that hold a number, a string, None or a short
    tuple or list of those (an ``eps``, RoPE's ``theta`` and axes, ``head_dim``, ``normalized_shape``),
    which an export bakes into the graph as constants; ``NOT_SETTINGS`` left out."""
    out = {}
    for k, v in m.__dict__.items():
        if k[0] != "_" and k not in NOT_SETTINGS and (p := _plain(v)) is not _NOT_PLAIN:
            out[k] = p
    return out


@torch.library.custom_op("prx_compile::block_boundary", mutates_args=())
def block_boundary(xs: list[torch.Tensor], tag: int) -> list[torch.Tensor]:
    """Identity (copies): marks a block's carried inputs (``tag`` 2i, block list i) or its outputs
    (2i + 1) in an export, all of them in one node, so that an output the rest of the model never
    reads (FLUX's last single block's text tokens) keeps its place: a node of its own would be dead
    code, which lowering and decompositions remove. Never kept."""
    return [x.clone() for x in xs]


@block_boundary.register_fake
def _(xs: list[torch.Tensor], tag: int) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in xs]


BOUNDARY = torch.ops.prx_compile.block_boundary.default


class _MarkedBlocks(torch.nn.ModuleList):
    """A ModuleList whose iteration yields its blocks wrapped in boundary markers (what the model's
    forward loops over); its parameters keep their names."""

    def __init__(self, blocks, index: int, carried: tuple[str, ...]):
        super().__init__(blocks)
        object.__setattr__(self, "_mark", (index, carried))

    def __iter__(self) -> Iterator[Any]:
        index, carried = self._mark
        for block in super().__iter__():
            yield _marked(block, index, carried)


def _marked(block: torch.nn.Module, index: int, carried: tuple[str, ...]):
    def call(*args: Any, **kwargs: Any) -> Any:
        names = [name for name in carried if isinstance(kwargs.get(name), torch.Tensor)]
        if names:
            kwargs.update(zip(names, block_boundary([kwargs[n] for n in names], 2 * index), strict=True))
        out = block(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return block_boundary([out], 2 * index + 1)[0]
        if isinstance(out, tuple) and all(isinstance(o, torch.Tensor) for o in out):
            return tuple(block_boundary(list(out), 2 * index + 1))
        return out

    return call


def why_not(model: torch.nn.Module, spec: ModelSpec, weights: str) -> str | None:
    """Why ``repeat_blocks`` does not apply to ``model`` (None: it does)."""
    if weights != "inputs":
        return "the weights are baked into the graph (weights='engine')"
    if not spec.blocks:
        return "the model has no list of repeated blocks"

    def layout(block: torch.nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        tensors = [*block.named_parameters(), *block.named_buffers()]
        return [(name, tuple(t.shape), t.dtype) for name, t in tensors]

    def plain_settings(block: torch.nn.Module) -> list[tuple[str, dict[str, Any]]]:
        return [(name, settings(m)) for name, m in block.named_modules()]

    def processors(block: torch.nn.Module) -> list[tuple[str, type]]:
        return [(name, type(m.__dict__.get("processor"))) for name, m in block.named_modules()]

    for bl in spec.blocks:
        blocks = getattr(model, bl.attr, None)
        if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) < 2:
            return f"{bl.attr} is not a list of two or more blocks"
        first = layout(blocks[0])
        if any(type(b) is not type(blocks[0]) or layout(b) != first for b in blocks):
            return f"the blocks of {bl.attr} differ in class, parameter names, shapes or dtypes"
        # an export traces hooks, forwards set on modules and attention processors: block 0's would
        # stand for every block's
        if any(m._forward_hooks or m._forward_pre_hooks for b in blocks for m in b.modules()):
            return f"blocks of {bl.attr} have forward hooks"
        if any("forward" in m.__dict__ for b in blocks for m in b.modules()):
            return f"blocks of {bl.attr} have replaced forwards"
        if any(processors(b) != processors(blocks[0]) for b in blocks):
            return f"the blocks of {bl.attr} differ in their attention processors"
        # an export bakes plain settings in as constants (a norm's eps): block 0's would stand for all
        if any(plain_settings(b) != plain_settings(blocks[0]) for b in blocks):
            return f"the blocks of {bl.attr} differ in a setting (a norm's epsilon, ...)"
    return None


def first_blocks_only(model: torch.nn.Module, spec: ModelSpec) -> torch.nn.Module:
    """A shallow copy of ``model`` whose block lists are ``[block 0]`` each, marked (the same modules
    and tensors: nothing is copied, the model itself is not changed)."""
    small = copy.copy(model)
    small.__dict__["_modules"] = dict(model._modules)
    for i, bl in enumerate(spec.blocks):
        small._modules[bl.attr] = _MarkedBlocks([getattr(model, bl.attr)[0]], i, bl.carried)
    return small


def repeat_blocks(
    ep: ExportedProgram,
    small_names: list[str],
    full_names: list[str],
    spec: ModelSpec,
    model: torch.nn.Module,
) -> ExportedProgram | None:
    """The exported step of ``model`` from ``ep``, the export of ``first_blocks_only(model, spec)``.

    small_names / full_names: the weight FQNs of the cut and the full model, in their ``weights_*``
    order. None (logged) where the graph is not one marked block per list between the rest."""
    gm = ep.graph_module
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    lists = []
    markers = [n for n in nodes if n.op == "call_function" and n.target is BOUNDARY]
    for i, bl in enumerate(spec.blocks):
        marks = [[n for n in markers if n.args[1] == 2 * i + side] for side in (0, 1)]
        if len(marks[0]) != 1 or len(marks[1]) != 1:
            return _no(f"{bl.attr}: {len(marks[0])} + {len(marks[1])} block boundaries, not 1 each")
        (start,), (end,) = marks
        n_in, n_out = len(start.args[0]), len(end.args[0])
        if n_in != len(bl.carried) or n_out != len(bl.carried):
            return _no(f"{bl.attr}: {n_in} tensors into the block and {n_out} out, not {len(bl.carried)}")
        if order[start] > order[end]:
            return _no(f"{bl.attr}: the block boundaries are out of order")
        ins, tail = _items(start, n_in), _items(end, n_out)  # by index, None where nothing reads it
        if ins is None or tail is None:
            return _no(f"{bl.attr}: a block boundary's result is used other than item by item")
        outs = list(end.args[0])  # the block's results, as end takes them
        body = [n for n in nodes[order[start] + 1 : order[end]] if n not in ins]
        if any(n.target is BOUNDARY for n in body):
            return _no(f"{bl.attr}: another block's boundary inside the block")
        inside = {*body, end}
        for n in body:  # a shape value (SymInt) is the same in every block: later code may reuse it
            if not _is_shape(n) and any(u not in inside for u in n.users):
                return _no(f"block value {n.name} is used after the block")
        if any(u not in inside for g in ins if g is not None for u in g.users):
            return _no(f"{bl.attr}: a block input is used outside the block")
        lists.append((bl, start, ins, end, tail, outs, body, inside))
    placeholders = {n.name: n for n in nodes if n.op == "placeholder"}
    by_name = {name: placeholders.get(f"weights_{k}") for k, name in enumerate(small_names)}
    if None in by_name.values():
        return _no("a weight placeholder is missing")
    owns: dict[str, dict[str, torch.fx.Node]] = {}
    for bl, *_, inside in lists:
        prefix = f"{bl.attr}.0."
        own = owns[bl.attr] = {n[len(prefix) :]: ph for n, ph in by_name.items() if n.startswith(prefix)}
        for ph in own.values():
            if any(u not in inside for u in ph.users):
                return _no(f"block 0 weight {ph.name} is read outside the block")
    attrs = tuple(f"{bl.attr}." for bl in spec.blocks)
    expected = [
        n for n in full_names if not n.startswith(attrs) or n.startswith(tuple(a + "0." for a in attrs))
    ]
    depth = {bl.attr: len(getattr(model, bl.attr)) for bl in spec.blocks}
    if expected != small_names or not all(
        f"{a}.{i}.{k}" in full_names for a, own in owns.items() for i in range(depth[a]) for k in own
    ):
        return _no("the weights of the cut export do not match the full model's")

    # new placeholders, in the full model's order, after the activations
    for ph in by_name.values():
        ph._rename(f"_one_block_{ph.name}")
    last_input = [n for n in nodes if n.op == "placeholder" and not n.name.startswith("_one_block_")][-1]
    new_ph: dict[str, torch.fx.Node] = {}
    with graph.inserting_after(last_input):
        for name in reversed(full_names):  # each inserted right after the activations
            new_ph[name] = graph.placeholder("w")
    for j, name in enumerate(full_names):
        ph = new_ph[name]
        ph._rename(f"weights_{j}")
        ph.target = ph.name
        a = next((a for a in owns if name.startswith(f"{a}.")), None)
        source = by_name.get(name) or owns[a][name.split(".", 2)[2]]
        ph.meta = dict(source.meta)
        if name not in by_name:  # its own value: inputs that share one would be taken as aliases
            ph.meta["val"] = _fresh(source.meta["val"])
    for name, ph in by_name.items():
        ph.replace_all_uses_with(new_ph[name])
        graph.erase_node(ph)

    for bl, start, ins, end, tail, outs, body, _ in lists:
        prefix, own = f"{bl.attr}.0.", owns[bl.attr]
        previous, cursor = outs, body[-1] if body else end
        for i in range(1, depth[bl.attr]):
            env = {g: p for g, p in zip(ins, previous, strict=True) if g is not None}
            env.update({new_ph[prefix + k]: new_ph[f"{bl.attr}.{i}.{k}"] for k in own})
            for n in body:
                with graph.inserting_after(cursor):
                    cursor = graph.node_copy(n, lambda x, env=env: env.get(x, x))
                env[n] = cursor
            previous = [env.get(o, o) for o in outs]
        # the markers go: what read block 0's marked inputs reads the inputs, what read the last
        # block's results reads the last copy's
        for item, last in zip(tail, previous, strict=True):
            if item is not None:
                item.replace_all_uses_with(last)
                graph.erase_node(item)
        graph.erase_node(end)
        for item, given in zip(ins, start.args[0], strict=True):
            if item is not None:
                item.replace_all_uses_with(given)
                graph.erase_node(item)
        graph.erase_node(start)
    graph.lint()
    gm.recompile()
    return _program(ep, gm, full_names)


def _items(marker: torch.fx.Node, n: int) -> list[torch.fx.Node | None] | None:
    """The ``getitem`` nodes of a boundary's n results, by index (None for one nothing reads); None
    where it is used otherwise."""
    items: list[torch.fx.Node | None] = [None] * n
    for user in marker.users:
        k = user.args[1] if user.target is operator.getitem else None
        if not isinstance(k, int) or not 0 <= k < n or items[k] is not None:
            return None
        items[k] = user
    return items


def _is_shape(node: torch.fx.Node) -> bool:
    """Whether ``node`` computes a size (an int or SymInt), not a tensor."""
    return isinstance(node.meta.get("val"), (int, torch.SymInt))


def _fresh(val: Any) -> Any:
    """A new fake tensor like ``val`` (same mode, shape, strides, dtype, device)."""
    if not isinstance(val, torch.Tensor):
        return val
    mode = getattr(val, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)


def _program(ep: ExportedProgram, gm: torch.fx.GraphModule, full_names: list[str]) -> ExportedProgram:
    """``ep``'s signature and call graph for ``gm``, whose ``weights`` input holds ``full_names``."""
    inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    user = {s.arg.name: s for s in ep.graph_signature.input_specs if not s.arg.name.startswith("weights_")}
    specs = [
        user.get(name) or InputSpec(InputKind.USER_INPUT, TensorArgument(name=name), None) for name in inputs
    ]
    signature = ExportGraphSignature(input_specs=specs, output_specs=list(ep.graph_signature.output_specs))
    entries = []
    for entry in ep.module_call_graph:
        sig = entry.signature
        if entry.fqn == "" and sig is not None:
            args, kwargs = pytree.tree_unflatten([0] * sig.in_spec.num_leaves, sig.in_spec)
            kwargs = dict(kwargs, weights=[0] * len(full_names))
            in_spec = pytree.tree_structure((args, kwargs))
            sig = dataclasses.replace(
                sig, inputs=[TensorArgument(name=name) for name in inputs], in_spec=in_spec
            )
        entries.append(ModuleCallEntry(fqn=entry.fqn, signature=sig))
    return ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=signature,
        state_dict={},
        range_constraints=ep.range_constraints,
        module_call_graph=entries,
        example_inputs=None,
        constants=ep.constants,
        verifiers=ep.verifiers,
    )


def _no(reason: str) -> None:
    logger.info("export: tracing every block (%s)", reason)
    return None
