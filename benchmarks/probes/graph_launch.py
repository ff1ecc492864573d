"""What a whole-step CUDA graph's launch costs a synchronised step, and whether splitting it pays
(issue 24), in plain PyTorch (no TensorRT).

    python benchmarks/probes/graph_launch.py OUT.json

A stand-in for PRX's step at 1024² batch 2 (16 blocks of PRX's GEMMs at 8192 image and 512 text
rows, SDPA over 4096 image + 256 text keys, and the elementwise kernels around them; ~25 kernels a
block) is captured once as one CUDA graph and once as k graphs in a row (k = 2 with the first block
alone, 4, 16), all in one memory pool. For each: the median of synchronised CUDA-event timings
(start event, launch, end event, sync: what ``tools.bench.time_cuda`` measures), the same with the
GPU held busy by a sleep kernel while the launch is made (the GPU time alone), and the CPU
seconds of the launch calls. Result: ``graph_launch_h200.json`` in ``benchmarks/results/``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

B, N_IMG, N_TXT, HIDDEN, MLP, HEADS, HEAD_DIM, BLOCKS = 2, 4096, 256, 1792, 6272, 28, 64, 16


def make_weights(dev):
    g = torch.Generator(device=dev).manual_seed(0)

    def w(o, i):
        return (torch.randn(o, i, device=dev, generator=g) * i**-0.5).bfloat16()

    return [
        {
            "qkv": w(3 * HIDDEN, HIDDEN),
            "kv": w(2 * HIDDEN, HIDDEN),
            "out": w(HIDDEN, HIDDEN),
            "gate": w(MLP, HIDDEN),
            "up": w(MLP, HIDDEN),
            "down": w(HIDDEN, MLP),
            "mod": (torch.randn(6, HIDDEN, device=dev, generator=g) * 0.1).bfloat16(),
        }
        for _ in range(BLOCKS)
    ]


def block(x, txt, wt):
    """x: (B, N_IMG, HIDDEN), txt: (B, N_TXT, HIDDEN) -> (B, N_IMG, HIDDEN)."""
    m = wt["mod"]
    h = F.rms_norm(x, (HIDDEN,)) * (1 + m[0]) + m[1]
    q, k, v = F.linear(h, wt["qkv"]).view(B, N_IMG, 3, HEADS, HEAD_DIM).unbind(2)
    tk, tv = F.linear(txt, wt["kv"]).view(B, N_TXT, 2, HEADS, HEAD_DIM).unbind(2)
    q, k, tk = F.rms_norm(q, (HEAD_DIM,)), F.rms_norm(k, (HEAD_DIM,)), F.rms_norm(tk, (HEAD_DIM,))
    keys = torch.cat([k, tk], 1).transpose(1, 2)
    values = torch.cat([v, tv], 1).transpose(1, 2)
    a = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values)
    a = a.transpose(1, 2).reshape(B, N_IMG, HIDDEN)
    x = x + m[2] * F.linear(a, wt["out"])
    h = F.rms_norm(x, (HIDDEN,)) * (1 + m[3]) + m[4]
    h = F.gelu(F.linear(h, wt["gate"]), approximate="tanh") * F.linear(h, wt["up"])
    return x + m[5] * F.linear(h, wt["down"])


def capture(weights, x, txt, cuts: list[int]):
    """Graphs for blocks [0, cuts[0]), [cuts[0], cuts[1]), ... in one pool; returns (graphs, out)."""
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x
        for wt in weights:
            y = block(y, txt, wt)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs, y, start = [], x, 0
    for end in [*cuts, BLOCKS]:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            for wt in weights[start:end]:
                y = block(y, txt, wt)
        graphs.append(g)
        start = end
    torch.cuda.synchronize()
    return graphs, y


def timed(graphs, busy_first: bool, iters: int = 30, sleep_cycles: int = 20_000_000) -> dict:
    ms, cpu = [], []
    for i in range(iters + 5):
        if busy_first:
            torch.cuda._sleep(sleep_cycles)  # ~10 ms of GPU time: the launch below is made meanwhile
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for g in graphs:
            g.replay()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        if i >= 5:
            ms.append(start.elapsed_time(end))
            cpu.append((t1 - t0) * 1e3)
    return {"ms": statistics.median(ms), "launch_cpu_ms": statistics.median(cpu)}


def main(out: str) -> None:
    dev = torch.device("cuda")
    weights = make_weights(dev)
    x = torch.randn(B, N_IMG, HIDDEN, device=dev, dtype=torch.bfloat16)
    txt = torch.randn(B, N_TXT, HIDDEN, device=dev, dtype=torch.bfloat16)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "splits": {}}
    ref = None
    for name, cuts in {
        "1 graph": [],
        "2 graphs (block 0 alone)": [1],
        "4 graphs": [4, 8, 12],
        "16 graphs": list(range(1, 16)),
    }.items():
        graphs, y = capture(weights, x, txt, cuts)
        for g in graphs:
            g.replay()
        torch.cuda.synchronize()
        ref = y.clone() if ref is None else ref
        row = {
            "synchronised": timed(graphs, busy_first=False),
            "gpu_busy_during_launch": timed(graphs, busy_first=True),
            "max_abs_diff_vs_1_graph": (y.float() - ref.float()).abs().max().item(),
        }
        row["exposed_launch_ms"] = row["synchronised"]["ms"] - row["gpu_busy_during_launch"]["ms"]
        results["splits"][name] = row
        print(name, json.dumps(row), flush=True)
        del graphs
    graphs, y = capture(weights, x, txt, [])
    results["sleep_before"] = {
        f"{c / 1.98e6:.2f} ms": timed(graphs, True, sleep_cycles=c) for c in (20_000, 200_000, 2_000_000)
    }
    tiny = torch.cuda.CUDAGraph()
    z = torch.zeros(1, device=dev)
    with torch.cuda.graph(tiny):
        z.add_(1)
    results["tiny_graph"] = {"synchronised": timed([tiny], False), "busy": timed([tiny], True)}

    class Eager:
        def replay(self):
            y = x
            for wt in weights:
                y = block(y, txt, wt)

    results["eager"] = {"synchronised": timed([Eager()], False), "busy": timed([Eager()], True)}
    print(json.dumps({k: results[k] for k in ("sleep_before", "tiny_graph", "eager")}), flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
