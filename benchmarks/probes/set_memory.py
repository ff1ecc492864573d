"""Device memory each static engine set adds, for config variants, each in a new process.

    python benchmarks/probes/set_memory.py OUT.json '{"attention_kernel": "split"}' '{}' ...

For each JSON object of ``compile_prx`` overrides (a new Python process each, so nothing is shared):
the full PRX (bf16, non-degenerate), eager's device memory in use (``torch.cuda.mem_get_info``), then
the first call at 1024² b2, 1024² b1 and 832x1216 b2 (three static sets under the defaults), the
memory in use and PyTorch's reserved after each, and warm ms/step at each. -> OUT.json
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time, torch
sys.path.insert(0, "benchmarks")
from first_call import SHAPES, first_call, mem_gb
from prx_compile import compile_prx
from prx_compile.tools.bench import time_cuda
from prx_compile.tools.testing import FULL_PRX, make_prx
over = json.loads(sys.argv[1])
model = make_prx(FULL_PRX, dtype=torch.bfloat16, device="cuda")
kws = [c.inputs(model.config, torch.bfloat16, "cuda") for c in SHAPES]
with torch.no_grad():
    model(**kws[0], return_dict=False)
torch.cuda.synchronize()
res = {"overrides": over, "mem_gb_eager": mem_gb(), "sets": []}
ct = compile_prx(model, **over)
for case, kw in zip(SHAPES, kws):
    _, s = first_call(lambda **k: ct(**k, return_dict=False), kw)
    res["sets"].append({"resolution": list(case.resolution), "batch": case.batch, "first_call_s": s,
                        "mem_gb": mem_gb(), "torch_reserved_gb": torch.cuda.memory_reserved() / 1e9})
for row, kw in zip(res["sets"], kws):
    row["ms_per_step"] = time_cuda(lambda: ct(**kw, return_dict=False))["ms"]
print("RESULT " + json.dumps(res), flush=True)
"""


def main() -> None:
    out, variants = Path(sys.argv[1]), sys.argv[2:]
    results = []
    for v in variants:
        done = subprocess.run([sys.executable, "-c", CHILD, v], capture_output=True, text=True, timeout=280)
        line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        results.append(json.loads(line[-1][7:]) if line else {"overrides": v, "error": done.stderr[-1500:]})
        print(json.dumps(results[-1]), flush=True)
        out.write_text(json.dumps({"variants": results}))


if __name__ == "__main__":
    main()
