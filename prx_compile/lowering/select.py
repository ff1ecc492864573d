"""Rule ``select``: ``aten.select`` with a constant index -> ``slice`` + ``squeeze``.

Matches: ``aten.select.int(x, dim, index)`` with static ``index`` and static size of ``dim``
(PRX: splitting fused q/k/v, and RoPE's even/odd pairs ``x[..., 0]``, ``x[..., 1]``).
Emits: ``squeeze(slice(x, dim, i, i + 1), dim)`` — the same view. Torch-TensorRT converts ``select``
to a gather layer, which TensorRT-RTX fuses into slow gather kernels; a slice is a strided read.
Switch: ``LoweringSettings.select_as_slice``.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from ._graph import Emitter, has_fake_values, replace

logger = logging.getLogger(__name__)
aten = torch.ops.aten


def rule(gm: fx.GraphModule, settings) -> fx.GraphModule:
    """Rewrite constant-index ``select`` into ``slice`` + ``squeeze``."""
    if not getattr(settings, "select_as_slice", True):
        return gm
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != aten.select.int:
            continue
        x, dim, index = node.args
        if not has_fake_values(x) or not isinstance(index, int):
            continue
        val = x.meta["val"]
        dim = dim % val.dim()
        size = val.shape[dim]
        if not isinstance(size, int) or not -size <= index < size:
            logger.debug("select: %s left as is: dimension size is symbolic", node)
            continue
        index %= size
        em = Emitter(gm, node)
        sliced = em.call(aten.slice.Tensor, x, dim, index, index + 1)
        replace(gm, node, em.call(aten.squeeze.dim, sliced, dim))
        count += 1
    if count:
        logger.info("select: rewrote %d aten.select node(s) into slice + squeeze", count)
    return gm
