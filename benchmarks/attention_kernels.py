"""PRX's joint attention on every kernel that can run it, at a model's shapes: time, error, NaN.

    python benchmarks/attention_kernels.py OUT.json [--heads 24 --head-dim 128]   # PRXPixel (7B)
    python benchmarks/attention_kernels.py OUT.json --heads 28 --head-dim 64       # PRX 1.17 B

The candidates: bf16 — the split path (PyTorch's cuDNN SDPA over the image keys, a masked one over
the text keys, an exact merge: ``library.joint_attention``), one cuDNN call over the key-padding
layout (``cudnn_attention.padded_attention``, the ``cudnn`` extra), one FlashAttention-4 call over it
(``flash4_attention.padded_attention``, the ``flash4`` extra); FP8 — our Triton kernels
(``fp8_attention.joint_attention_fp8``: Q, K, V and P in e4m3, one scale per 128 tokens and head) and
cuDNN's FP8 attention (cudnn-frontend's ``sdpa_fp8``, forward, per-tensor scales).

Image queries (B=2, 4096 or 52*76 = 3952 tokens; H heads of D, RMS-normalised q and k) over
[256 text keys under the pipeline's mask (row 0 keeps 1, row 1 keeps 40; padded keys hold 1e4
garbage); the image keys]. cuDNN gets the mask exactly through its padding mask: attention is
invariant under a permutation of its keys, so K/V are laid out as [image keys; the kept text keys,
compacted in order; padding] with seq_len_kv = image + kept. Q, K, V are quantised per tensor
(amax / 448, e4m3) in plain PyTorch ops; P uses scale_s = 448 (cudnn-frontend 1.32: "448 for E4M3
without dropout"). O is bf16 where cuDNN allows it, else e4m3 with scale_o = 224 / amax of the exact
reference output (chosen once per shape, probe only) and dequantised for the comparison.

For each shape: every route's median ms (CUDA events, one call at a time) and back-to-back average,
its relative error (Frobenius) against exact fp32 attention and a NaN flag; for cuDNN the call alone
(inputs laid out and quantised already) and the total with the layout + quantisation + dequantisation
done in unfused PyTorch ops, plus the same call without the padding mask (inexact: it attends the
zeroed padding; the padding mask's cost). Then whether the cuDNN call can be captured in a
``torch.cuda.CUDAGraph`` and replayed to the same bytes. Which libcudnn the frontend loaded and the
versions go in ``env``. Every part is caught on its own; the JSON is rewritten after each.
    -> OUT_DIR/cudnn_fp8_attention.json
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
import sys
from pathlib import Path

import torch

H, D, T = 24, 128, 256  # set by --heads / --head-dim
SHAPES = {"1024² b2": (2, 4096), "832x1216 b2": (2, 52 * 76)}
KEPT = (1, 40)
SCALE = D**-0.5
E4M3_MAX = 448.0
SCALE_S = 448.0
SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
# own buffers of an sdpa_fp8 call (descale_q/k/v come with the quantised inputs); scale_o is set per shape
SCALAR_INIT = {"scale_s": SCALE_S, "descale_s": 1 / SCALE_S, "scale_o": 1.0, "amax_o": 0.0, "amax_s": 0.0}


def load_cudnn_frontend():
    """Import cudnn-frontend so that it binds the libcudnn torch already loaded.

    The frontend dlopens libcudnn itself: first ``libcudnn.so.9`` in each ``LD_LIBRARY_PATH`` directory,
    then ``site-packages/nvidia/cudnn/lib``, then the bare soname. So: make torch load its cuDNN, find
    that file in /proc/self/maps (or under torch's ``nvidia/`` wheels) and put its directory first on
    LD_LIBRARY_PATH (read at import). libcudart likewise, via ``CUDNN_FRONTEND_CUDART_LIB_NAME``.
    """
    info = {"torch_cudnn": torch.backends.cudnn.version()}  # loads torch's libcudnn
    if os.environ.get("CUDNN_FE_PATH"):
        sys.path.insert(0, os.environ["CUDNN_FE_PATH"])
    mapped = set(re.findall(r"(/\S+)$", Path("/proc/self/maps").read_text(), re.M))

    def loaded(pattern):
        return sorted(p for p in mapped if re.fullmatch(pattern, os.path.basename(p)))

    libs = loaded(r"libcudnn\.so\.\d+")
    if not libs:
        libs = sorted(
            glob.glob(str(Path(torch.__file__).parents[1] / "nvidia/**/libcudnn.so.9"), recursive=True)
        )
    if libs:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(
            [os.path.dirname(libs[0]), os.environ.get("LD_LIBRARY_PATH", "")]
        )
    cudart = loaded(r"libcudart\.so\.\d+")
    if cudart and "CUDNN_FRONTEND_CUDART_LIB_NAME" not in os.environ:
        os.environ["CUDNN_FRONTEND_CUDART_LIB_NAME"] = cudart[0]
    import cudnn

    info.update(
        libcudnn=libs,
        libcudart=cudart,
        frontend=cudnn.__version__,
        frontend_file=cudnn.__file__,
        backend=cudnn.backend_version(),
        backend_string=cudnn.backend_version_string(),
    )
    return cudnn, info


def timed(fn, iters=30) -> dict:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return {"ms": statistics.median(times), "loop_avg_ms": start.elapsed_time(end) / iters}


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def rms_norm(x):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


def inputs(b, lq, seed=0):
    """(q, k_a, v_a, mask, k_b, v_b): text keys/values under the mask, then the image ones."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s):
        return torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)

    q, k, v = rms_norm(r(b, lq, H, D)), rms_norm(r(b, lq, H, D)), r(b, lq, H, D)
    tk, tv = rms_norm(r(b, T, H, D)), r(b, T, H, D)
    mask = torch.zeros(b, T, dtype=torch.bool, device="cuda")
    for i in range(b):
        mask[i, : KEPT[i % len(KEPT)]] = True
    tk = tk.masked_fill(~mask[:, :, None, None], 1e4)  # padded keys hold garbage: must not matter
    return q, tk, tv, mask, k, v


def exact(q, tk, tv, mask, k, v):
    """fp32 softmax attention with the mask, a batch row and 7 heads at a time."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for i in range(q.shape[0]):
        keys, vals = torch.cat([tk[i], k[i]]).float(), torch.cat([tv[i], v[i]]).float()
        keep = torch.cat([mask[i], torch.ones(k.shape[1], dtype=torch.bool, device=q.device)])
        for h in range(0, H, 4):
            s = torch.einsum("qhd,khd->hqk", q[i, :, h : h + 4].float(), keys[:, h : h + 4]) * SCALE
            p = s.masked_fill(~keep, float("-inf")).softmax(-1)
            out[i, :, h : h + 4] = torch.einsum("hqk,khd->qhd", p, vals[:, h : h + 4])
    return out


def layout_quant(q, tk, tv, mask, k, v) -> dict:
    """K/V as [image; kept text keys compacted, in order; zeros], seq lens, per-tensor e4m3 Q/K/V."""
    b, li = k.shape[:2]
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :, None, None].expand(-1, -1, H, D)
    kept = mask.sum(1)
    live = (torch.arange(T, device=mask.device)[None] < kept[:, None])[:, :, None, None]
    out = {
        "seq_q": torch.full((b, 1, 1, 1), q.shape[1], dtype=torch.int32, device=q.device),
        "seq_kv": (li + kept).to(torch.int32).view(b, 1, 1, 1),
    }
    kk = torch.cat([k, torch.gather(tk, 1, order).masked_fill(~live, 0)], 1)
    vv = torch.cat([v, torch.gather(tv, 1, order).masked_fill(~live, 0)], 1)
    for name, x in (("q", q), ("k", kk), ("v", vv)):
        amax = x.abs().amax().float().clamp_min(1e-12)
        out[name] = (x.float() * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        out["descale_" + name] = (amax / E4M3_MAX).reshape(1, 1, 1, 1)
    return out


def build(cudnn, handle, b, lq, lk, o_type, padding, declare_amax_s):
    """The sdpa_fp8 graph, as cudnn-frontend's test/python/sdpa/fp8.py and sdpa/fwd/torch_op.py build theirs.
    Q/K/V/O are (B, H, S, D) views of (B, S, H, D) buffers."""
    dt = cudnn.data_type
    g = cudnn.pygraph(
        io_data_type=dt.FP8_E4M3, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT, handle=handle
    )

    def bshd(name, s):
        return g.tensor(name=name, dim=[b, H, s, D], stride=[s * H * D, D, H * D, 1], data_type=dt.FP8_E4M3)

    t = {"q": bshd("q", lq), "k": bshd("k", lk), "v": bshd("v", lk)}
    for n in SCALARS:
        t[n] = g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.FLOAT)
    mask_kw = {}
    if padding:
        for n in ("seq_q", "seq_kv"):
            t[n] = g.tensor(name=n, dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.INT32)
        mask_kw = dict(use_padding_mask=True, seq_len_q=t["seq_q"], seq_len_kv=t["seq_kv"])
    o, _, amax_s, amax_o = g.sdpa_fp8(
        q=t["q"], k=t["k"], v=t["v"], **{n: t[n] for n in SCALARS},
        attn_scale=SCALE, generate_stats=False, name="sdpa_fp8", **mask_kw,
    )  # fmt: skip
    o.set_output(True).set_dim([b, H, lq, D]).set_stride([lq * H * D, D, H * D, 1]).set_data_type(o_type)
    outs = {"o": o, "amax_o": amax_o, **({"amax_s": amax_s} if declare_amax_s else {})}
    for n, x in outs.items():
        if n != "o":
            x.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(dt.FLOAT)
        t[n] = x
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, t


def err(e, n=600) -> str:
    return f"{type(e).__name__}: {e}"[:n]


class Fp8Call:
    """One built sdpa_fp8 graph with its own output, scale and workspace buffers; ``bind`` the inputs."""

    def __init__(self, cudnn, handle, b, lq, padding, log):
        self.cudnn, self.handle, self.o_bf16 = cudnn, handle, None
        # bf16 O first (the frontend allows it on Blackwell with cuDNN >= 9.13 only), then e4m3;
        # Amax_S is deprecated: virtual first, declared if the build wants it.
        for o_bf16, amax_s in ((True, False), (True, True), (False, False), (False, True)):
            o_type = cudnn.data_type.BFLOAT16 if o_bf16 else cudnn.data_type.FP8_E4M3
            try:
                self.graph, self.t = build(cudnn, handle, b, lq, lq + T, o_type, padding, amax_s)
                self.o_bf16 = o_bf16
                break
            except Exception as e:
                log.append(f"O {'bf16' if o_bf16 else 'e4m3'}, Amax_S declared {amax_s}: {err(e)}")
        if self.o_bf16 is None:
            raise RuntimeError("no sdpa_fp8 graph built: see the build log")
        o_dtype = torch.bfloat16 if self.o_bf16 else torch.float8_e4m3fn
        self.bufs = {n: torch.full((1, 1, 1, 1), v, device="cuda") for n, v in SCALAR_INIT.items()}
        self.bufs["o"] = torch.empty(b, lq, H, D, device="cuda", dtype=o_dtype)
        self.ws = torch.empty(max(self.graph.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")

    def bind(self, lay):  # bare device addresses (bufs keeps the tensors alive): the backend's classic form
        self.bufs.update(lay)
        self.pack = {x: self.bufs[n].data_ptr() for n, x in self.t.items()}

    def __call__(self):  # per call, as cudnn-frontend's sdpa/fwd/torch_op.py: torch's current stream
        self.cudnn.set_stream(self.handle, torch.cuda.current_stream().cuda_stream)
        self.graph.execute(self.pack, self.ws, handle=self.handle)

    def result(self):
        o = self.bufs["o"]
        return o if self.o_bf16 else (o.float() / self.bufs["scale_o"]).to(torch.bfloat16)


def cudnn_route(cudnn, handle, x, ref, row, padding):
    """The cuDNN FP8 call at one shape into ``row``; returns it (with the padding mask) or None."""
    b, lq = x[0].shape[:2]
    pre = "cudnn_fp8" if padding else "cudnn_fp8_nomask"
    call = Fp8Call(cudnn, handle, b, lq, padding, row.setdefault(pre + "_build_log", []))
    call.bind(layout_quant(*x))
    if not call.o_bf16:
        call.bufs["scale_o"].fill_(224.0 / ref.abs().amax().item())
    call()
    out = call.result()
    t = timed(call)
    row.update(
        {pre + "_ms": t["ms"], pre + "_loop_avg_ms": t["loop_avg_ms"], pre + "_rel_err": rel(out, ref)}
    )
    if not padding:  # the padding mask's cost: this one attends the zeroed padding, so it is inexact
        return None
    row.update({pre + "_nan": bool(out.isnan().any()), pre + "_o_dtype": "bf16" if call.o_bf16 else "e4m3"})
    row.update({pre + "_scale_o": call.bufs["scale_o"].item(), pre + "_amax_o": call.bufs["amax_o"].item()})
    row[pre + "_workspace_bytes"] = call.ws.numel()
    try:
        row[pre + "_plan"] = call.graph.get_plan_name_at_index(call.graph._plan_index)
    except Exception as e:
        row[pre + "_plan"] = err(e, 200)

    def total():
        call.bind(layout_quant(*x))
        call()
        return call.result()

    t = timed(total)
    row.update({pre + "_total_ms": t["ms"], pre + "_total_loop_avg_ms": t["loop_avg_ms"]})
    row[pre + "_total_rel_err"] = rel(total(), ref)
    return call


def capture(call) -> dict:
    """Capture the call in a torch CUDA graph; replay it into a zeroed O and compare with eager."""
    call()
    torch.cuda.synchronize()
    eager = call.bufs["o"].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    o = call.bufs["o"]
    o.view(torch.uint8).zero_()
    graph.replay()
    torch.cuda.synchronize()
    return {
        "captured": True,
        "replay_equal": torch.equal(o.view(torch.uint8), eager.view(torch.uint8)),
        "replay_rel_diff": rel(o.float(), eager.float()),
        "replay_ms": timed(graph.replay)["ms"],
    }


def padded_bf16(module):
    """A candidate: ``module.padded_attention`` over [image keys; kept text keys; zeros] in bf16."""

    def run(q, tk, tv, mask, k, v, scale):
        b, li = k.shape[:2]
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :, None, None].expand(
            -1, -1, H, D
        )
        kept = mask.sum(1)
        live = (torch.arange(T, device=mask.device)[None] < kept[:, None])[:, :, None, None]
        kk = torch.cat([k, torch.gather(tk, 1, order).masked_fill(~live, 0)], 1).contiguous()
        vv = torch.cat([v, torch.gather(tv, 1, order).masked_fill(~live, 0)], 1).contiguous()
        seq = torch.zeros(2, -(-b // 4) * 4, dtype=torch.int32, device=q.device)
        seq[0, :b], seq[1, :b] = q.shape[1], li + kept
        return module.padded_attention(q.contiguous(), kk, vv, seq, scale)

    return run


def main(out_file: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference
    torch.zeros(1, device="cuda")
    path = Path(out_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name()}
    env["capability"] = list(torch.cuda.get_device_capability())
    notes = {
        "mask": "keys laid out [image; kept text compacted; padding], seq_len_kv = image + kept: exact",
        "quantisation": "per-tensor amax/448 e4m3 Q, K, V in unfused PyTorch ops (amax, mul, clamp, cast), "
        "the layout by argsort/gather/masked_fill/cat and O's dequantisation are all in cudnn_fp8_total_ms; "
        "a fused kernel would cost less",
        "scale_s": f"{SCALE_S} (descale_s 1/{SCALE_S}); Amax_S left virtual unless the build needed it",
        "scale_o": "1 for a bf16 O; for an e4m3 O 224 / amax(exact fp32 output), chosen once per shape",
    }
    res = {"env": env, "notes": notes, "heads": H, "head_dim": D, "text": T, "shapes": {}}

    def save():
        path.write_text(json.dumps(res, indent=1))

    cudnn = handle = None
    try:
        cudnn, info = load_cudnn_frontend()
        env.update(info)
        handle = cudnn.create_handle()
    except Exception as e:
        env["cudnn_frontend_error"] = err(e)
    save()
    from prx_compile.ops import cudnn_attention, flash4_attention, library
    from prx_compile.ops import fp8_attention as fa

    candidates = {"bf16_split": library.joint_attention, "triton_fp8": fa.joint_attention_fp8}
    if cudnn_attention.installed():
        candidates["bf16_cudnn_one_call"] = padded_bf16(cudnn_attention)
    if flash4_attention.installed():
        candidates["bf16_flash4_one_call"] = padded_bf16(flash4_attention)

    first = None
    for name, (b, lq) in SHAPES.items():
        row = res["shapes"][name] = {"B": b, "Lq": lq, "Lk": lq + T, "kept": list(KEPT[:b])}
        x = inputs(b, lq)
        ref = exact(*x)
        for key, fn in candidates.items():
            try:
                out = fn(*x, SCALE)
                t = timed(lambda fn=fn, x=x: fn(*x, SCALE))
                row.update({f"{key}_ms": t["ms"], f"{key}_loop_avg_ms": t["loop_avg_ms"]})
                row.update({f"{key}_rel_err": rel(out, ref), f"{key}_nan": bool(out.isnan().any())})
            except Exception as e:
                row[f"{key}_error"] = err(e)
            save()
        for padding in (True, False) if cudnn is not None else ():
            try:
                call = cudnn_route(cudnn, handle, x, ref, row, padding)
                first = first or call
            except Exception as e:
                row["cudnn_fp8_error" if padding else "cudnn_fp8_nomask_error"] = err(e)
            save()
        print(name, {k: v for k, v in row.items() if not k.endswith("log")}, flush=True)
        del ref

    try:
        if first is None:
            raise RuntimeError("no cuDNN FP8 call was built")
        res["cuda_graph"] = {"shape": next(iter(SHAPES)), **capture(first)}
    except Exception as e:
        res["cuda_graph"] = {"captured": False, "error": err(e)}
    save()
    print(env, res["cuda_graph"], flush=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--head-dim", type=int, default=128)
    a = ap.parse_args()
    H, D, SCALE = a.heads, a.head_dim, a.head_dim**-0.5
    main(a.out)
