"""Rule ``padded_attention``: ``prx_compile::prx_attention`` -> its one-call form, on FlashAttention-4
(``prx_attention_flash4``), cuDNN (``prx_attention_cudnn``) or, with ``precision: fp8``, cuDNN's FP8
SDPA (``prx_attention_cudnn_fp8``).

Matches: every ``prx_attention`` call left after ``fp8_attention`` (``attention: fused`` exports one
per PRX block).
Emits: the op of ``LoweringSettings.padded_attention`` ("flash4", "cudnn", "cudnn_fp8") with the same
arguments: the same norms and RoPE, written straight into a key-padding layout, then the joint
attention as one kernel call (``ops.flash4_attention`` / ``ops.cudnn_attention``).
Exact: attention does not depend on the order of its keys, and the padding drops exactly the keys
the text mask drops ("cudnn_fp8" is exact in that, and rounds Q, K, V, P and O through e4m3).
Where the kernel cannot run, the op runs the next one (FlashAttention-4, then cuDNN, then
``prx_attention``'s split path; "cudnn_fp8": its quantisation in PyTorch ops).
With "cudnn_fp8", an ``fp8_linear`` whose input is such an attention, used only there (PRX's output
projection under ``precision: fp8``), and the attention become one
``prx_attention_cudnn_fp8_linear``: the attention's e4m3 output feeds the FP8 GEMM as it is.
Switch: ``LoweringSettings.padded_attention`` (``CompileConfig.attention_kernel``).
"""

from __future__ import annotations

import logging

import torch.fx as fx

from ..ops import (
    FP8_LINEAR,
    PRX_ATTENTION,
    PRX_ATTENTION_CUDNN,
    PRX_ATTENTION_CUDNN_FP8,
    PRX_ATTENTION_CUDNN_FP8_LINEAR,
    PRX_ATTENTION_FLASH4,
)
from ._graph import retarget

logger = logging.getLogger(__name__)

TARGETS = {"flash4": PRX_ATTENTION_FLASH4, "cudnn": PRX_ATTENTION_CUDNN, "cudnn_fp8": PRX_ATTENTION_CUDNN_FP8}


def _with_projection(gm: fx.GraphModule) -> int:
    """Fold each ``fp8_linear(prx_attention_cudnn_fp8(...), W, S, bias)`` whose attention has no other
    user into one ``prx_attention_cudnn_fp8_linear`` node (the linear's node, so its users and
    metadata stay). Needs no shapes: it runs on partitioned modules too."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != FP8_LINEAR:
            continue
        x, weight, weight_scale, *rest = node.args
        bias = rest[0] if rest else node.kwargs.get("bias")
        if not (
            isinstance(x, fx.Node)
            and x.op == "call_function"
            and x.target == PRX_ATTENTION_CUDNN_FP8
            and list(x.users) == [node]
            and not x.kwargs
            and len(x.args) == 10
        ):
            continue
        node.target = PRX_ATTENTION_CUDNN_FP8_LINEAR
        node.args, node.kwargs = (*x.args, weight, weight_scale, bias), {}
        gm.graph.erase_node(x)
        count += 1
    if count:
        logger.info("padded_attention: folded %d FP8 output projection(s) into the attention", count)
    return count


def rule(gm: fx.GraphModule, settings) -> fx.GraphModule:
    """Retarget each ``prx_attention`` node to the op of ``settings.padded_attention`` (None: off);
    with "cudnn_fp8", fold the FP8 output projections that follow."""
    kind = getattr(settings, "padded_attention", None)
    if kind is not None:
        retarget(gm, PRX_ATTENTION, TARGETS[kind], "padded_attention")
    if kind == "cudnn_fp8":
        _with_projection(gm)
    return gm
