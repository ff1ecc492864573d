"""Rule ``linear``: ``aten.linear`` -> ``prx_compile::linear``, a linear that PyTorch runs (cuBLAS).

Matches: every ``aten.linear.default(x, weight, bias)``, in the engine sets built for a range of shapes
(``LoweringSettings.linears_in_torch``; ``CompileConfig.range_linears: torch``, ``weights: inputs``).
Emits: ``prx_compile::linear(x, weight, bias)`` — ``F.linear`` itself (exact), kept out of TensorRT.
Why: for dynamic shapes, TensorRT-RTX 1.4 gives the GEMMs Ampere (sm80) kernels on Hopper: 28.1 ms of
GEMMs per step at 832x1216 batch 2, against 18.0 ms with the Hopper kernels it picks for a static set
(``benchmarks/results/range_profile_h200.json``). cuBLAS picks its kernel per call, at any shape.
Static sets keep their GEMMs in TensorRT (fused with their neighbours).
The replaced nodes are left unused, for ``lower``'s dead-code pass.
Switch: ``LoweringSettings.linears_in_torch`` (off by default).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..ops import LINEAR
from ._graph import Emitter, rewrite_calls

aten = torch.ops.aten


def _emit(em: Emitter, node: fx.Node) -> fx.Node:
    x, weight, *rest = node.args
    bias = rest[0] if rest else node.kwargs.get("bias")
    return em.call(LINEAR, x, weight, bias)


def rule(gm: fx.GraphModule, settings) -> fx.GraphModule:
    """Rewrite ``aten.linear`` into ``prx_compile::linear`` (switch: ``linears_in_torch``)."""
    if getattr(settings, "linears_in_torch", False):
        rewrite_calls(gm, aten.linear.default, "linear", _emit)
    return gm
