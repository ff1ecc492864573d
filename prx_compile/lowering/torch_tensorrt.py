"""Register ``lower`` as a Torch-TensorRT lowering pass, so MTTM and ``torch_tensorrt.dynamo.compile``
apply the same rules (also when they re-lower for a refit).

The pass runs before Torch-TensorRT's decompositions (its *pre*-lowering list): SDPA, im2col and
col2im are still whole there, and the ``attn_bias_is_causal`` rewrite never sees masked attention.
The rules' settings travel inside Torch-TensorRT's own settings, so a refit re-lowers exactly as the
build did: ``LoweringSettings.marker()`` is a string in ``torch_executed_ops`` (it matches no op).
Without a marker: ``attention="flash"`` when a prx_compile attention op is in ``torch_executed_ops``,
``"tensorrt"`` otherwise. Nothing is registered at import: call ``register_passes()`` or use
``with lowering_passes(): ...``. torch_tensorrt is imported lazily.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.fx as fx

from ..ops import FLASH_ATTENTION, JOINT_ATTENTION, PRX_ATTENTION
from . import LoweringSettings, lower

logger = logging.getLogger(__name__)

ATTENTION_OPS = (
    FLASH_ATTENTION,
    JOINT_ATTENTION,
    PRX_ATTENTION,
    "torch.ops.prx_compile.flash_attention.default",
    "torch.ops.prx_compile.joint_attention.default",
    "torch.ops.prx_compile.prx_attention.default",
)


def torch_executed_ops(settings: LoweringSettings) -> set:
    """What to put in Torch-TensorRT's ``torch_executed_ops`` for these lowering settings."""
    ops = {settings.marker()}
    if settings.attention == "flash":
        ops |= {FLASH_ATTENTION, JOINT_ATTENTION, PRX_ATTENTION}
    return ops


def settings_from_torch_tensorrt(settings) -> LoweringSettings:
    """LoweringSettings carried by (or implied by) a Torch-TensorRT ``CompilationSettings``."""
    ops = getattr(settings, "torch_executed_ops", ()) or ()
    for op in ops:
        if isinstance(op, str) and op.startswith("prx_compile.lowering("):
            return LoweringSettings.from_marker(op)
    return LoweringSettings(attention="flash" if any(op in ops for op in ATTENTION_OPS) else "tensorrt")


def prx_compile_lowering(gm: fx.GraphModule, settings) -> fx.GraphModule:
    """Torch-TensorRT pre-lowering pass: ``lower(gm)`` in place with the settings' attention form."""
    lower(gm, settings_from_torch_tensorrt(settings))
    return gm


def _pass_lists():
    from torch_tensorrt.dynamo.lowering.passes._aten_lowering_pass import (
        ATEN_POST_LOWERING_PASSES,
        ATEN_PRE_LOWERING_PASSES,
    )

    return ATEN_PRE_LOWERING_PASSES.passes, ATEN_POST_LOWERING_PASSES.passes


def passes_registered() -> bool:
    """True when the prx_compile passes are in Torch-TensorRT's lists."""
    return prx_compile_lowering in _pass_lists()[0]


def register_passes() -> None:
    """Put ``prx_compile_lowering`` first among Torch-TensorRT's pre-lowering passes and
    ``localize_shape_ints`` last among its post-lowering passes (idempotent)."""
    pre, post = _pass_lists()
    if prx_compile_lowering not in pre:
        pre.insert(0, prx_compile_lowering)
    if localize_shape_ints not in post:
        post.append(localize_shape_ints)


def unregister_passes() -> None:
    """Remove the prx_compile passes from Torch-TensorRT (no-op when absent)."""
    pre, post = _pass_lists()
    for passes, fn in ((pre, prx_compile_lowering), (post, localize_shape_ints)):
        while fn in passes:
            passes.remove(fn)


@contextlib.contextmanager
def lowering_passes() -> Iterator[None]:
    """Within the block, Torch-TensorRT compiles and refits apply prx_compile's rules."""
    was = passes_registered()
    register_passes()
    try:
        yield
    finally:
        if not was:
            unregister_passes()


def localize_shape_ints(gm: fx.GraphModule, settings) -> fx.GraphModule:
    """Torch-TensorRT post-lowering pass: recompute symbolic sizes next to each consumer.

    With dynamic shapes, a ``sym_size`` computed once at the top of the graph reaches later engines
    as a Python int input, which the runtime copies host-to-device on every call — and which CUDA
    graph capture forbids. Giving every consumer its own ``sym_size``/arithmetic chain (reading the
    graph's input tensors) keeps those sizes inside each engine. Values are unchanged.
    """

    def is_shape_int(n) -> bool:
        return (
            isinstance(n, fx.Node) and n.op == "call_function" and isinstance(n.meta.get("val"), torch.SymInt)
        )

    def clone_chain(n: fx.Node, before: fx.Node) -> fx.Node:
        args = tuple(clone_chain(a, before) if is_shape_int(a) else a for a in n.args)
        with gm.graph.inserting_before(before):
            c = gm.graph.call_function(n.target, args, dict(n.kwargs))
        c.meta.update(n.meta)
        return c

    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or is_shape_int(node):
            continue
        for arg in node.all_input_nodes:
            if is_shape_int(arg):
                local = clone_chain(arg, node)
                node.replace_input_with(arg, local)
                count += 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    logger.debug("localize_shape_ints: %d size inputs recomputed next to their consumer", count)
    return gm
