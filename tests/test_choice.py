"""Kernels chosen by measurement (``ops.choice``), on a CPU: the candidates run for real (their
named CPU fallbacks) and are held to the fp32 reference; a timer stands in for the GPU's clock, so
what is tested is the choice itself: the fastest within its bound wins, a wrong or failing candidate
is left out with the reason, the lowering emits what was chosen, and a recorded choice read back
from an artifact is validated."""

import math
import threading

import pytest
import torch

from prx_compile import CompileConfig
from prx_compile.lowering import lower
from prx_compile.ops import PRX_ATTENTION, PRX_ATTENTION_FP8, choice, fp8_attention, library
from prx_compile.ops.choice import KernelChoice
from prx_compile.plan import Plan
from prx_compile.tools.testing import make_flux, make_prx

FP8 = ("fp8/0", "fp8/1", "fp8/2", "fp8/3")


def setup(config=None, model=None, **overrides):
    """(plan, model, the static set, its example inputs); a tiny PRX at batch 2, 256² pixels."""
    model = model if model is not None else make_prx()
    if model.__class__.__name__.startswith("PRX"):  # 256 image tokens (two blocks of 128), 16 text
        small = dict(
            batch=[2, 2], resolution=256, text_len=[16, 16], aspect_bins=[], specialize=[[256, 256, 2]]
        )
        overrides = {**small, **overrides}
    cfg = CompileConfig.resolve(config, device="cpu", static=True, **overrides)
    plan = Plan.resolve(cfg, model)
    shapes = plan.shape_sets()[0]
    b, h, w, t = shapes.opt_point()
    kwargs = plan.spec.example_inputs(model, b, h, w, t, dtype=torch.float32, device="cpu")
    return plan, model, shapes, plan.spec.arguments(model, kwargs)


def timer_of(ms: dict[str, float], calls: list | None = None):
    def timer(key, run):
        if calls is not None:
            calls.append(key)
        run()  # as the CUDA timer does: the candidate runs while it is timed
        return ms.get(key, 5.0)

    return timer


def test_the_fastest_candidate_within_its_bound_wins_and_every_timing_is_kept():
    plan, model, shapes, example = setup(precision="fp8", fp8_attention="auto")
    assert plan.attention_candidates == (*FP8, "split")
    calls = []
    got = choice.choose(plan, model, shapes, example, timer_of({"attention/fp8/2": 1.0}, calls))
    assert got.attention == "fp8/2" and got.how == "measured"
    assert calls == [f"attention/{n}" for n in plan.attention_candidates]
    assert set(got.ms) == {f"attention/{n}" for n in plan.attention_candidates}
    # real errors of the real (CPU fallback) ops against fp32: FP8 a few percent, the split path ~0
    assert all(0.005 < got.error[f"attention/{n}"] < choice.MAX_ERROR["fp8"] for n in FP8), got.error
    assert got.error["attention/split"] < 1e-5
    lowering = plan.lowering(shapes, got)
    assert lowering.fp8_attention and lowering.fp8_tile == 2
    slow_fp8 = choice.choose(plan, model, shapes, example, timer_of({"attention/split": 1.0}))
    assert slow_fp8.attention == "split" and not plan.lowering(shapes, slow_fp8).fp8_attention


def test_candidates_within_the_tie_count_as_equally_fast_and_the_most_exact_runs():
    """Timings 1 % apart are noise: the bf16 split path (exact) runs rather than an FP8 tiling that
    measured 1 % faster; 5 % faster is a real lead and wins."""
    plan, model, shapes, example = setup(precision="fp8", fp8_attention="auto")
    close = choice.choose(
        plan, model, shapes, example, timer_of({"attention/fp8/1": 0.99, "attention/split": 1.0})
    )
    assert close.attention == "split"
    ahead = choice.choose(
        plan, model, shapes, example, timer_of({"attention/fp8/1": 0.95, "attention/split": 1.0})
    )
    assert ahead.attention == "fp8/1"
    assert choice._fastest({}) is None


def test_a_wrong_candidate_is_left_out_however_fast(monkeypatch):
    plan, model, shapes, example = setup(precision="fp8", fp8_attention="auto")
    real = library._joint_fp8

    def broken_on_tile_1(q, k_a, v_a, mask_a, k_b, v_b, scale, tile=0):
        out = real(q, k_a, v_a, mask_a, k_b, v_b, scale, tile)
        return out * 1.5 if tile == 1 else out

    monkeypatch.setattr(library, "_joint_fp8", broken_on_tile_1)
    got = choice.choose(
        plan, model, shapes, example, timer_of({"attention/fp8/1": 0.1, "attention/fp8/3": 1.0})
    )
    assert got.attention == "fp8/3"
    assert "attention/fp8/1" not in got.ms
    assert "over its bound" in got.rejected["attention/fp8/1"]
    assert got.error["attention/fp8/1"] > 0.4


def test_a_candidate_that_raises_is_left_out_with_the_reason(monkeypatch):
    plan, model, shapes, example = setup()
    plan = plan.replace(attention_candidates=("cudnn", "split"))  # as with cuDNN's frontend installed
    real = library._padded_kernel

    def no_cudnn(kind, qkv, q_weight, t):
        raise RuntimeError("cudnnGraphNotSupportedError: no engine")

    monkeypatch.setattr(library, "_padded_kernel", no_cudnn)
    got = choice.choose(plan, model, shapes, example, timer_of({"attention/cudnn": 0.1}))
    assert got.attention == "split"
    assert got.rejected["attention/cudnn"].startswith("RuntimeError: cudnnGraphNotSupportedError")
    monkeypatch.setattr(library, "_padded_kernel", real)


def test_when_every_candidate_fails_the_first_runs_with_a_warning(monkeypatch, caplog):
    plan, model, shapes, example = setup()
    plan = plan.replace(attention_candidates=("cudnn",))

    def no_cudnn(kind, qkv, q_weight, t):
        raise RuntimeError("no engine")

    monkeypatch.setattr(library, "_padded_kernel", no_cudnn)
    with caplog.at_level("WARNING"):
        got = choice.choose(plan, model, shapes, example, timer_of({}))
    assert got.attention == "cudnn" and got.how == "the only candidates"
    assert "every attention candidate failed its measurement" in caplog.text and "no engine" in caplog.text


def test_the_mlp_gate_is_measured_fused_and_unfused_where_it_may_be_fused():
    plan, model, shapes, example = setup()
    plan = plan.replace(cudnn_frontend=True)  # the fused form's package (its CPU fallback runs here)
    assert plan.gate_candidates(shapes) == (True, False)
    fused = choice.choose(plan, model, shapes, example, timer_of({"gelu_gate/fused": 1.0}))
    unfused = choice.choose(plan, model, shapes, example, timer_of({"gelu_gate/unfused": 1.0}))
    assert fused.gelu_gate and plan.lowering(shapes, fused).gelu_gate
    assert not unfused.gelu_gate and not plan.lowering(shapes, unfused).gelu_gate
    assert fused.error["gelu_gate/fused"] < 1e-5 and set(fused.ms) >= {"gelu_gate/fused", "gelu_gate/unfused"}
    assert "MLP gate fused" in fused.describe() and "MLP gate unfused" in unfused.describe()


def test_flux_measures_its_dense_attention_kernels():
    plan, model, shapes, example = setup(
        model=make_flux(),
        batch=[1, 1],
        text_len=[8, 8],
        resolution=16,
        vae_scale_factor=1,
        aspect_bins=[],
        specialize=[[16, 16, 1]],
    )
    assert plan.attention_candidates == ("cudnn", "sdpa")
    got = choice.choose(plan, model, shapes, example, timer_of({"attention/sdpa": 1.0}))
    assert got.attention == "sdpa" and plan.lowering(shapes, got).dense_attention == "sdpa"
    assert got.error["attention/cudnn"] < 1e-5


def test_without_cuda_nothing_is_measured_and_the_report_says_so():
    from prx_compile import compile_prx

    model = make_prx()
    ct = compile_prx(
        model,
        backend="eager",
        device="cpu",
        static=True,
        batch=[1, 1],
        resolution=32,
        vae_scale_factor=1,
        text_len=[8, 8],
        aspect_bins=[],
        specialize=[[32, 32, 1]],
    )
    ct.build()
    kernels = ct.report()["kernels"]
    assert (
        kernels["how"] == "not measured (no CUDA)" and kernels["attention"] == ct.plan.attention_candidates[0]
    )
    assert ct.report()["engine_sets"][0]["kernels"] == kernels


@pytest.mark.parametrize("tile", range(len(fp8_attention.TILES)))
def test_the_lowering_passes_the_chosen_tiling_to_the_fp8_op(tile):
    """The rule retargets ``prx_attention`` and appends the tile; the op runs that tiling's blocks."""
    from .test_cudnn_attention import op_args

    g = torch.fx.Graph()
    args = [g.placeholder(f"a{i}") for i in range(7)]
    node = g.call_function(PRX_ATTENTION, (*args, 2, 1e-6, 0.25))
    g.output(node)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    plan, *_ = setup(precision="fp8", fp8_attention=True)
    lower(gm, plan.lowering(None, KernelChoice(f"fp8/{tile}", False, "test")))
    (op,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert op.target == PRX_ATTENTION_FP8 and (op.args[10:] == ((tile,) if tile else ()))
    a = op_args(seq=200, t=70)  # more tokens than one block of any tiling
    got = PRX_ATTENTION_FP8(*a, tile)
    bm, bn = fp8_attention.TILES[tile][:2]
    q, k, v, tk, tv = _normed(a)
    want = fp8_attention.joint_attention_fp8_torch(q, tk, tv, a[2], k, v, a[-1], tile)
    torch.testing.assert_close(got, want.reshape(got.shape), rtol=0, atol=0)
    if (bm, bn) != fp8_attention.TILES[0][:2]:  # its own quantisation blocks: another rounding
        assert not torch.equal(got, PRX_ATTENTION_FP8(*a, 0))


def _normed(a):
    """The norms and RoPE of ``prx_attention``'s inputs ``a`` (op_args), as the op computes them."""
    img_qkv, txt_kv, mask, rope, qw, kw, tw, h, eps, _ = a
    b, seq, _ = img_qkv.shape
    d = qw.shape[0]
    qkv, kv = img_qkv.reshape(b, seq, 3, h, d), txt_kv.reshape(b, -1, 2, h, d)
    r = rope[:, 0]
    q = library.qk_norm_rope_torch(qkv[:, :, 0], qw, eps, r)
    k = library.qk_norm_rope_torch(qkv[:, :, 1], kw, eps, r)
    tk = library.qk_norm_rope_torch(kv[:, :, 0], tw, eps)
    return q, k, qkv[:, :, 2], tk, kv[:, :, 1]


@pytest.mark.parametrize(
    "record, message",
    [
        ({"attention": "fp8/9"}, "not a kernel prx_compile has"),
        ({"attention": "x" * 41}, "attention"),
        ({"gelu_gate": "yes"}, "gelu_gate"),
        ({"ms": {"attention/split": math.nan}}, "ms"),
        ({"ms": {f"k{i}": 1.0 for i in range(33)}}, "ms"),
        ({"rejected": {"a": "y" * 301}}, "rejected"),
        ({"seconds": {"attention/split": math.inf}}, "seconds"),
        ({"seconds": {f"k{i}": 1.0 for i in range(33)}}, "seconds"),
        ({"seconds": [1.0]}, "seconds"),
        ({"extra": 1}, "extra"),
    ],
)
def test_a_recorded_choice_is_validated_before_use(record, message):
    """An artifact's (or the engine cache's) kernel record is untrusted: one ValueError naming it."""
    good = KernelChoice(
        "split", False, "measured", {"attention/split": 1.0}, {"attention/split": 0.0}
    ).to_json()
    assert KernelChoice.from_json(good).attention == "split"
    assert KernelChoice.from_json({**good, "attention": "flash4"}).attention == "flash4"  # built elsewhere
    old = {k: v for k, v in good.items() if k != "seconds"}  # 0.18 recorded no seconds
    assert KernelChoice.from_json(old).seconds == {}
    with pytest.raises(ValueError, match=message):
        KernelChoice.from_json({**good, **record})


def test_the_candidates_that_compile_run_once_side_by_side_before_their_checks(monkeypatch):
    """The FP8 tilings (Triton) and FlashAttention-4 (CuTe DSL) compile at their first call: they run
    once together, each in a thread of its own, so the compilations overlap; then each is checked and
    timed as before. One that raises there is still checked (and left out for what it raises then)."""
    plan, model, shapes, example = setup(precision="fp8", fp8_attention="auto")
    assert [n for n in plan.attention_candidates if choice.compiles(n)] == list(FP8)
    seen, together = set(), []
    barrier = threading.Barrier(len(FP8), timeout=10)  # passes only if all run at once
    real = choice._Bench.candidate

    def candidate(self, group, name):
        fn, bound = real(self, group, name)

        def run():
            if name not in seen and choice.compiles(name):
                seen.add(name)
                assert threading.current_thread().name.startswith("prx-kernel-warm-up")
                barrier.wait()
                together.append(name)
                if name == "fp8/1":
                    raise RuntimeError("a transient failure in the warm-up")
            return fn()

        return run, bound

    monkeypatch.setattr(choice._Bench, "candidate", candidate)
    got = choice.choose(plan, model, shapes, example, timer_of({"attention/fp8/1": 1.0}))
    assert sorted(together) == sorted(FP8)
    assert got.attention == "fp8/1" and not got.rejected  # checked and timed after its warm-up raised
    assert got.seconds["attention/warm-up"] > 0 and "attention/split" in got.seconds


def test_the_gate_is_measured_alone_and_the_attention_in_a_thread_with_a_retry_of_what_raised(monkeypatch):
    """A TensorRT set measures the MLP gate before its export (its engines depend on it) and runs and
    checks the attention candidates in a thread while its engines build, timing them after the build,
    alone; a candidate that raised there is measured once more, alone, after the thread: a transient
    failure does not leave it out, a real one does."""
    plan, model, shapes, example = setup()
    plan = plan.replace(cudnn_frontend=True, attention_candidates=("cudnn", "split"))
    calls = []
    m = choice.Measurement(plan, model, shapes, example, timer_of({"gelu_gate/unfused": 1.0}, calls))
    assert m.gate_to_measure and m.gate() is False and calls == ["gelu_gate/fused", "gelu_gate/unfused"]
    real, failures = library._padded_kernel, [RuntimeError("KeyError: 'custom'")]

    def flaky(kind, qkv, q_weight, t):  # raises once (beside the build), then runs
        if failures:
            raise failures.pop()
        return real(kind, qkv, q_weight, t)

    monkeypatch.setattr(library, "_padded_kernel", flaky)
    m.start_attention()
    m.thread.join()
    assert calls[2:] == []  # beside the build the candidates run and are checked, never timed
    assert set(m.errors) == {"gelu_gate/fused", "gelu_gate/unfused", "attention/split"}
    got = m.result()
    assert calls[2:] == ["attention/cudnn", "attention/split"]  # cudnn raised, ran alone; then both timed
    assert (got.attention, got.gelu_gate, got.how) == ("cudnn", False, "measured") and not got.rejected
    timed = {k for k in calls if "/" in k}
    assert set(got.seconds) == {*timed, "gelu_gate/reference", "attention/reference"}

    def broken(kind, qkv, q_weight, t):
        raise RuntimeError("cudnnGraphNotSupportedError")

    monkeypatch.setattr(library, "_padded_kernel", broken)
    m = choice.Measurement(plan, model, shapes, example, timer_of({"attention/cudnn": 0.1}))
    m.gate()
    m.start_attention()
    got = m.result()
    assert got.attention == "split" and "cudnnGraphNotSupportedError" in got.rejected["attention/cudnn"]
    on_cpu = choice.Measurement(plan, model, shapes, example)  # no CUDA, no timer: nothing measured
    assert not on_cpu.gate_to_measure and on_cpu.gate() is True
    assert on_cpu.result().how == "not measured (no CUDA)"


def test_the_kernel_rules_retarget_the_attention_in_a_built_module_alone():
    """``lower(kernels=False)`` leaves ``prx_attention`` for the engines' build; ``lower_kernels``
    then retargets it in every graph of the partitioned module (its PyTorch segments are child
    graphs) to the measured kernel, and the step computes the same numbers."""
    from prx_compile.lowering import lower_kernels
    from prx_compile.ops import PRX_ATTENTION_CUDNN

    from .test_cudnn_attention import op_args

    g = torch.fx.Graph()
    args = [g.placeholder(f"a{i}") for i in range(7)]
    g.output(g.call_function(PRX_ATTENTION, (*args, 2, 1e-6, 0.25)))
    segment = torch.fx.GraphModule(torch.nn.Module(), g)
    top = torch.fx.Graph()
    ins = [top.placeholder(f"a{i}") for i in range(7)]
    top.output(top.call_module("_run_on_gpu_0", tuple(ins)))
    root = torch.nn.Module()
    root._run_on_gpu_0 = segment
    gm = torch.fx.GraphModule(root, top)
    plan, *_ = setup()
    plan = plan.replace(attention_candidates=("cudnn", "split"))
    lower(segment, plan.lowering(None, KernelChoice("cudnn", False, "test")), kernels=False)
    assert [n.target for n in segment.graph.nodes if n.op == "call_function"] == [PRX_ATTENTION]
    a = op_args(seq=64, t=16)[:7]
    before = gm(*a)
    lower_kernels(gm, plan.lowering(None, KernelChoice("cudnn", False, "test")))
    assert [n.target for n in gm._run_on_gpu_0.graph.nodes if n.op == "call_function"] == [
        PRX_ATTENTION_CUDNN
    ]
    torch.testing.assert_close(gm(*a), before)  # the CPU runs cuDNN's named fallback: the same op
