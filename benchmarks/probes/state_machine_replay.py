"""Replays the GPU state machine's failing FLUX case (0.28, ``state_machine_v28_h200_log.txt``) five times,
each on a fresh compiled module, with diffusers' load and prx_compile's (GPU; run from the repository
root with $OUT set; writes $OUT/repro_v28_h200.json: each step's check, and the worst error so far).
The run that made ``state_machine_v28_repro_h200.json`` had these steps inline, same order and seeds."""

import json
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))

from state_machine import setup  # noqa: E402  (benchmarks/state_machine.py)

from tests.state_machine import machine  # noqa: E402


def replay(variant: str) -> list:
    s = setup("flux", "dtype", False)
    state = machine(s)()
    steps = []

    def check(tag: str) -> None:
        try:
            state.same_output()
            steps.append((tag, "ok", round(s.worst, 5)))
        except AssertionError as e:
            steps.append((tag, str(e)[:120], round(s.worst, 5)))

    check("start")
    for tag, op in (
        ("partial0", lambda: state.load_state_dict_partial(block=0, seed=0)),
        ("lsd", lambda: state.load_state_dict(seed=3988)),
        ("save", state.save_pretrained),
        ("edit", lambda: state.edit_in_place(factor=1.1, index=125166)),
        ("partial1", lambda: state.load_state_dict_partial(block=1, seed=313)),
        ("load " + variant, lambda: state.load(diffusers=variant == "diffusers", scale=1.0, seed=1424)),
    ):
        op()
        check(tag)
    check("again")
    return steps


out = []
for variant in ("diffusers", "prx", "diffusers", "prx", "diffusers"):
    out.append({"variant": variant, "steps": replay(variant)})
    print(variant, out[-1]["steps"][-3:], flush=True)
with open(os.path.join(os.environ["OUT"], "repro_v28_h200.json"), "w") as f:
    json.dump(out, f, indent=1)
