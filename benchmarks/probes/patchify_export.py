"""How long the range set's one-block symbolic export and its retrace take with diffusers' img2seq /
seq2img and with two other forms of the same values (CPU).

    python benchmarks/probes/patchify_export.py OUT.json [--reps 3]

Full-size PRX block (bf16, CPU, fake tensors: no device needed), the default range set (batch 1..2,
latent 88..180, text 1..256) exported at 832x1216 b2 with its first block only, then
``run_decompositions({})`` (the retrace; Torch-TensorRT's own table is not importable here). Forms:
diffusers' reshape + einsum + reshape, ``pixel_unshuffle`` / ``pixel_shuffle`` with a flatten and a
transpose, and reshape + permute + reshape; each checked equal to diffusers' on a tensor first.
Rounds alternate the forms in one process; minimum and all times -> OUT.json. A CPU measurement of
the trace only: what the engines do with each form is not measured here. Not shipped.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F
from diffusers.models.transformers import transformer_prx as T

from prx_compile.export import example_inputs, repeat
from prx_compile.export.step import _export
from prx_compile.shapes import ShapeRange
from prx_compile.tools.testing import make_prx

ORIGINAL = (T.img2seq, T.seq2img)
RANGE = ShapeRange((1, 2), (88, 180), (88, 180), (1, 256))


def img2seq_shuffle(img: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/p * W/p, C*p*p), diffusers' img2seq values."""
    return F.pixel_unshuffle(img, p).flatten(2).transpose(1, 2)


def seq2img_shuffle(seq: torch.Tensor, p: int, shape) -> torch.Tensor:
    """(B, L, C*p*p) -> (B, C, H, W), diffusers' seq2img values."""
    h, w = shape[-2:]
    b, _, d = seq.shape
    return F.pixel_shuffle(seq.transpose(1, 2).reshape(b, d, h // p, w // p), p)


def img2seq_permute(img: torch.Tensor, p: int) -> torch.Tensor:
    b, c, h, w = img.shape
    return img.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)


def seq2img_permute(seq: torch.Tensor, p: int, shape) -> torch.Tensor:
    h, w = shape[-2:]
    b, _, d = seq.shape
    c = d // (p * p)
    return seq.reshape(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


FORMS = {
    "diffusers": ORIGINAL,
    "pixel_shuffle": (img2seq_shuffle, seq2img_shuffle),
    "permute": (img2seq_permute, seq2img_permute),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    x = torch.randn(2, 16, 104, 152)
    for name, (to_seq, to_img) in FORMS.items():
        y = to_seq(x, 2)
        assert torch.equal(y, ORIGINAL[0](x, 2)) and torch.equal(to_img(y, 2, x.shape), x), name
    model = make_prx({"depth": 2}, dtype=torch.bfloat16)
    small = repeat.first_block_only(model)
    kw = example_inputs(model.config, 2, 104, 152, 256, dtype=torch.bfloat16, masked_tokens=64)
    _export(small, kw, ShapeRange.static(2, 104, 152, 256), "inputs", True)  # imports, caches
    times: dict[str, list[list[float]]] = {k: [] for k in FORMS}
    try:
        for _ in range(args.reps):
            for name, (to_seq, to_img) in FORMS.items():
                T.img2seq, T.seq2img = to_seq, to_img
                t0 = time.perf_counter()
                ep, _ = _export(small, kw, RANGE, "inputs", True)
                t1 = time.perf_counter()
                ep.run_decompositions({})
                t2 = time.perf_counter()
                times[name].append([round(t1 - t0, 3), round(t2 - t1, 3)])
                print(f"{name:14s} export {t1 - t0:.2f} s, decompose {t2 - t1:.2f} s", flush=True)
    finally:
        T.img2seq, T.seq2img = ORIGINAL
    result = {
        "what": "one-block symbolic export and run_decompositions({}) seconds (CPU), three patchify forms",
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "seconds_export_decompose": times,
        "min": {
            k: {"export_s": min(e for e, _ in v), "decompose_s": min(d for _, d in v)}
            for k, v in times.items()
        },
    }
    with open(args.out, "w") as f:
        json.dump(result, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
