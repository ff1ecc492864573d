"""GPU tests: need CUDA and Torch-TensorRT; run on the device with the kit (see README)."""

import pytest
import torch


def _trt_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import torch_tensorrt  # noqa: F401
    except Exception:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    if _trt_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA and Torch-TensorRT")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def fused_op(report: dict) -> str:
    """The op ``attention: fused`` runs for the kernel a compiled module's first set measured and chose
    (``report()["kernels"]["attention"]``): the one-call FlashAttention-4 or cuDNN attention, the split
    ``prx_attention`` or the FP8 one."""
    kind = report["kernels"]["attention"]
    suffix = {"flash4": "_flash4", "cudnn": "_cudnn", "split": ""}.get(kind, "_fp8")
    return f"prx_compile.prx_attention{suffix}.default"


#: Small enough to build in seconds, wide enough for real attention kernels (head dim 64).
SMALL_PRX = dict(
    in_channels=16,
    patch_size=2,
    context_in_dim=256,
    hidden_size=512,
    mlp_ratio=3.5,
    num_heads=8,
    depth=2,
    axes_dim=[32, 32],
)
#: The static sets keep their GEMMs in TensorRT here (the engine counts below assume it);
#: ``test_static_linears.py`` covers the default, ``static_linears: torch``. A shape only the range
#: takes builds the range set (``auto_specialize: 0``): the tests below mean that set.
RANGE = dict(
    batch=[1, 2],
    resolution=512,
    aspect_bins=[],
    text_len=[8, 64],
    static_linears="tensorrt",
    auto_specialize=0,
)
