"""PRX's joint attention as one FlashAttention-4 call on Hopper (``attention_kernel: flash4``).

The same key-padding layout as ``cudnn_attention`` ([image keys; the kept text keys, in order;
zeros], written by the norm/RoPE kernels), run by FlashAttention-4's Hopper forward kernel
(``flash-attn-4``, the ``flash4`` extra: CuTe DSL; its import took 9.1 s and its kernel's compile at
the first call 1.3 s on the H200, both once per process, in the warm-up thread while the first engine
set builds) with ``seqused_k`` = image + kept keys per batch row: exact, one kernel. At PRX's head
dim of 64 it ran 498-540 TFLOP/s on the H200 against cuDNN's 396-407
(``benchmarks/results/step_levers_flash4_h200.json``).

Measured on Hopper only, so ``supported`` asks for compute capability 9.x; elsewhere (and where the
package does not import) ``prx_attention_flash4`` runs the cuDNN call or the split path instead.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

logger = logging.getLogger(__name__)

_UNSET = object()
_KERNEL = _UNSET


def installed() -> bool:
    """Whether FlashAttention-4's package is installed (it is not imported here)."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):  # a ``flash_attn`` without ``cute`` (FlashAttention-2)
        return False


def kernel():
    """``flash_attn.cute.flash_attn_varlen_func``, or None (not installed, no CUDA, import failed).
    Imported once per process; why it is not used is logged once."""
    global _KERNEL
    if _KERNEL is not _UNSET:
        return _KERNEL
    _KERNEL = None
    if not (torch.cuda.is_available() and installed()):
        return None
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as e:  # a broken install must not break the compiled module
        logger.warning("flash4 attention: FlashAttention-4 did not load (%s); using another kernel", e)
        return None
    _KERNEL = flash_attn_varlen_func
    return _KERNEL


def supported(q: torch.Tensor) -> bool:
    """Whether ``padded_attention`` takes ``q`` (B, L, H, D): a Hopper GPU (what was measured),
    fp16/bf16, D a multiple of 8 up to 256, and the package loaded."""
    d = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and d % 8 == 0
        and d <= 256
        and torch.cuda.get_device_capability(q.device)[0] == 9
        and kernel() is not None
    )


def padded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of each row's queries over its first ``seq[1, b]`` keys, in one kernel.

    Args:
        q: (B, Lq, H, D) contiguous. k, v: (B, S, H, D) contiguous, S >= every ``seq[1, :B]``.
        seq: (2, >= B) int32, ``seq[1, :B]`` = the keys each row attends (``seq[0]`` is not read).
        scale: the softmax scale.

    Returns:
        (B, Lq, H, D) contiguous.
    """
    b = q.shape[0]
    out = kernel()(q, k, v, seqused_k=seq[1, :b], softmax_scale=scale)
    return out[0] if isinstance(out, tuple) else out
