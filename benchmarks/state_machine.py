"""The model-based test of the compiled module's state (``tests/state_machine.py``) on a GPU, with the
TensorRT backend, bf16 and FP8: random sequences of LoRA, load_state_dict, in-place edits, new
parameters, save_pretrained (and, in a few sequences, save/load) against an eager mirror with PEFT's
semantics, within a relative error bound (TensorRT's kernels are not eager's).

    python benchmarks/state_machine.py OUT.json LOG.txt [--sequences 50]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for tests/

from prx_compile import compile_transformer  # noqa: E402
from prx_compile.export import example_inputs  # noqa: E402
from prx_compile.models import spec_for  # noqa: E402
from prx_compile.quant import fp8  # noqa: E402
from prx_compile.tools.testing import make_flux, make_prx  # noqa: E402
from tests.state_machine import Setup, machine  # noqa: E402

TOLERANCE = 2e-2  # relative L2 error to the mirror; a wrong LoRA state moves the output 10 % and more


def setup(name: str, precision: str, slow: bool) -> Setup:
    model = (make_prx() if name == "prx" else make_flux()).to("cuda", torch.bfloat16)
    template = copy.deepcopy(model)
    if precision == "fp8":
        fp8.install(template, spec_for(model).block_linears)
    common = dict(batch=[1, 2], aspect_bins=[], vae_scale_factor=1, resolution=16, specialize=[[16, 16, 2]])
    text = [1, 16] if name == "prx" else [8, 8]
    ct = compile_transformer(
        model, precision=precision, fp8_attention=False, static=True, text_len=text, **common
    )
    if name == "prx":
        inputs = example_inputs(model, 2, 16, 16, 16, masked_tokens=5, dtype=torch.bfloat16, device="cuda")
    else:
        inputs = example_inputs(model, 2, 64, 1, 8, dtype=torch.bfloat16, device="cuda")
    return Setup(ct, template, inputs, tolerance=TOLERANCE, slow_ops=slow)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("log")
    ap.add_argument("--sequences", type=int, default=50)
    args = ap.parse_args()
    result = {
        "what": "state machine against a PEFT-semantics mirror, TensorRT backend",
        "tolerance": TOLERANCE,
    }
    runs = []
    log_lines = []
    for name, precision, sequences, slow in (
        ("prx", "dtype", args.sequences, False),
        ("prx", "fp8", args.sequences, False),
        ("flux", "dtype", args.sequences // 2, False),
        ("prx", "dtype", 4, True),
    ):
        t0 = time.perf_counter()
        s = setup(name, precision, slow)
        row = {"model": name, "precision": precision, "slow_ops": slow}
        try:
            run_state_machine_as_test(
                machine(s),
                settings=settings(
                    max_examples=sequences,
                    stateful_step_count=12,
                    deadline=None,
                    suppress_health_check=list(HealthCheck),
                    database=None,
                    derandomize=True,
                ),
            )
            row["passed"] = True
        except Exception as e:  # the failing sequence, shrunk, is in the log
            row["passed"] = False
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            s.log.append(traceback.format_exc())  # which rule failed, and where
        row.update(
            sequences=s.sequences,
            steps=s.steps,
            worst_rel_err=s.worst,
            seconds=round(time.perf_counter() - t0, 1),
        )
        print(json.dumps(row), flush=True)
        runs.append(row)
        log_lines += [f"== {name} {precision} slow_ops={slow}: {json.dumps(row)}", *s.log]
        del s
        torch.cuda.empty_cache()
    result["runs"] = runs
    Path(args.out).write_text(json.dumps(result, indent=1))
    Path(args.log).write_text("\n".join(log_lines) + "\n")


if __name__ == "__main__":
    main()
