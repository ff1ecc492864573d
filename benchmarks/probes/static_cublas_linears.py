"""Would static engine sets be faster with their linears in cuBLAS, as range sets run them?

    python benchmarks/probes/static_cublas_linears.py OUT.json

Full-size PRX (1.17 B, bf16, non-degenerate weights), 1024² batch 2, the pipeline's text mask, one
process: eager, the static preset as shipped (GEMMs inside TensorRT-RTX), and the same preset with
``CompileConfig.linears_in_torch`` patched to say yes for static sets too (every linear a
``prx_compile::linear`` between engines, as ``range_linears: torch`` does for range sets).
"""

import json
import sys
import tempfile

import torch

from prx_compile.config import CompileConfig
from prx_compile.tools.bench import Case, compile_path, run_bench, table
from prx_compile.tools.testing import FULL_PRX, make_prx


def main(out: str) -> None:
    model = make_prx(FULL_PRX, dtype=torch.bfloat16, device="cuda")
    cases = [Case((1024, 1024), 2)]
    res = run_bench(
        cases,
        {
            "eager": lambda m: m,
            "compile_prx[static, GEMMs in TensorRT]": compile_path(
                "prx-1024-bf16-static", engine_cache_dir=tempfile.mkdtemp()
            ),
        },
        model=model,
        out_json=out,
    )
    CompileConfig.linears_in_torch = lambda self, shapes: (
        self.backend == "tensorrt" and (self.weights == "inputs")
    )
    cublas = run_bench(
        cases,
        {
            "compile_prx[static, linears in cuBLAS]": compile_path(
                "prx-1024-bf16-static", engine_cache_dir=tempfile.mkdtemp()
            )
        },
        model=model,
    )
    res["records"] += cublas["records"]
    with open(out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(table(res), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
