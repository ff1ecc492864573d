"""Trace one PRX block, repeat it: the exported step of a D-block model from an export of its first block.

``torch.export`` traces every block of the model, and each costs the same again: ~0.15 s at static
shapes, ~0.2 s and more over symbolic ones (measured on this project's CPU machine), most of it in
sympy. The blocks are one computation on different weights, so ``repeat_blocks`` exports the model
with its first block only, between two boundary markers, and copies that block's nodes once per
further block, each copy reading its own block's weights:

    export(model with blocks[:1], markers around blocks[0])
        -> nodes between the markers = block 0 (its operations, in trace order)
        -> copies 1..D-1 chained after it, block i's weight placeholders for block 0's
        -> markers removed; weight placeholders renumbered in the full model's ``weight_tensors`` order

The result is the graph a full export gives: the same operations in the same order on the same
inputs, up to which alias of the text mask each block reads (a full export chains ``mask.to(bool)``
from block to block; the copies read the input). ``tests/test_export_repeat.py`` compares the two
node by node and their outputs. Where
the model is not one this applies to, it says why and returns None, and the caller exports in full:
weights baked into the graph (``weights="engine"``), fewer than two blocks, blocks whose parameters
differ in names, shapes or dtypes, a block called with positional hidden states, or a block value
used after the block.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, TensorArgument
from torch.utils import _pytree as pytree

logger = logging.getLogger(__name__)


@torch.library.custom_op("prx_compile::block_boundary", mutates_args=())
def block_boundary(x: torch.Tensor) -> torch.Tensor:
    """Identity (a copy): marks a block's hidden-state input and output in an export; never kept."""
    return x.clone()


@block_boundary.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


BOUNDARY = torch.ops.prx_compile.block_boundary.default


class _MarkedBlocks(torch.nn.ModuleList):
    """A ModuleList whose iteration yields its blocks wrapped in boundary markers (what PRX's forward
    loops over); its parameters keep their names."""

    def __iter__(self) -> Iterator[Any]:
        for block in super().__iter__():
            yield _marked(block)


def _marked(block: torch.nn.Module):
    def call(*args: Any, **kwargs: Any) -> Any:
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = block_boundary(kwargs["hidden_states"])
        out = block(*args, **kwargs)
        return block_boundary(out) if isinstance(out, torch.Tensor) else out

    return call


def why_not(model: torch.nn.Module, weights: str) -> str | None:
    """Why ``repeat_blocks`` does not apply to ``model`` (None: it does)."""
    if weights != "inputs":
        return "the weights are baked into the graph (weights='engine')"
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) < 2:
        return "the model has no list of two or more blocks"

    def layout(block: torch.nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        tensors = [*block.named_parameters(), *block.named_buffers()]
        return [(name, tuple(t.shape), t.dtype) for name, t in tensors]

    first = layout(blocks[0])
    if any(type(b) is not type(blocks[0]) or layout(b) != first for b in blocks):
        return "the blocks differ in class, parameter names, shapes or dtypes"
    return None


def first_block_only(model: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``model`` whose ``blocks`` is ``[blocks[0]]``, marked (the same modules and
    tensors: nothing is copied, the model itself is not changed)."""
    small = copy.copy(model)
    small.__dict__["_modules"] = dict(model._modules)
    small._modules["blocks"] = _MarkedBlocks([model.blocks[0]])
    return small


def repeat_blocks(
    ep: ExportedProgram, small_names: list[str], full_names: list[str], depth: int
) -> ExportedProgram | None:
    """The exported step of the ``depth``-block model from ``ep``, the export of ``first_block_only``.

    small_names / full_names: the weight FQNs of the one-block and the full model, in their
    ``weights_*`` order. None (logged) where the graph is not one marked block between a head and a
    tail."""
    gm = ep.graph_module
    graph = gm.graph
    nodes = list(graph.nodes)
    marks = [n for n in nodes if n.op == "call_function" and n.target is BOUNDARY]
    if len(marks) != 2:
        return _no(f"{len(marks)} block boundaries in the export, not 2")
    start, end = marks
    i0, i1 = nodes.index(start), nodes.index(end)
    body = nodes[i0 + 1 : i1 + 1]  # block 0's nodes in trace order; ``end`` marks its output
    inside = set(body)
    for n in body[:-1]:
        if any(u not in inside for u in n.users):
            return _no(f"block value {n.name} is used after the block")
    placeholders = {n.name: n for n in nodes if n.op == "placeholder"}
    by_name = {name: placeholders.get(f"weights_{k}") for k, name in enumerate(small_names)}
    if None in by_name.values():
        return _no("a weight placeholder is missing")
    prefix = "blocks.0."
    own = {name[len(prefix) :]: ph for name, ph in by_name.items() if name.startswith(prefix)}
    for ph in own.values():
        if any(u not in inside for u in ph.users):
            return _no(f"block 0 weight {ph.name} is read outside the block")
    expected = [n for n in full_names if not n.startswith("blocks.") or n.startswith(prefix)]
    if expected != small_names or not all(f"blocks.{i}.{k}" in full_names for i in range(depth) for k in own):
        return _no("the weights of the one-block export do not match the full model's")

    tail_users = list(end.users)
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
        source = by_name.get(name) or own[name.split(".", 2)[2]]
        ph.meta = dict(source.meta)
        if name not in by_name:  # its own value: inputs that share one would be taken as aliases
            ph.meta["val"] = _fresh(source.meta["val"])
    for name, ph in by_name.items():
        ph.replace_all_uses_with(new_ph[name])
        graph.erase_node(ph)

    previous, cursor = end, end
    for i in range(1, depth):
        env: dict[torch.fx.Node, torch.fx.Node] = {start: previous}
        env.update({new_ph[prefix + k]: new_ph[f"blocks.{i}.{k}"] for k in own})
        for n in body:
            with graph.inserting_after(cursor):
                cursor = graph.node_copy(n, lambda a, env=env: env.get(a, a))
            env[n] = cursor
        previous = env[end]
    for user in tail_users:
        user.replace_input_with(end, previous)
    for n in list(graph.nodes):
        if n.op == "call_function" and n.target is BOUNDARY:
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return _program(ep, gm, full_names)


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
