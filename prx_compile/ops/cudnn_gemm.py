"""PRX's MLP gate as one cuDNN GEMM with its activation in the epilogue (``fuse_mlp_gate``).

``gelu_tanh(x @ W.T) * up`` is a matmul whose epilogue applies GELU (tanh form) to the fp32
accumulator and multiplies by ``up``, then writes bf16: the gate projection's output never goes
through device memory, and the kernel that read it and ``up`` to write their product is gone. On
the H200 at 1024² b2 (8192 x 1792 -> 6272) it ran 0.27 ms against 0.24 ms for cuBLAS's GEMM alone
(``benchmarks/results/step_levers_h200.json``) plus 0.07 ms for TensorRT's GELU * up kernel
(``peers_v14_fp8_h200.json``'s profile); the whole step ran 0.24-0.78 ms faster with it
(``peers_v15_bf16_h200.json``).

The graph goes through cuDNN's frontend (the ``cudnn`` extra, bound to torch's libcudnn as
``cudnn_attention.frontend`` checks). One graph per shape, strides and dtype is built at its first
call and kept; outside a CUDA-graph capture its fastest plan among the heuristics' first few is
picked by timing each on that call's own tensors (a capture takes the heuristics' first).
"""

from __future__ import annotations

import threading

import torch

from . import cudnn_attention

#: Plans timed at a graph's first call (the heuristics' order); each is built and run 3 times.
CANDIDATES = 6

_plans: dict[tuple, tuple] = {}
_lock = threading.Lock()
_local = threading.local()


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gelu_gate`` takes these: CUDA, both bf16/fp16 of one dtype, and the frontend loaded."""
    return (
        x.is_cuda
        and x.dtype in (torch.float16, torch.bfloat16)
        and weight.dtype == x.dtype
        and cudnn_attention.frontend() is not None
    )


def _handle(cudnn, device: torch.device):
    """This thread's cuDNN handle for ``device``, bound to the current stream."""
    handles = getattr(_local, "handles", None)
    if handles is None:
        handles = _local.handles = {}
    if device not in handles:
        with torch.cuda.device(device):
            handles[device] = cudnn.create_handle()
    cudnn.set_stream(handle=handles[device], stream=torch.cuda.current_stream(device).cuda_stream)
    return handles[device]


def _graph(cudnn, handle, x, w, up, **options):
    """The matmul-with-epilogue graph for (1, M, K) x (1, K, N) views, with its plans created
    (``options``: further ``cudnn.pygraph`` arguments, e.g. a probe's kernel cache)."""
    io = cudnn.data_type.BFLOAT16 if x.dtype == torch.bfloat16 else cudnn.data_type.HALF
    f32 = cudnn.data_type.FLOAT
    g = cudnn.pygraph(
        handle=handle, io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, **options
    )
    tx = g.tensor(name="x", dim=list(x.shape), stride=list(x.stride()), data_type=io)
    tw = g.tensor(name="w", dim=list(w.shape), stride=list(w.stride()), data_type=io)
    tu = g.tensor(name="up", dim=list(up.shape), stride=list(up.stride()), data_type=io)
    gate = g.matmul(name="gate", A=tx, B=tw, compute_data_type=f32)
    out = g.mul(a=g.gelu_approx_tanh(input=gate, compute_data_type=f32), b=tu, compute_data_type=f32)
    out.set_output(True).set_data_type(io)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    return g, tuple(t.get_uid() for t in (tx, tw, tu, out))


def _fastest(g, handle, buffers, uids, device) -> tuple[int, int]:
    """(plan index, workspace bytes) of the fastest of the first ``CANDIDATES`` plans that build."""
    best, best_ms = None, float("inf")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(min(CANDIDATES, g.get_execution_plan_count())):
        try:
            g.build_plan_at_index(i)
            ws = torch.empty(max(1, g.get_workspace_size_plan_at_index(i)), dtype=torch.uint8, device=device)
            g.execute_plan_at_index(buffers, ws, index=i, handle=handle, tensor_uids=uids)
            start.record()
            for _ in range(3):
                g.execute_plan_at_index(buffers, ws, index=i, handle=handle, tensor_uids=uids)
            end.record()
            end.synchronize()
        except Exception:  # a plan that does not build or run here is skipped
            continue
        if start.elapsed_time(end) < best_ms:
            best, best_ms = i, start.elapsed_time(end)
    if best is None:
        raise RuntimeError("cuDNN built no plan for the GEMM with a GELU-gate epilogue")
    g.build_plan_at_index(best)  # selected again after the others were built
    return best, g.get_workspace_size_plan_at_index(best)


def gelu_gate(x: torch.Tensor, weight: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x @ weight.T) * up`` in one cuDNN call.

    Args:
        x: (M, K), weight: (N, K), up: (M, N); one dtype (bf16/fp16), on one CUDA device.

    Returns:
        (M, N) contiguous, in ``x``'s dtype.
    """
    cudnn = cudnn_attention.frontend()
    m, n = up.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    xv, wv, uv, ov = x.unsqueeze(0), weight.t().unsqueeze(0), up.unsqueeze(0), out.unsqueeze(0)
    handle = _handle(cudnn, x.device)
    key = (x.device, x.dtype, tuple(xv.shape), xv.stride(), tuple(wv.shape), wv.stride(), uv.stride())
    entry = _plans.get(key)
    if entry is None:
        with _lock:
            entry = _plans.get(key)
            if entry is None:
                g, uids = _graph(cudnn, handle, xv, wv, uv)
                if torch.cuda.is_current_stream_capturing():  # no timing (no sync) inside a capture
                    g.build_plan_at_index(0)
                    entry = (g, uids, 0, g.get_workspace_size_plan_at_index(0))
                else:
                    entry = (g, uids, *_fastest(g, handle, [xv, wv, uv, ov], uids, x.device))
                _plans[key] = entry
    g, uids, index, ws_bytes = entry
    ws = torch.empty(max(1, ws_bytes), dtype=torch.uint8, device=x.device)
    g.execute_plan_at_index([xv, wv, uv, ov], ws, index=index, handle=handle, tensor_uids=uids)
    return out
