"""The floor of a step: its GEMMs and attention alone, back to back as a step runs them. Writes
OUT.json (GPU):

    python benchmarks/probes/step_floor.py OUT.json

The issues' goals were set beside sums of kernels timed one by one (issue 42: the 7B's GEMMs 3.11 ms
per block, attention 0.65 ms, so 120 ms a step; issue 41: FLUX.1's GEMMs + attention about 105 ms in
bf16, 73 ms with FP8 GEMMs). A step runs them back to back at the GPU's power cap, where the clock
falls (``pixel_timeline_v22_h200.json``). Here each model's block GEMMs (cuBLAS, bf16; or
``torch._scaled_mm`` on e4m3 inputs with row-wise scales and fast accumulation, as ``fp8_linear``
runs them, quantised beforehand: no quantisation counted) and its attention (FlashAttention-4 where
installed, else PyTorch's SDPA) run for every block of a step in one CUDA graph, replayed back to
back: GEMMs alone, attention alone, both. No
norm, RoPE, modulation, residual, activation or layout copy is run: what a compiled step adds to
these is what it could still lose.

Models (random inputs and weights; one block's weights serve every block of its kind):
  pixel   the 7B PRXPixel shape at 1024² b2: 32 blocks, hidden 3072, 24 heads of 128, MLP 10752 (gate,
          up, down), 8192 image tokens and 256 text tokens (keys 8448; text K/V from the text)
  flux    FLUX.1-dev at 1024² b1, 512 text tokens: 19 double blocks (image and text streams: QKV,
          out, MLP 12288 each; joint attention over 4608) and 38 single blocks (QKV and MLP-in from
          one input, attention over 4608, out from 3072 + 12288)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

#: model -> (block kinds: (count, GEMMs (M, K, N), attention (B, Lq, S, H, D)))
MODELS = {
    "pixel": [
        (
            32,
            [(8192, 3072, 9216), (512, 3072, 6144), (8192, 3072, 3072)]  # QKV, text K/V, out
            + [(8192, 3072, 10752)] * 2  # gate, up
            + [(8192, 10752, 3072)],  # down
            (2, 4096, 4352, 24, 128),
        )
    ],
    "flux": [
        (
            19,
            [(4096, 3072, 9216), (512, 3072, 9216), (4096, 3072, 3072), (512, 3072, 3072)]
            + [(4096, 3072, 12288), (4096, 12288, 3072), (512, 3072, 12288), (512, 12288, 3072)],
            (1, 4608, 4608, 24, 128),
        ),
        (38, [(4608, 3072, 9216), (4608, 3072, 12288), (4608, 15360, 3072)], (1, 4608, 4608, 24, 128)),
    ],
}


def _attention():
    """(name, fn(q, k, v) -> out) for (B, L, H, D) tensors: FlashAttention-4, else PyTorch's SDPA."""
    from prx_compile.ops import flash4_attention

    fa4 = flash4_attention.kernel() if flash4_attention.installed() else None
    if fa4 is not None:
        return "flash4", lambda q, k, v: fa4(q, k, v, softmax_scale=q.shape[-1] ** -0.5)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))

    return "sdpa", sdpa


def _gemm(m: int, k: int, n: int, fp8: bool):
    """fn() running one (M, K) x (K, N) GEMM on made-up operands: bf16 cuBLAS, or e4m3 row-wise."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    if not fp8:
        return lambda: F.linear(x, w)
    x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    sx = torch.ones(m, 1, device="cuda")
    sw = torch.ones(1, n, device="cuda")
    return lambda: torch._scaled_mm(
        x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True
    )


def _graph_ms(fns: list, replays: int = 10) -> float:
    """ms per replay of one CUDA graph running ``fns`` in order (the least of 3 rounds)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # warm-up: JIT kernels, cuBLAS handles
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # as ops.choice captures FA4
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / replays)
    return best


def floor(model: str, fp8: bool) -> dict:
    name, attend = _attention()
    blocks, flops = [], 0.0  # per block of the step: (its GEMMs, its attention)
    for count, shapes, (b, lq, s, h, d) in MODELS[model]:
        block = [_gemm(m, k, n, fp8) for m, k, n in shapes]
        q = torch.randn(b, lq, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        blocks += [(block, lambda q=q, k=k, v=v: attend(q, k, v))] * count
        flops += count * sum(2.0 * m * k * n for m, k, n in shapes)
    gemms = [g for block, _ in blocks for g in block]
    attentions = [a for _, a in blocks]
    both = [f for block, a in blocks for f in (*block, a)]
    row = {
        "model": model,
        "gemms": "e4m3 row-wise, fast accumulation (torch._scaled_mm)" if fp8 else "bf16 (cuBLAS)",
        "attention": name,
        "gemm_tflop": round(flops / 1e12, 2),
        "gemms_ms": round(_graph_ms(gemms), 2),
        "attention_ms": round(_graph_ms(attentions), 2),
        "both_ms": round(_graph_ms(both), 2),
    }
    row["gemm_tflops_per_s"] = round(flops / 1e9 / row["gemms_ms"], 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = ap.parse_args()
    what = "python benchmarks/probes/step_floor.py OUT.json"
    out = {"what": what, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    rows = out["rows"]
    for model in args.models:
        for fp8 in (False, True):
            try:
                rows.append(floor(model, fp8))
            except Exception as e:  # noqa: BLE001 (recorded: the other rows still run)
                rows.append({"model": model, "fp8": fp8, "error": f"{type(e).__name__}: {e}"[:400]})
            print(rows[-1], flush=True)
            Path(args.out).write_text(json.dumps(out, indent=1))  # row by row: a timeout keeps those done
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
