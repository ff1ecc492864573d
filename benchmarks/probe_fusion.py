"""Where the time of the fused attention goes (H200): the op's pieces at PRX's full size, and a
4-block full-width PRX compiled with and without ``fused_attention``, with kernel profiles.

    python benchmarks/probe_fusion.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from probe_device import compare_depth4  # noqa: E402

from prx_compile import _kernels  # noqa: E402
from prx_compile.bench import environment, rel_err, time_cuda  # noqa: E402
from prx_compile.ops import joint_attention, prx_attention, qk_norm_rope_torch  # noqa: E402


def ops() -> dict:
    """prx_attention's pieces for 1024² batch 2: 4096 image tokens, 256 text tokens, 28 x 64 heads."""
    b, seq, t, h, d = 2, 4096, 256, 28, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    img_qkv = torch.randn(b, seq, 3 * h * d, device="cuda", generator=g).bfloat16()
    txt_kv = torch.randn(b, t, 2 * h * d, device="cuda", generator=g).bfloat16()
    mask = torch.zeros(b, t, dtype=torch.bool, device="cuda")
    mask[0, :1], mask[1, :40] = True, True
    theta = torch.rand(b, seq, d // 2, device="cuda", generator=g) * 60
    rope = torch.stack([theta.cos(), -theta.sin(), theta.sin(), theta.cos()], -1).reshape(
        b, 1, seq, d // 2, 2, 2
    )
    w = [(1 + 0.3 * torch.randn(d, device="cuda", generator=g)).bfloat16() for _ in range(3)]
    qkv = img_qkv.view(b, seq, 3, h, d)
    res: dict = {}
    res["triton_q_norm_rope_ms"] = time_cuda(
        lambda: _kernels.qk_norm_rope(qkv[:, :, 0], w[0], 1e-6, rope[:, 0])
    )["ms"]
    res["triton_k_norm_rope_copy_v_ms"] = time_cuda(
        lambda: _kernels.qk_norm_rope(qkv[:, :, 1], w[1], 1e-6, rope[:, 0], qkv[:, :, 2])
    )["ms"]
    res["torch_q_norm_rope_ms"] = time_cuda(lambda: qk_norm_rope_torch(qkv[:, :, 0], w[0], 1e-6, rope[:, 0]))[
        "ms"
    ]
    got = _kernels.qk_norm_rope(qkv[:, :, 0], w[0], 1e-6, rope[:, 0])[0]
    ref = qk_norm_rope_torch(qkv[:, :, 0], w[0], 1e-6, rope[:, 0])
    res["triton_vs_torch_rel_err"] = rel_err(got, ref)
    res["triton_vs_torch_equal_fraction"] = float((got == ref).float().mean())
    args = (img_qkv, txt_kv, mask, rope, *w, h, 1e-6, d**-0.5)
    res["prx_attention_ms"] = time_cuda(lambda: prx_attention(*args))["ms"]
    q = ref.contiguous()
    k = got.contiguous()
    v = qkv[:, :, 2].contiguous()
    tk, tv = (
        txt_kv.view(b, t, 2, h, d)[:, :, 0].contiguous(),
        txt_kv.view(b, t, 2, h, d)[:, :, 1].contiguous(),
    )
    res["joint_attention_only_ms"] = time_cuda(lambda: joint_attention(q, tk, tv, mask, k, v, d**-0.5))["ms"]
    res["hbm_bytes_q_kernel"] = 2 * b * seq * h * d * 2
    return res


def depth4() -> dict:
    """Full-width PRX with 4 blocks, 1024² batch 2, static: fused_attention on and off."""
    return compare_depth4({"unfused": dict(fused_attention=False), "fused": dict(fused_attention=True)})


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    res: dict = {"env": environment()}
    for name, fn in (("ops", ops), ("depth4", depth4)):
        try:
            res[name] = fn()
        except Exception as e:
            traceback.print_exc()
            res[name] = {"error": f"{type(e).__name__}: {e}"[:800]}
        Path(a.out, "probe_fusion_h200.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, indent=1, default=str)[:12000])
