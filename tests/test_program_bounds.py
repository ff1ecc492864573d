"""A Program read from JSON (an artifact, a cache entry) runs bounded: a hostile one fails in well
under a second with an ArtifactError naming the step, before it can exhaust memory; a round trip of a
real one still runs (tests/test_program.py)."""

import resource
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prx_compile import ArtifactError
from prx_compile.backends.tensorrt.program import Program, ProgramError
from prx_compile.models import SPECS
from prx_compile.models.prx import INPUTS as STEP_INPUTS

X = {"ref": "in:hidden_states"}
INPUTS = {"hidden_states": torch.ones(2, 4, 8, 8)}


def load(steps, output):
    """A Program as JSON from an artifact: validated by from_json, then run untrusted."""
    data = {
        "inputs": ["hidden_states"],
        "steps": [
            {"op": op, "engine": None, "args": args, "kwargs": kwargs, "out": f"v{i}"}
            for i, (op, args, kwargs) in enumerate(steps)
        ],
        "output": output,
        "segments": 0,
    }
    return Program.from_json(data, engines=set(), params=set(), constants=set(), inputs=STEP_INPUTS)


def run(program):
    return program.run(INPUTS, {}, {}, {})


def timed_failure(program, match):
    t0 = time.perf_counter()
    with pytest.raises(ArtifactError, match=match):
        run(program)
    assert time.perf_counter() - t0 < 1.0


def test_forty_integer_squarings_fail_at_once():
    steps = [("aten.sym_size.int", [X, 2], {})]
    steps += [("operator.mul", [{"ref": f"v{i}"}, {"ref": f"v{i}"}], {}) for i in range(40)]
    timed_failure(load(steps, {"ref": "v40"}), r"failed at v5 \(operator\.mul\).*integer result of 97 bits")


@pytest.mark.parametrize(
    "steps,match",
    [
        # 2**40 elements as a view (no memory), then a copy: refused before the copy allocates
        (
            [("aten.expand.default", [X, {"list": [2**20, 2**20, 2, 4, 8, 8]}], {})],
            "more than this program may make",
        ),
        (
            [
                ("aten.view.default", [X, {"list": [-1]}], {}),
                ("aten.expand.default", [{"ref": "v0"}, {"list": [4096, 512]}], {}),
                ("aten.clone.default", [{"ref": "v1"}], {}),
            ],
            r"failed at v1 \(aten\.expand\.default\).*more than this program may make",  # before the copy
        ),
        ([("aten.view.default", [X, {"list": [3, 7]}], {})], r"failed at v0 \(aten\.view\.default\)"),
        ([("aten.select.int", [X, 0, 99], {})], "IndexError"),
        ([("operator.floordiv", [1, 0], {})], "ZeroDivisionError"),
        ([("aten.add.Tensor", [X, {"dtype": "bool"}], {})], r"failed at v0"),
        # the 0.15 ops given operands of the wrong shapes: their own checks, one line
        (
            [("prx_compile.gelu_gate.default", [X, X, X], {})],
            r"failed at v0 \(prx_compile\.gelu_gate\.default\).*gate_weight",
        ),
        (
            [("prx_compile.prx_attention_flash4.default", [X, X, None, None, X, X, X, 2, 1e-6, 0.5], {})],
            r"failed at v0 \(prx_compile\.prx_attention_flash4\.default\)",
        ),
    ],
)
def test_hostile_steps_fail_in_one_line(steps, match):
    out = {"ref": f"v{len(steps) - 1}"}
    timed_failure(load(steps, out), match)


def test_many_results_kept_alive_are_refused():
    # 2 MiB copies, every one read by the output, so none can be freed: refused at 16 MiB, not at 200
    steps = [
        ("aten.view.default", [X, {"list": [-1]}], {}),
        ("aten.expand.default", [{"ref": "v0"}, {"list": [1024, 512]}], {}),
    ]
    steps += [("aten.clone.default", [{"ref": "v1"}], {}) for _ in range(100)]
    program = load(steps, {"tuple": [{"ref": f"v{i}"} for i in range(2, 102)]})
    timed_failure(program, r"failed at v9 \(aten\.clone\.default\).*its results hold")


def test_what_engines_make_raises_the_bound_and_the_program_stays_bounded_by_it():
    """With weights in the engines (``weights: engine``) an engine's result can be far larger than
    the step's inputs: the ops after it (here its first output, doubled) may work on that size, and
    a copy of it per step still cannot pile up past 16x what the engines made."""
    big = torch.ones(64, 1024, 64)  # 16 MiB from 1 KiB of input: past 16x the inputs' 4 MiB floor

    def engine(x):
        return [big + x.sum(), big]

    data = {
        "inputs": ["hidden_states"],
        "steps": [
            {"op": "engine", "engine": "e0", "args": [X], "kwargs": {}, "out": "v0"},
            {"op": "operator.getitem", "engine": None, "args": [{"ref": "v0"}, 0], "kwargs": {}, "out": "v1"},
            {"op": "aten.mul.Tensor", "engine": None, "args": [{"ref": "v1"}, 2], "kwargs": {}, "out": "v2"},
        ],
        "output": {"ref": "v2"},
        "segments": 1,
    }
    program = Program.from_json(data, engines={"e0"}, params=set(), constants=set(), inputs=STEP_INPUTS)
    out = program.run(INPUTS, {}, {"e0": engine}, {})
    assert torch.equal(out, (big + INPUTS["hidden_states"].sum()) * 2)
    data["steps"] += [
        {"op": "aten.clone.default", "engine": None, "args": [{"ref": "v2"}], "kwargs": {}, "out": f"v{i}"}
        for i in range(3, 60)
    ]
    data["output"] = {"tuple": [{"ref": f"v{i}"} for i in range(3, 60)]}
    hoard = Program.from_json(data, engines={"e0"}, params=set(), constants=set(), inputs=STEP_INPUTS)
    with pytest.raises(ArtifactError, match="its results hold"):
        hoard.run(INPUTS, {}, {"e0": engine}, {})


@pytest.mark.parametrize("output", [1, None, {"ref": "v0"}])
def test_an_output_that_is_not_a_tensor_is_refused(output):
    program = load([("aten.sym_size.int", [X, 0], {})], output)
    timed_failure(program, "its output.*not a tensor")


def test_a_sound_program_runs_and_then_runs_unguarded():
    steps = [("aten.mul.Tensor", [X, 2.0], {}), ("aten.add.Tensor", [{"ref": "v0"}, X], {})]
    program = load(steps, {"ref": "v1"})
    assert torch.equal(run(program), INPUTS["hidden_states"] * 3)
    assert program._checked  # these shapes passed: later calls skip the guard
    assert torch.equal(run(program), INPUTS["hidden_states"] * 3)


OPS = [
    "aten.view.default",
    "aten.reshape.default",
    "aten.expand.default",
    "aten.permute.default",
    "aten.clone.default",
    "aten.cat.default",
    "aten.add.Tensor",
    "aten.mul.Tensor",
    "aten.slice.Tensor",
    "aten.sym_size.int",
    "operator.mul",
    "operator.floordiv",
]
INTS = st.one_of(st.integers(-8, 8), st.sampled_from([2**20, 2**31, 2**40, 2**62, -(2**40)]))


@st.composite
def programs(draw):
    steps = []
    for i in range(draw(st.integers(1, 6))):
        refs = [X] + [{"ref": f"v{j}"} for j in range(i)]
        op = draw(st.sampled_from(OPS))
        ref = draw(st.sampled_from(refs))
        n = draw(st.integers(0, 4))
        args = {
            "aten.view.default": [ref, {"list": [draw(INTS) for _ in range(n)]}],
            "aten.reshape.default": [ref, {"list": [draw(INTS) for _ in range(n)]}],
            "aten.expand.default": [ref, {"list": [draw(INTS) for _ in range(n)]}],
            "aten.permute.default": [ref, {"list": [draw(INTS) for _ in range(n)]}],
            "aten.clone.default": [ref],
            "aten.cat.default": [{"list": [ref] * draw(st.integers(1, 64))}, draw(INTS)],
            "aten.add.Tensor": [ref, draw(st.sampled_from(refs))],
            "aten.mul.Tensor": [ref, draw(st.sampled_from(refs))],
            "aten.slice.Tensor": [ref, draw(INTS), draw(INTS), draw(INTS)],
            "aten.sym_size.int": [ref, draw(INTS)],
            "operator.mul": [draw(st.sampled_from(refs)), draw(st.sampled_from(refs))],
            "operator.floordiv": [draw(st.sampled_from(refs)), draw(INTS)],
        }[op]
        steps.append((op, args, {}))
    return steps


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_any_program_runs_bounded_or_fails_as_an_artifact_error(steps):
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    t0 = time.perf_counter()
    try:
        program = load(steps, {"ref": f"v{len(steps) - 1}"})
    except ProgramError:
        return
    try:
        out = run(program)
    except ArtifactError:
        pass
    else:
        assert isinstance(out, torch.Tensor)
    assert time.perf_counter() - t0 < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 2**20  # under 1 GiB more, per case


def test_saved_shape_ranges_are_bounded_and_consistent():
    from prx_compile.shapes import ShapeRange

    good = ShapeRange((1, 2), (64, 128), (64, 128), (1, 256), 2, None, 96, None, None).to_dict()
    assert ShapeRange.from_dict(good).opt_height == 96
    for key, bad in (
        ("batch", [1, 2**20]),  # would allocate GiBs of example inputs at the first call
        ("height", [64, 10**6]),
        ("height", [63, 128]),  # off the patch multiple
        ("opt_height", 130),  # outside its range
        ("opt_width", 97),  # off the multiple
        ("opt_text", 0),
        ("multiple", 10**400),
    ):
        with pytest.raises(ValueError, match=f"shapes.{key}"):
            ShapeRange.from_dict({**good, key: bad})


def test_a_set_too_large_for_the_device_is_refused_before_its_first_call():
    from prx_compile.io.saving import check_memory
    from prx_compile.shapes import ShapeRange
    from prx_compile.tools.testing import make_prx

    model = make_prx()  # hidden 64, fp32
    small = ShapeRange.static(2, 16, 16, 16)
    big = ShapeRange.static(256, 2048, 2048, 4096)
    check_memory([small], model, SPECS["prx"], free_bytes=2**30)
    with pytest.raises(ArtifactError, match=r"needs at least .* GiB of device memory .* are free"):
        check_memory([small, big], model, SPECS["prx"], free_bytes=2**30)
    with pytest.raises(ValueError, match="tokens a step, more than"):
        ShapeRange.from_dict({**big.to_dict(), "batch": [1, 256]})


def _split(n):
    """One element of the input viewed as (n,), then split into n views of one."""
    return [
        ("aten.slice.Tensor", [X, 0, 0, 1], {}),
        ("aten.view.default", [{"ref": "v0"}, {"list": [-1]}], {}),
        ("aten.slice.Tensor", [{"ref": "v1"}, 0, 0, 1], {}),
        ("aten.expand.default", [{"ref": "v2"}, {"list": [n]}], {}),
        ("aten.split.Tensor", [{"ref": "v3"}, 1], {}),
    ]


@pytest.mark.parametrize(
    "steps",
    [
        [("operator.mul", [{"list": [1, 2]}, 2**31], {})],  # a list of 2**32 items
        [("operator.mul", [{"list": [1]}, 2**61], {})],
        # a (2**20,) view of one element (4 MiB as the guard counts it: allowed), split into 2**20 views
        _split(2**20),
        _split(2**40),  # refused already at the view: 4 TiB as counted
        [("operator.mul", [{"str": "a" * 20}, 2**26], {})],  # a string of 1.3 G characters
        # a string doubled: 0.31 ran 25 doublings to a 2.2 GB peak, twice the work each (sized by running)
        [("operator.add", [{"str": "a" * 20}, {"str": "a" * 20}], {})]
        + [("operator.add", [{"ref": f"v{i}"}, {"ref": f"v{i}"}], {}) for i in range(30)],
    ],
    ids=["list_2e31", "list_2e61", "split_2e20", "split_2e40", "str_2e26", "str_doubled"],
)
def test_lists_and_splits_are_sized_before_anything_is_allocated(steps):
    """0.16 ran these until MemoryError at a 6 GiB cap: sizing a step on meta tensors still made the
    Python list (or the 2**25 views) it asked for. Now each fails in under a second and 1 GiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, the process's peak so far
    program = load(steps, {"ref": f"v{len(steps) - 1}"})
    timed_failure(program, r"more than (a step|this program) may make")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 2**20  # under 1 GiB more
