"""Module-level fusion: PRX's attention core as one ``prx_compile::prx_attention`` op.

``PRXAttnProcessor2_0`` runs, per block: QKV projection, a reshape/permute, RMSNorm on queries and
keys, RoPE, a concatenation of text and image keys, attention, the output projection. Compiled by
TensorRT-RTX, everything between the projections becomes several fused elementwise kernels that run
far below memory bandwidth (about 8 ms of a 40 ms step on the H200,
``benchmarks/results/probe_profile_static_generic_h200.json``). ``FusedPRXAttnProcessor`` keeps the
projections (GEMMs in TensorRT or cuBLAS, reading the live weights) and hands the rest to
``prx_attention``: one Triton pass per operand, then the joint cuDNN attention.

The swap is temporary: ``fused_attention_processors(model)`` installs the fused processor for an
export and restores the original processors afterwards, so the
user's model keeps running diffusers' code.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)


class FusedPRXAttnProcessor:
    """Same inputs and result as diffusers' ``PRXAttnProcessor2_0``; the core is one op."""

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states (B, L, C) image tokens; encoder_hidden_states (B, T, C) text tokens;
        attention_mask (B, T) bool or None; image_rotary_emb (B, 1, L, D/2, 2, 2) or None -> (B, L, C)."""
        if encoder_hidden_states is None:
            raise ValueError("FusedPRXAttnProcessor requires 'encoder_hidden_states' containing text tokens.")
        if attention_mask is not None and (
            attention_mask.dim() != 2 or attention_mask.shape[-1] != encoder_hidden_states.shape[1]
        ):
            raise ValueError(f"Unsupported attention_mask shape: {tuple(attention_mask.shape)}")
        out = torch.ops.prx_compile.prx_attention(
            attn.img_qkv_proj(hidden_states),
            attn.txt_kv_proj(encoder_hidden_states),
            None if attention_mask is None else attention_mask.bool(),
            image_rotary_emb,
            attn.norm_q.weight,
            attn.norm_k.weight,
            attn.norm_added_k.weight,
            attn.heads,
            float(attn.norm_q.eps),
            1.0 / math.sqrt(attn.head_dim),
        )
        out = attn.to_out[0](out)
        if len(attn.to_out) > 1:
            out = attn.to_out[1](out)
        return out


def _fusable(attn: torch.nn.Module) -> str | None:
    """Why this attention module cannot take the fused processor (None when it can)."""
    proc = getattr(attn, "processor", None)
    if type(proc).__name__ != "PRXAttnProcessor2_0":
        return f"its processor is {type(proc).__name__}, not diffusers' PRXAttnProcessor2_0"
    norms = [getattr(attn, n, None) for n in ("norm_q", "norm_k", "norm_added_k")]
    if any(getattr(n, "weight", None) is None or getattr(n, "bias", None) is not None for n in norms):
        return "its QK norms are not RMSNorm with a weight and no bias"
    if len({float(n.eps) for n in norms}) != 1:
        return "its QK norms use different eps"
    return None


@contextlib.contextmanager
def fused_attention_processors(model: torch.nn.Module, enabled: bool = True) -> Iterator[int]:
    """Within the block, every fusable PRX attention of ``model`` runs ``FusedPRXAttnProcessor``.

    Yields how many modules were swapped; modules that do not fit (a custom processor, norms with a
    bias) keep theirs, logged at debug level. The original processors are restored on exit.
    """
    swapped: list[tuple[torch.nn.Module, object]] = []
    if enabled:
        fused = FusedPRXAttnProcessor()
        for name, mod in model.named_modules():
            if type(mod).__name__ != "PRXAttention":
                continue
            why = _fusable(mod)
            if why is not None:
                logger.debug("fused_attention: leaving %s as is: %s", name, why)
                continue
            swapped.append((mod, mod.processor))
            mod.processor = fused
        logger.debug("fused_attention: %d PRX attention modules run prx_attention", len(swapped))
    try:
        yield len(swapped)
    finally:
        for mod, proc in swapped:
            mod.processor = proc
