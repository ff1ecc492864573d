"""A Program drops each intermediate after its last use: a step (and a CUDA graph of it) holds the
most results alive at once, not every result of the step."""

import weakref

import torch

from prx_compile.backends.tensorrt.program import Program, Step


def chain(n: int) -> Program:
    """v0 = e(in), v1 = e(v0), ..., output v<n-1>; plus v1 read again by the last step."""
    steps = [Step("engine", [{"ref": "in:hidden_states"}], {}, "v0", "e")]
    for i in range(1, n):
        args = [{"ref": f"v{i - 1}"}] + ([{"ref": "v1"}] if i == n - 1 else [])
        steps.append(Step("engine", args, {}, f"v{i}", "e"))
    return Program(["hidden_states"], steps, {"ref": f"v{n - 1}"})


def test_intermediates_are_dropped_after_their_last_use():
    alive: list[weakref.ref] = []
    peak = []

    def engine(*xs):
        # no gc.collect(): a tensor the Program drops is freed by its reference count at once, and one
        # kept alive only by a reference cycle counts as alive here (a collection late in the suite,
        # with every test's objects in the heap, took most of a second per call)
        peak.append(sum(r() is not None for r in alive))
        out = xs[0] + (xs[1] if len(xs) > 1 else 1)
        alive.append(weakref.ref(out))
        return out

    program = chain(8)
    x = torch.zeros(4)
    out = program.run({"hidden_states": x}, {}, {"e": engine}, {})
    # 0..6 plus v1, which the last step reads: nothing else stays behind a step
    assert torch.equal(out, torch.full((4,), 7.0) + 2.0)
    assert max(peak) <= 2, peak
    assert program.frees()[1] == ["v0"] and sorted(program.frees()[7]) == ["v1", "v6"]
    assert "v7" not in sum(program.frees(), [])  # the output
    program.steps = program.steps[:3]  # another list of steps: computed again
    program.output = {"ref": "v2"}
    assert program.frees()[2] == ["v1"]
