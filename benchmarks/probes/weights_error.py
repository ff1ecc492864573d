"""How much a benchmark's random weights decide its error figures: FLUX.1-dev and the 7B PRXPixel at
full width and reduced depth, under each of ``common.WEIGHTS``, run eagerly in fp32, in bf16, and in
bf16 with the block linears in FP8 (``quant.fp8.install``: the row quantisation and GEMM the compiled
step runs, PyTorch's CPU ``_scaled_mm`` on a CPU). Writes OUT.json:

    python benchmarks/probes/weights_error.py OUT.json [--device cuda] [--ablate] [--depth D S]

FLUX: 2 double and 4 single blocks, 1024 image and 256 text tokens, batch 1, guidance 3.5. PRXPixel:
4 blocks, 512² pixels (1024 tokens), batch 2, 256 text tokens, the second row's last 100 masked.
Each row: relative L2 error of bf16 against fp32 and of FP8 against bf16 (the benchmarks' "error
against eager bf16"). ``--ablate`` (FLUX, "constructed"): FP8 on one kind of block linear only, and
on all but one kind, to see whether one kind carries the error. On CUDA each FP8 row is also run with
the GEMMs' fast accumulation off (``fp8_split_vs_bf16``: ``torch._scaled_mm(use_fast_accum=False)``,
patched in for the probe; a CPU has one accumulation). ``--depth`` sets FLUX.1's double and single
block counts and the 7B's depth (the first) instead of the reduced ones.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import WEIGHTS, made_model  # noqa: E402  (benchmarks/common.py)

from prx_compile.models import SPECS  # noqa: E402
from prx_compile.models.flux import DEV  # noqa: E402
from prx_compile.models.prx import PIXEL  # noqa: E402
from prx_compile.quant import fp8  # noqa: E402
from prx_compile.tools.bench import rel_err  # noqa: E402

CASES = {  # family -> (config, example_inputs arguments after the model)
    "flux": (dict(DEV, num_layers=2, num_single_layers=4), dict(batch=1, height=1024, width=1, text=256)),
    "prx": (dict(PIXEL, depth=4), dict(batch=2, height=512, width=512, text=256, masked_tokens=100)),
}
#: FLUX's block linears by kind (``--ablate``); "single" before "double": a single block's names
#: contain a double block's
KINDS = {
    "single q/k/v + MLP in": r"single_transformer_blocks\.\d+\.(attn\.to_[qkv]|proj_mlp)$",
    "single out": r"single_transformer_blocks\.\d+\.proj_out$",
    "double image q/k/v": r"^transformer_blocks\.\d+\.attn\.to_[qkv]$",
    "double text q/k/v": r"^transformer_blocks\.\d+\.attn\.add_[qkv]_proj$",
    "double outs": r"^transformer_blocks\.\d+\.attn\.(to_out\.0|to_add_out)$",
    "double feed-forward in": r"^transformer_blocks\.\d+\.ff(_context)?\.net\.0\.proj$",
    "double feed-forward out": r"^transformer_blocks\.\d+\.ff(_context)?\.net\.2$",
}


@contextlib.contextmanager
def split_accumulation():
    """``torch._scaled_mm`` with ``use_fast_accum=False`` whatever its caller asks (this probe only)."""
    original = torch._scaled_mm

    def scaled_mm(*args, **kwargs):
        return original(*args, **{**kwargs, "use_fast_accum": False})

    torch._scaled_mm = scaled_mm
    try:
        yield
    finally:
        torch._scaled_mm = original


def run(model, kw) -> torch.Tensor:
    with torch.no_grad():
        return model(**kw, return_dict=False)[0]


def in_fp8(model16, kw16, spec, names: list[str]) -> torch.Tensor:
    m = copy.deepcopy(model16)
    fp8.install(m, re.compile("^(" + "|".join(map(re.escape, names)) + ")$"))
    return run(m, kw16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--family", nargs="+", default=["flux", "prx"], choices=list(CASES))
    ap.add_argument("--ablate", action="store_true")
    ap.add_argument(
        "--depth", nargs=2, type=int, default=None, help="FLUX.1 double and single; the 7B the first"
    )
    ap.add_argument("--weights", nargs="+", default=list(WEIGHTS), choices=list(WEIGHTS))
    args = ap.parse_args()
    if args.depth:
        CASES["flux"][0].update(num_layers=args.depth[0], num_single_layers=args.depth[1])
        CASES["prx"][0].update(depth=args.depth[0])
    out: dict = {"what": " ".join(__doc__.split("\n\n")[0].split()), "device": args.device, "rows": []}
    out["torch"] = torch.__version__
    for family in args.family:
        spec = SPECS[family]
        config, case = CASES[family]
        for weights in args.weights:
            t0 = time.perf_counter()
            model = made_model(spec, config, weights, args.device, torch.float32)
            shape = dict(case)
            kw = spec.example_inputs(
                model, shape.pop("batch"), shape.pop("height"), shape.pop("width"), shape.pop("text"),
                dtype=torch.float32, device=args.device, seed=0, **shape,
            )  # fmt: skip
            ref32 = run(model, kw)
            model16 = model.to(torch.bfloat16)
            kw16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in kw.items()}
            ref16 = run(model16, kw16)
            names = [
                n
                for n, m in model16.named_modules()
                if isinstance(m, torch.nn.Linear) and spec.block_linears.match(n)
            ]
            out8 = in_fp8(model16, kw16, spec, names)
            row = {
                "family": family,
                "weights": weights,
                "config": {
                    k: v for k, v in config.items() if k in ("num_layers", "num_single_layers", "depth")
                },
                "bf16_vs_fp32": rel_err(ref16, ref32),
                "fp8_vs_bf16": rel_err(out8, ref16),
                "fp8_vs_fp32": rel_err(out8, ref32),
                "fp8_linears": len(names),
                "output_std_fp32": float(ref32.std()),
            }
            if args.device != "cpu":
                with split_accumulation():
                    row["fp8_split_vs_bf16"] = rel_err(in_fp8(model16, kw16, spec, names), ref16)
            if args.ablate and family == "flux" and weights == "constructed":
                row["ablation"] = {}
                for kind, pattern in KINDS.items():
                    these = [n for n in names if re.search(pattern, n)]
                    rest = [n for n in names if n not in these]
                    row["ablation"][kind] = {
                        "linears": len(these),
                        "only_these_in_fp8": rel_err(in_fp8(model16, kw16, spec, these), ref16),
                        "all_but_these_in_fp8": rel_err(in_fp8(model16, kw16, spec, rest), ref16),
                    }
            row["seconds"] = round(time.perf_counter() - t0, 1)
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
            del model, model16


if __name__ == "__main__":
    main()
