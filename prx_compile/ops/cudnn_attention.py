"""PRX's joint attention as one cuDNN call under a key-padding mask (``cudnn_attention``).

The image queries attend over [text keys under the mask; image keys]. Attention is invariant under
a permutation of its keys, so the keys and values are laid out as [image keys; the kept text keys,
in order; zeros] and cuDNN's padding mask (``seq_len_kv`` = image + kept, per batch row) drops the
rest: exact, one kernel, no bias and no merge. The layout is written by the norm/RoPE kernels
themselves (``kernels.qk_norm_rope_into``), so it costs no copy.

The call goes through cuDNN's frontend (``nvidia-cudnn-frontend``, the ``cudnn`` extra), whose
``torch.ops.cudnn.sdpa_fwd`` takes per-row sequence lengths, which PyTorch's SDPA does not. The
frontend must bind the libcudnn that torch loaded; if it is missing or binds another one,
``frontend()`` is None and ``prx_attention_cudnn`` runs the split path of ``prx_attention``.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

logger = logging.getLogger(__name__)

_UNSET = object()
_FRONTEND = _UNSET


def installed() -> bool:
    """Whether the cuDNN frontend's Python package is installed (it is not imported here)."""
    return importlib.util.find_spec("cudnn") is not None


def frontend():
    """cuDNN's frontend module bound to torch's libcudnn, or None (not installed, no CUDA, other libcudnn).

    Imported once per process; the reason it is not used is logged once.
    """
    global _FRONTEND
    if _FRONTEND is not _UNSET:
        return _FRONTEND
    _FRONTEND = None
    if not (torch.cuda.is_available() and torch.backends.cudnn.is_available() and installed()):
        return None
    try:
        torch_version = torch.backends.cudnn.version()  # loads torch's libcudnn before the frontend looks
        import cudnn
        import cudnn.sdpa.fwd.torch_op  # noqa: F401  registers torch.ops.cudnn.sdpa_fwd
    except Exception as e:  # a broken install must not break the compiled module: it runs the split path
        logger.warning("cudnn_attention: the cuDNN frontend did not load (%s); using the split path", e)
        return None
    if cudnn.backend_version() != torch_version:
        logger.warning(
            "cudnn_attention: the cuDNN frontend bound libcudnn %s, torch uses %s; using the split path",
            cudnn.backend_version(),
            torch_version,
        )
        return None
    _FRONTEND = cudnn
    return cudnn


def supported(q: torch.Tensor) -> bool:
    """Whether ``padded_attention`` takes ``q`` (B, L, H, D): CUDA, fp16/bf16, D a multiple of 8 up
    to 128, and the frontend loaded."""
    d = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and d % 8 == 0
        and d <= 128
        and (frontend() is not None)
    )


def seq_buffer(b: int, device: torch.device) -> torch.Tensor:
    """(2, B') int32 for ``seq_len_q`` / ``seq_len_kv``; B' rounds B up to 4 so that each row starts
    16-byte aligned (what the frontend takes without a copy)."""
    return torch.empty(2, -(-b // 4) * 4, dtype=torch.int32, device=device)


def padded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of each row's queries over its first ``seq[1, b]`` keys, in one cuDNN call.

    Args:
        q: (B, Lq, H, D) contiguous. k, v: (B, S, H, D) contiguous, S >= every seq_len_kv.
        seq: (2, >= B) int32, ``seq[0, :B]`` = Lq and ``seq[1, :B]`` = the keys each row attends.
        scale: the softmax scale.

    Returns:
        (B, Lq, H, D) contiguous.
    """
    b = q.shape[0]
    out, _ = torch.ops.cudnn.sdpa_fwd(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        scale,
        seq_len_q=seq[0, :b],
        seq_len_kv=seq[1, :b],
        return_lse=False,
    )
    return out.transpose(1, 2)  # O takes Q's layout: (B, Lq, H, D) in memory
