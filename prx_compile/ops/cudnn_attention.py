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
import threading
from collections import OrderedDict

import torch

from .kernels import AMAX_O, DESCALE_K, DESCALE_Q, DESCALE_S, DESCALE_V, SCALE_O, SCALE_S

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


# -- FP8: cuDNN's FP8 SDPA (``sdpa_fp8``) over e4m3 Q, K, V with per-tensor scales -----------------
#: cuDNN graphs by shape, the least recently used dropped past ``_FP8_GRAPHS_KEPT`` (a range set
#: meets a shape per distinct prompt length and resolution; its CUDA graphs keep what they captured)
_FP8_GRAPHS: OrderedDict = OrderedDict()
_FP8_GRAPHS_KEPT = 64
_HANDLES: dict = {}
_LOCK = threading.Lock()


def fp8_supported(q: torch.Tensor) -> bool:
    """Whether ``padded_attention_fp8`` may run on ``q``'s device: a Hopper GPU (sm90; its FP8 SDPA
    writes e4m3 only), head dim a multiple of 16 up to 128, the frontend loaded."""
    d = q.shape[-1]
    return (
        q.is_cuda
        and torch.cuda.get_device_capability(q.device)[0] == 9
        and d % 16 == 0
        and d <= 128
        and frontend() is not None
    )


def _fp8_graph(cudnn, b: int, lq: int, lk: int, h: int, d: int, scale: float, device: torch.device):
    """(graph, its tensors by name, workspace bytes, cuDNN handle) of ``sdpa_fp8`` at one shape, built
    once per process and device (as cudnn-frontend's test/python/sdpa/fp8.py builds it): e4m3 Q, K, V,
    O as (B, H, S, D) views of (B, S, H, D) buffers, per-tensor scales, a key-padding mask by per-row
    lengths."""
    key = (b, lq, lk, h, d, scale, device.index)
    with _LOCK:
        if key in _FP8_GRAPHS:
            _FP8_GRAPHS.move_to_end(key)
            return _FP8_GRAPHS[key]
        if device.index not in _HANDLES:
            with torch.cuda.device(device):
                _HANDLES[device.index] = cudnn.create_handle()
        handle = _HANDLES[device.index]
        dt = cudnn.data_type
        g = cudnn.pygraph(
            io_data_type=dt.FP8_E4M3,
            intermediate_data_type=dt.FLOAT,
            compute_data_type=dt.FLOAT,
            handle=handle,
        )

        def bshd(name, s):
            return g.tensor(
                name=name, dim=[b, h, s, d], stride=[s * h * d, d, h * d, 1], data_type=dt.FP8_E4M3
            )

        def scalar(name):
            return g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.FLOAT)

        def lengths(name):
            return g.tensor(name=name, dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.INT32)

        t = {"q": bshd("q", lq), "k": bshd("k", lk), "v": bshd("v", lk), "seq_q": lengths("seq_q")}
        t["seq_kv"] = lengths("seq_kv")
        names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        t.update({n: scalar(n) for n in names})
        o, _, _, amax_o = g.sdpa_fp8(
            q=t["q"], k=t["k"], v=t["v"], **{n: t[n] for n in names}, attn_scale=scale,
            generate_stats=False, use_padding_mask=True, seq_len_q=t["seq_q"], seq_len_kv=t["seq_kv"],
            name="sdpa_fp8",
        )  # fmt: skip
        o.set_output(True).set_dim([b, h, lq, d]).set_stride([lq * h * d, d, h * d, 1])
        o.set_data_type(dt.FP8_E4M3)
        amax_o.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(dt.FLOAT)
        t["o"], t["amax_o"] = o, amax_o
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        _FP8_GRAPHS[key] = (g, t, max(g.get_workspace_size(), 1), handle)
        while len(_FP8_GRAPHS) > _FP8_GRAPHS_KEPT:
            _FP8_GRAPHS.popitem(last=False)
        return _FP8_GRAPHS[key]


def padded_attention_fp8(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: torch.Tensor, scale: float, scalars: torch.Tensor
) -> torch.Tensor:
    """``padded_attention`` on e4m3 inputs, as one cuDNN FP8 SDPA call.

    Args:
        q: (B, Lq, H, D) float8_e4m3fn contiguous. k, v: (B, S, H, D) float8_e4m3fn contiguous.
        seq: as ``padded_attention``. scale: the softmax scale.
        scalars: (``kernels.FP8_SCALARS``, 4) fp32 contiguous, as ``kernels.fp8_attention_scales``
            writes it; rows DESCALE_Q..SCALE_O (column 0) are read, AMAX_O written.

    Returns:
        (B, Lq, H, D) float8_e4m3fn: the attention times ``scalars[SCALE_O, 0]``.
    """
    cudnn = frontend()
    b, lq, h, d = q.shape
    g, t, ws_bytes, handle = _fp8_graph(cudnn, b, lq, k.shape[1], h, d, float(scale), q.device)
    out = torch.empty_like(q)
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=q.device)
    rows = {"descale_q": DESCALE_Q, "descale_k": DESCALE_K, "descale_v": DESCALE_V}
    rows.update({"descale_s": DESCALE_S, "scale_s": SCALE_S, "scale_o": SCALE_O, "amax_o": AMAX_O})
    pack = {t[n]: scalars[r].data_ptr() for n, r in rows.items()}
    pack.update({t["q"]: q.data_ptr(), t["k"]: k.data_ptr(), t["v"]: v.data_ptr(), t["o"]: out.data_ptr()})
    pack.update({t["seq_q"]: seq[0].data_ptr(), t["seq_kv"]: seq[1].data_ptr()})
    with _LOCK:  # the handle is the device's: its stream is set and used by one thread at a time
        cudnn.set_stream(handle, torch.cuda.current_stream(q.device).cuda_stream)
        g.execute(pack, ws, handle=handle)
    return out
