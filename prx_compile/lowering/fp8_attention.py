"""Rule ``fp8_attention``: ``prx_compile::prx_attention`` -> ``prx_compile::prx_attention_fp8``.

Matches: every ``prx_attention`` call (``attention: fused`` exports one per PRX block).
Emits: ``prx_attention_fp8`` with the same arguments: the same norms and RoPE, then the joint
attention with Q, K, V and the probabilities in e4m3 (one scale per 128 tokens and head, computed
on the device), on FP8 tensor cores (``ops.fp8_attention``).
Not exact, by request: ``precision: fp8`` asks for FP8 arithmetic; the error it adds is measured in
``benchmarks/results/`` (README, Performance). Rows with padded text keys stay exact in the sense
that those keys contribute nothing.
Switch: ``LoweringSettings.fp8_attention`` (``CompileConfig.fp8_attention`` with ``precision: fp8``);
``LoweringSettings.fp8_tile`` is the kernels' tiling the engine set's measurement chose (an index into
``ops.fp8_attention.TILES``, the op's last argument).
"""

from __future__ import annotations

import torch.fx as fx

from ..ops import PRX_ATTENTION, PRX_ATTENTION_FP8
from ._graph import retarget


def rule(gm: fx.GraphModule, settings) -> fx.GraphModule:
    """Retarget each ``prx_attention`` node to ``prx_attention_fp8`` (switch: ``fp8_attention``) on
    the tiling ``fp8_tile``."""
    if not getattr(settings, "fp8_attention", False):
        return gm
    retarget(gm, PRX_ATTENTION, PRX_ATTENTION_FP8, "fp8_attention")
    tile = getattr(settings, "fp8_tile", 0)
    if tile:
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target == PRX_ATTENTION_FP8:
                node.args = (*node.args[:10], tile)
        gm.recompile()
    return gm
