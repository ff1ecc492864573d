"""Rule ``select``: ``aten.select`` with a constant index -> ``slice`` + ``squeeze``.

Matches: ``aten.select.int(x, dim, index)`` with static ``index`` and static size of ``dim``
(PRX: splitting fused q/k/v, and RoPE's even/odd pairs ``x[..., 0]``, ``x[..., 1]``).
Emits: ``squeeze(slice(x, dim, i, i + 1), dim)`` — the same view. Torch-TensorRT converts ``select``
to a gather layer, which TensorRT-RTX fuses into slow gather kernels; a slice is a strided read.
Switch: ``LoweringSettings.select_as_slice``.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ._graph import Emitter, rewrite_calls

aten = torch.ops.aten


def _emit(em: Emitter, node: fx.Node) -> fx.Node | str:
    x, dim, index = node.args
    val = x.meta["val"]
    dim %= val.dim()
    size = val.shape[dim]
    if not isinstance(index, int) or not isinstance(size, int) or not -size <= index < size:
        return "index or dimension size is not a constant"
    index %= size
    return em.call(aten.squeeze.dim, em.call(aten.slice.Tensor, x, dim, index, index + 1), dim)


def rule(gm: fx.GraphModule, settings) -> fx.GraphModule:
    """Rewrite constant-index ``select`` into ``slice`` + ``squeeze`` (switch: ``select_as_slice``)."""
    if getattr(settings, "select_as_slice", True):
        rewrite_calls(gm, aten.select.int, "select", _emit)
    return gm
