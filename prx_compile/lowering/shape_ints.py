"""Rule ``shape_ints``: recompute every symbolic size next to the node that consumes it.

Matches: nodes that take a symbolic integer (``sym_size`` and arithmetic on it, as dynamic-shape
exports and Torch-TensorRT's decompositions produce) computed elsewhere in the graph.
Emits: a private copy of the ``sym_size``/arithmetic chain right before each consumer, reading the
graph's own tensors. Values are unchanged.

Why: with dynamic shapes, a size computed once at the top of the graph reaches later TensorRT engines
as a Python int input, which the runtime copies host-to-device on every call, and which CUDA graph
capture forbids. With every consumer computing its own sizes, the partitioner keeps them inside each
engine. This rule is in ``ENGINE_RULES``: it runs after Torch-TensorRT's decompositions, which would
merge the chains again.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

logger = logging.getLogger(__name__)


def _is_shape_int(n) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and isinstance(n.meta.get("val"), torch.SymInt)


def rule(gm: fx.GraphModule, settings=None) -> fx.GraphModule:
    """Give every consumer of a symbolic size its own ``sym_size`` chain (graph rewritten in place)."""

    def clone_chain(n: fx.Node, before: fx.Node) -> fx.Node:
        args = tuple(clone_chain(a, before) if _is_shape_int(a) else a for a in n.args)
        with gm.graph.inserting_before(before):
            c = gm.graph.call_function(n.target, args, dict(n.kwargs))
        c.meta.update(n.meta)
        return c

    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or _is_shape_int(node):
            continue
        for arg in node.all_input_nodes:
            if _is_shape_int(arg):
                node.replace_input_with(arg, clone_chain(arg, node))
                count += 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    if count:
        logger.info("shape_ints: %d size input(s) recomputed next to their consumer", count)
    return gm
