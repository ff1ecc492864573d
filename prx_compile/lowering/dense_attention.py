"""Rule ``dense_attention``: ``prx_compile::attention`` and ``flux_attention`` run on the kernel the
plan chose.

Matches: every ``prx_compile::attention`` or ``prx_compile::flux_attention`` call (a model's fused
attention emits one per block with the kernel "sdpa"; the kernel is the last argument of both).
Emits: the same call with its ``kernel`` argument set to ``LoweringSettings.dense_attention``
("sdpa", "cudnn" or "flash4"). Exact: the kernels compute the same attention, up to rounding.
Switch: ``LoweringSettings.dense_attention`` (``CompileConfig.attention_kernel``, resolved by the plan).
"""

from __future__ import annotations

import logging

import torch.fx as fx

from ..ops import ATTENTION, FLUX_ATTENTION

logger = logging.getLogger(__name__)


def rule(gm: fx.GraphModule, settings) -> fx.GraphModule:
    """Set the kernel argument of each ``attention`` / ``flux_attention`` node to
    ``settings.dense_attention``."""
    kernel = getattr(settings, "dense_attention", "sdpa")
    count = 0
    for node in gm.graph.nodes:
        dense = node.op == "call_function" and node.target in (ATTENTION, FLUX_ATTENTION)
        if dense and node.args[-1] != kernel:
            node.args = (*node.args[:-1], kernel)
            count += 1
    if count:
        logger.info("dense_attention: %d attention node(s) run %s", count, kernel)
    return gm
