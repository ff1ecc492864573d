"""Ops: the custom operators that lowering rules emit and that stay in PyTorch, between TensorRT engines.

* ``library``: the ``torch.ops.prx_compile.*`` operators, registered when this package is imported;
* ``registry``: each of them declared once, with the role that says when it stays in PyTorch;
* ``kernels``: their Triton kernels with PyTorch twins (merge, QK norm + RoPE, FP8 quantisation);
* ``cudnn_attention``: the joint attention as one cuDNN call (cuDNN's frontend, the ``cudnn`` extra);
* ``flash4_attention``: the same as one FlashAttention-4 call on Hopper (the ``flash4`` extra);
* ``cudnn_gemm``: the MLP gate as one cuDNN GEMM with GELU * up in its epilogue (the ``cudnn`` extra);
* ``fp8_attention`` and ``fp8_attention_kernels``: FP8 joint attention (``precision: fp8``).
"""

from .library import (
    ATTENTION,
    ATTENTION_KERNELS,
    FLASH_ATTENTION,
    FLUX_ATTENTION,
    FP8_GATED_MLP,
    FP8_LINEAR,
    FP8_LINEARS,
    GELU_GATE,
    JOINT_ATTENTION,
    LINEAR,
    PRX_ATTENTION,
    PRX_ATTENTION_CUDNN,
    PRX_ATTENTION_CUDNN_FP8,
    PRX_ATTENTION_CUDNN_FP8_LINEAR,
    PRX_ATTENTION_FLASH4,
    PRX_ATTENTION_FP8,
    attention,
    flash_attention,
    flux_attention,
    fp8_gated_mlp,
    fp8_linear,
    fp8_linears,
    gelu_gate,
    joint_attention,
    linear,
    prx_attention,
    prx_attention_cudnn,
    prx_attention_cudnn_fp8,
    prx_attention_cudnn_fp8_linear,
    prx_attention_flash4,
    prx_attention_fp8,
    qk_norm_rope_torch,
)

__all__ = [
    "ATTENTION",
    "ATTENTION_KERNELS",
    "FLASH_ATTENTION",
    "FLUX_ATTENTION",
    "FP8_GATED_MLP",
    "FP8_LINEAR",
    "FP8_LINEARS",
    "GELU_GATE",
    "JOINT_ATTENTION",
    "LINEAR",
    "PRX_ATTENTION",
    "PRX_ATTENTION_CUDNN",
    "PRX_ATTENTION_CUDNN_FP8",
    "PRX_ATTENTION_CUDNN_FP8_LINEAR",
    "PRX_ATTENTION_FLASH4",
    "PRX_ATTENTION_FP8",
    "attention",
    "flash_attention",
    "flux_attention",
    "fp8_gated_mlp",
    "fp8_linear",
    "fp8_linears",
    "gelu_gate",
    "joint_attention",
    "linear",
    "prx_attention",
    "prx_attention_cudnn",
    "prx_attention_cudnn_fp8",
    "prx_attention_cudnn_fp8_linear",
    "prx_attention_flash4",
    "prx_attention_fp8",
    "qk_norm_rope_torch",
]
