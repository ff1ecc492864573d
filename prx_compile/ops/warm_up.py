"""Set up, once per process, what the step's PyTorch ops need before their first real call.

A process's first step paid 3.9 s on the H200 (``first_call_v08_h200.json``: Triton compiling our
kernels, cuDNN's and cuBLAS's set-up) after its engines were built; later sets' first steps took
0.2-0.7 s. ``in_background`` runs the attention op and a GEMM once in a thread, on a stream of its
own, while the engines build, so that the first real step finds them ready. It runs them at the
set's own shapes: Triton specialises a kernel on its integer arguments (one equal to 1, multiples
of 16) and cuDNN makes a plan per shape, so warming on tiny inputs (0.8) still left 1.4-1.5 s to
the first step. It computes nothing the step uses, and a failure here only costs that time again
at the first step (logged, not raised).
"""

from __future__ import annotations

import logging
import threading
import time

import torch
import torch.nn.functional as F

from .library import _prx_attention, attention

logger = logging.getLogger(__name__)


def warm_up(
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    fp8: bool = False,
    shape: tuple[int, int, int] = (1, 64, 16),
    padded: str | None = None,
    gate_width: int | None = None,
    dense: str | None = None,
) -> None:
    """The step's attention with ``heads`` heads of ``head_dim``, in ``dtype`` on ``device``, for
    ``shape`` = (batch, image tokens, text tokens): with ``dense`` (a kernel name) the dense
    ``attention`` op over all tokens, else ``prx_attention`` (with ``fp8`` its FP8 variant, with
    ``padded`` its one-call form on that kernel, "flash4" or "cudnn": FlashAttention-4 compiles its
    kernel at its first call); then a (batch * image tokens, H*D) x (H*D, H*D) GEMM, and with
    ``gate_width`` the MLP gate's fused GEMM (``gelu_gate``: its cuDNN plan is built and picked)."""
    g = torch.Generator(device=device).manual_seed(0)
    width = heads * head_dim
    b, seq, t = shape

    def rand(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dt)

    if dense is not None:
        q = rand(b, seq + t, heads, head_dim)
        out = attention(q, q, q, head_dim**-0.5, dense).reshape(b, seq + t, width)[:, :seq]
    else:
        img_qkv, txt_kv = rand(b, seq, 3 * width), rand(b, t, 2 * width)
        mask = torch.ones(b, t, dtype=torch.bool, device=device)
        rope = rand(b, 1, seq, head_dim // 2, 2, 2, dt=torch.float32)
        w = torch.ones(head_dim, dtype=dtype, device=device)
        out = _prx_attention(img_qkv, txt_kv, mask, rope, w, w, w, heads, 1e-6, head_dim**-0.5, fp8, padded)
    F.linear(out, rand(width, width))
    if gate_width:
        torch.ops.prx_compile.gelu_gate(out, rand(gate_width, width), rand(b, seq, gate_width))


def in_background(
    model: torch.nn.Module, spec, example: dict[str, torch.Tensor], lowering
) -> threading.Thread | None:
    """A started thread that warms up the ops a step of ``model`` (its ``spec``: a ``ModelSpec``) runs
    under ``lowering`` (``LoweringSettings``) at the shape of ``example``, or None where there is
    nothing to warm (no CUDA). ``join()`` it before the first step; its ``seconds`` attribute then
    holds how long it took."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        return None
    heads, head_dim = spec.attention_dims(model)
    shape = spec.step_tokens(model, example)
    gate = spec.gate_width(model) if lowering.gelu_gate else None
    dense = lowering.dense_attention if spec.attention == "dense" else None
    device, dtype = param.device, param.dtype

    def run() -> None:
        t0 = time.perf_counter()
        try:
            with torch.cuda.device(device), torch.no_grad():
                stream = torch.cuda.Stream(device)
                with torch.cuda.stream(stream):
                    warm_up(
                        heads,
                        head_dim,
                        dtype,
                        device,
                        lowering.fp8_attention,
                        shape,
                        lowering.padded_attention,
                        gate,
                        dense,
                    )
                stream.synchronize()
        except Exception as e:  # the first real step then pays for it, as before
            logger.info("warm-up of the step's ops failed (the first step will set them up): %s", e)
        thread.seconds = time.perf_counter() - t0

    thread = threading.Thread(target=run, name="prx-warm-up", daemon=True)
    thread.seconds = None
    thread.start()
    return thread
