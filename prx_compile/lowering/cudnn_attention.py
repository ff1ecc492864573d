"""Rule ``cudnn_attention``: ``prx_compile::prx_attention`` -> ``prx_compile::prx_attention_cudnn``.

Matches: every ``prx_attention`` call left after ``fp8_attention`` (``attention: fused`` exports one
per PRX block).
Emits: ``prx_attention_cudnn`` with the same arguments: the same norms and RoPE, written straight
into a key-padding layout, then the joint attention as one cuDNN call (``ops.cudnn_attention``).
Exact: attention does not depend on the order of its keys, and the padding mask drops exactly the
keys the text mask drops. Where cuDNN's frontend cannot run, the op runs ``prx_attention``'s path.
Switch: ``LoweringSettings.cudnn_attention`` (``CompileConfig.attention_kernel``).
"""

from __future__ import annotations

import torch.fx as fx

from ..ops import PRX_ATTENTION, PRX_ATTENTION_CUDNN
from ._graph import retarget


def rule(gm: fx.GraphModule, settings) -> fx.GraphModule:
    """Retarget each ``prx_attention`` node to ``prx_attention_cudnn`` (switch: ``cudnn_attention``)."""
    if getattr(settings, "cudnn_attention", False):
        retarget(gm, PRX_ATTENTION, PRX_ATTENTION_CUDNN, "cudnn_attention")
    return gm
