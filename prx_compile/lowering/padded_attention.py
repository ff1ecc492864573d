"""Rule ``padded_attention``: ``prx_compile::prx_attention`` -> its one-call form, on FlashAttention-4
(``prx_attention_flash4``) or cuDNN (``prx_attention_cudnn``).

Matches: every ``prx_attention`` call left after ``fp8_attention`` (``attention: fused`` exports one
per PRX block).
Emits: the op of ``LoweringSettings.padded_attention`` ("flash4" or "cudnn") with the same
arguments: the same norms and RoPE, written straight into a key-padding layout, then the joint
attention as one kernel call (``ops.flash4_attention`` / ``ops.cudnn_attention``).
Exact: attention does not depend on the order of its keys, and the padding drops exactly the keys
the text mask drops. Where the kernel cannot run, the op runs the next one (FlashAttention-4, then
cuDNN, then ``prx_attention``'s split path).
Switch: ``LoweringSettings.padded_attention`` (``CompileConfig.attention_kernel``).
"""

from __future__ import annotations

import torch.fx as fx

from ..ops import PRX_ATTENTION, PRX_ATTENTION_CUDNN, PRX_ATTENTION_FLASH4
from ._graph import retarget

TARGETS = {"flash4": PRX_ATTENTION_FLASH4, "cudnn": PRX_ATTENTION_CUDNN}


def rule(gm: fx.GraphModule, settings) -> fx.GraphModule:
    """Retarget each ``prx_attention`` node to the op of ``settings.padded_attention`` (None: off)."""
    kind = getattr(settings, "padded_attention", None)
    if kind is not None:
        retarget(gm, PRX_ATTENTION, TARGETS[kind], "padded_attention")
    return gm
