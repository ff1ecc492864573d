"""compile_prx as a drop-in for pipe.transformer, on the CPU backends (eager, inductor)."""

import sys

import pytest
import torch

from prx_compile import (
    BackendUnavailableError,
    CompiledTransformer,
    ConfigError,
    ShapeOutOfRangeError,
    compile_prx,
)
from prx_compile.tools.testing import make_prx, tiny_pipeline

from .conftest import eager, prx_inputs

SMALL_RANGE = dict(batch=[1, 2], text_len=[1, 16], resolution=16, aspect_bins=[], vae_scale_factor=1)
PIPE_RANGE = {**SMALL_RANGE, "resolution": 32}
#: planned sets at latent 16x16 (batch 2 and 1), the range latent 10..22 x 10..22
WIDE_RANGE = {**SMALL_RANGE, "resolution": 256, "aspect_bins": [256], "vae_scale_factor": 16}
PIPE_ARGS = dict(
    prompt="a red car on the moon at night",
    negative_prompt="",
    num_inference_steps=3,
    guidance_scale=4.0,
    height=32,
    width=32,
    output_type="latent",
    use_resolution_binning=False,
)


def generate(pipe):
    return pipe(**PIPE_ARGS, generator=torch.Generator().manual_seed(0)).images


@pytest.fixture(scope="module")
def pipe():
    p = tiny_pipeline()
    p.set_progress_bar_config(disable=True)
    return p


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_drop_in_for_prx_pipeline(pipe, backend):
    original = pipe.transformer
    ref = generate(pipe)
    try:
        pipe.transformer = compile_prx(original, backend=backend, **PIPE_RANGE)
        assert isinstance(pipe.transformer, CompiledTransformer)
        assert pipe.transformer.config is original.config and pipe.transformer.dtype == torch.float32
        out = generate(pipe)
    finally:
        pipe.transformer = original
    # guidance doubles the batch to 2 and the empty negative prompt masks most text tokens
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_kwargs_return_dict_and_no_mask():
    model = make_prx()
    ct = compile_prx(model, backend="eager", **SMALL_RANGE)
    kw = prx_inputs(model, h=16, w=16)
    out = ct(**kw)
    assert out.sample.shape == (2, 4, 16, 16)
    assert torch.equal(out.sample, ct(**kw, return_dict=False)[0])
    kw["attention_mask"] = None
    torch.testing.assert_close(ct(**kw, return_dict=False)[0], eager(model, kw), rtol=0, atol=1e-5)
    kw["timestep"] = kw["timestep"][:1]  # a single timestep broadcasts, as in eager
    torch.testing.assert_close(ct(**kw, return_dict=False)[0], eager(model, kw), rtol=0, atol=1e-5)


def test_the_most_specific_engine_set_runs_and_is_built_at_first_use():
    model = make_prx()
    # 16² at batch 2 and 1 (16 tokens), the range (built at the first shape it alone takes)
    ct = compile_prx(model, backend="eager", auto_specialize=0, **SMALL_RANGE)
    assert [b.shapes.is_static() for b in ct.backends] == [True, True, False]
    assert not any(b.is_built for b in ct.backends)
    kw = prx_inputs(model, h=16, w=16, text=16)
    assert ct.engine_set_for(kw) is ct.backends[0]  # named without building anything
    assert ct.engine_set_for(prx_inputs(model, batch=3, h=16, w=16)) is None
    assert not any(b.is_built for b in ct.backends)
    torch.testing.assert_close(ct(**kw, return_dict=False)[0], eager(model, kw), rtol=0, atol=1e-5)
    assert [b.is_built for b in ct.backends] == [True, False, False]
    kw = prx_inputs(model, h=16, w=16, text=9)  # text length 9: only the range fits
    assert ct.engine_set_for(kw) is ct.backends[2]
    torch.testing.assert_close(ct(**kw, return_dict=False)[0], eager(model, kw), rtol=0, atol=1e-5)
    assert [b.is_built for b in ct.backends] == [True, False, True] and ct.builds == 2
    ct.build()  # the rest, ahead
    assert ct.is_built and ct.builds == 3


def test_new_shapes_in_the_range_get_static_sets_until_auto_specialize_then_the_range_set(caplog):
    """auto_specialize: 2 (the default): the first two shapes inside the range that specialize does
    not name get static sets of their own; the third builds the range set, which then serves every
    new shape; a batch chunk of a new shape counts as that shape; each output matches eager."""
    model = make_prx()
    ct = compile_prx(model, backend="eager", **WIDE_RANGE)
    assert ct.compile_config.auto_specialize == 2
    planned = [b.shapes.describe() for b in ct.backends]

    def run(**shape):
        kw = prx_inputs(model, **shape, masked=2)
        torch.testing.assert_close(ct(**kw, return_dict=False)[0], eager(model, kw), rtol=0, atol=1e-5)

    with caplog.at_level("INFO", logger="prx_compile.runtime"):
        run(batch=2, h=20, w=12, text=16)
        run(batch=4, h=20, w=12, text=16)  # split 2 + 2 onto the set just made: no new set
        run(batch=1, h=12, w=20, text=9)
    made = ["batch 2, latent 20x12, text 16 tokens", "batch 1, latent 12x20, text 9 tokens"]
    assert [b.shapes.describe() for b in ct.backends] == planned + made
    assert [b.is_built for b in ct.backends] == [False, False, False, True, True] and ct.builds == 2
    assert sum("auto_specialize: 1 of 2" in r.message for r in caplog.records) == 1
    assert sum("auto_specialize: 2 of 2" in r.message for r in caplog.records) == 1
    run(batch=2, h=16, w=20, text=16)  # the third new shape: the range set
    run(batch=1, h=14, w=14, text=5)  # and it serves the next
    assert [b.shapes.describe() for b in ct.backends] == planned + made
    assert [b.is_built for b in ct.backends] == [False, False, True, True, True] and ct.builds == 3
    run(batch=2, h=16, w=16, text=16)  # a specialize shape still gets its planned set
    assert ct.backends[0].is_built and len(ct.backends) == 5 and ct.builds == 4


def test_auto_specialize_is_checked_and_needs_a_range_to_act():
    with pytest.raises(ConfigError, match=r"auto_specialize=-1 must be an integer from 0 to 256"):
        compile_prx(make_prx(), backend="eager", auto_specialize=-1, **WIDE_RANGE)
    with pytest.raises(ConfigError, match=r"auto_specialize=True must be an integer"):
        compile_prx(make_prx(), backend="eager", auto_specialize=True, **WIDE_RANGE)
    model = make_prx()
    ct = compile_prx(model, backend="eager", auto_specialize=0, **WIDE_RANGE)
    kw = prx_inputs(model, batch=2, h=20, w=12, text=16)
    torch.testing.assert_close(ct(**kw, return_dict=False)[0], eager(model, kw), rtol=0, atol=1e-5)
    assert len(ct.backends) == 3 and ct.backends[2].is_built  # the range set, at once
    ct = compile_prx(model, backend="eager", **WIDE_RANGE)
    ct.build()  # every planned set, the range set too: new shapes then run on it
    ct(**kw, return_dict=False)
    assert len(ct.backends) == 3 and ct.builds == 3


def test_on_shape_miss_error_names_the_sets():
    model = make_prx()
    ct = compile_prx(model, backend="eager", on_shape_miss="error", **SMALL_RANGE)
    with pytest.raises(
        ShapeOutOfRangeError, match=r"batch 3 not in \[1, 2\].*Built for: batch 2, latent 16x16"
    ):
        ct(**prx_inputs(model, batch=3, h=16, w=16), return_dict=False)
    with pytest.raises(ShapeOutOfRangeError, match="latent height 18 not in"):
        ct(**prx_inputs(model, h=18, w=16), return_dict=False)
    with pytest.raises(ShapeOutOfRangeError, match="not a multiple of the patch size") as e:
        compile_prx(model, backend="eager", **SMALL_RANGE)(**prx_inputs(model, h=17, w=16), return_dict=False)
    # no on_shape_miss setting builds for that size: the hint is the size that works, not that setting
    assert "multiples of 2 pixels" in str(e.value) and "on_shape_miss" not in str(e.value)


def test_a_batch_no_set_takes_whole_runs_in_chunks_the_sets_take(caplog, monkeypatch):
    """on_shape_miss: split: batch 5 at a covered latent size and text length runs as 2 + 2 + 1
    through the sets there (no build), matches eager, and warns once for the shape."""
    model = make_prx()
    ct = compile_prx(model, backend="eager", on_shape_miss="split", **SMALL_RANGE)
    kw = prx_inputs(model, batch=5, h=16, w=16, text=16, masked=3)
    sets = [b.shapes.describe() for b in ct.backends]
    seen = []
    (kind,) = {type(b) for b in ct.backends}
    call = kind.__call__
    monkeypatch.setattr(
        kind, "__call__", lambda be, **k: seen.append(k["hidden_states"].shape[0]) or call(be, **k)
    )
    with caplog.at_level("WARNING", logger="prx_compile.runtime"):
        out = ct(**kw, return_dict=False)[0]  # builds the two static sets (b2, b1) on the way
        seen.clear()
        again = ct(**kw, return_dict=False)[0]
    assert seen == [2, 2, 1]
    assert [b.is_built for b in ct.backends] == [True, True, False]  # the static sets, not the range
    assert [b.shapes.describe() for b in ct.backends] == sets  # no set added
    ref = eager(model, kw)
    assert (ref - eager(model, {k: v[:1] for k, v in kw.items()}).repeat(5, 1, 1, 1)).abs().max() > 1e-3
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert torch.equal(out, again)
    warned = [r.message for r in caplog.records if "runs as batches of 2 + 2 + 1" in r.message]
    assert len(warned) == 1 and "batch 5, latent 16x16, text 16 tokens" in warned[0]


@pytest.mark.parametrize("mode", ["build", "split"])
def test_a_batch_miss_gets_a_set_of_its_own_with_build_or_where_no_split_exists(mode):
    """build builds for a batch-only miss; split (the default) too where no set takes a chunk (the
    static preset's one b2 set cannot take the remaining 1 of batch 3)."""
    model = make_prx()
    overrides = {"on_shape_miss": mode} if mode == "build" else {}
    shapes = SMALL_RANGE if mode == "build" else {**SMALL_RANGE, "static": True, "specialize": [[16, 16, 2]]}
    ct = compile_prx(model, backend="eager", **shapes, **overrides)
    assert ct.compile_config.on_shape_miss == mode
    kw = prx_inputs(model, batch=3, h=16, w=16, text=16)
    if mode == "split":
        assert ct.sets.chunks(kw) is None  # 2 is taken, the 1 left is not
    torch.testing.assert_close(ct(**kw, return_dict=False)[0], eager(model, kw), rtol=0, atol=1e-5)
    assert ct.backends[-1].shapes.describe() == "batch 3, latent 16x16, text 16 tokens"


def test_on_shape_miss_build_adds_an_engine_set(caplog):
    model = make_prx()
    ct = compile_prx(model, backend="eager", on_shape_miss="build", **SMALL_RANGE)
    kw = prx_inputs(model, batch=3, h=20, w=12)
    with caplog.at_level("WARNING", logger="prx_compile.runtime"):
        out = ct(**kw, return_dict=False)[0]
    torch.testing.assert_close(out, eager(model, kw), rtol=0, atol=1e-5)
    assert ct.builds == 1 and ct.backends[-1].shapes.describe() == "batch 3, latent 20x12, text 12 tokens"
    assert any(
        "built engines for batch 3, latent 20x12, text 12 tokens in" in r.message for r in caplog.records
    )


@pytest.mark.parametrize(
    "change,error,match",
    [
        (
            lambda kw: kw.update(hidden_states=kw["hidden_states"][:, :3]),
            ShapeOutOfRangeError,
            r"expected \(B, 4, H, W\)",
        ),
        (
            lambda kw: kw.update(hidden_states=kw["hidden_states"][0]),
            ShapeOutOfRangeError,
            "hidden_states has shape",
        ),
        (
            lambda kw: kw.update(encoder_hidden_states=kw["encoder_hidden_states"][..., :5]),
            ShapeOutOfRangeError,
            r"expected \(B, T, 32\)",
        ),
        (
            lambda kw: kw.update(attention_mask=kw["attention_mask"][:, :3]),
            ShapeOutOfRangeError,
            "attention_mask has shape",
        ),
        (lambda kw: kw.update(timestep=kw["timestep"][:0]), ShapeOutOfRangeError, "timestep has shape"),
        (
            lambda kw: kw.update(hidden_states=kw["hidden_states"].double()),
            ConfigError,
            "hidden_states is torch.float64",
        ),
        (lambda kw: kw.update(encoder_hidden_states="text"), ShapeOutOfRangeError, "must be a tensor"),
    ],
)
def test_bad_inputs_are_named(change, error, match):
    model = make_prx()
    ct = compile_prx(model, backend="eager", **SMALL_RANGE)
    kw = prx_inputs(model, h=16, w=16)
    change(kw)
    with pytest.raises(error, match=match):
        ct(**kw, return_dict=False)
    assert ct.builds == 0


@pytest.mark.parametrize("weights", ["inputs", "engine"])
def test_weights_modes_read_the_live_parameters(weights):
    model = make_prx()
    ct = compile_prx(model, backend="eager", weights=weights, **SMALL_RANGE)
    kw = prx_inputs(model, h=16, w=16)
    before = ct(**kw, return_dict=False)[0]
    with torch.no_grad():
        model.blocks[0].attention.to_out[0].weight.mul_(1.5)
    after = ct(**kw, return_dict=False)[0]
    assert (after - before).abs().max() > 1e-4
    torch.testing.assert_close(after, eager(model, kw), rtol=0, atol=1e-5)


def test_inductor_runs_with_and_without_no_grad():
    model = make_prx()
    ct = compile_prx(
        model,
        backend="inductor",
        static=True,
        specialize=[[16, 16, 2]],
        **{k: v for k, v in SMALL_RANGE.items()},
    )
    kw = prx_inputs(model, h=16, w=16, text=16)
    out = ct(**kw, return_dict=False)[0]  # the first call builds, with autograd on
    with torch.no_grad():
        again = ct(**kw, return_dict=False)[0]
    torch.testing.assert_close(out, again, rtol=0, atol=0)
    torch.testing.assert_close(out, eager(model, kw), rtol=1e-4, atol=1e-4)


def test_config_errors():
    model = make_prx()
    with pytest.raises(ConfigError, match="unknown key"):
        compile_prx(model, backend="eager", batchsize=2)
    with pytest.raises(ConfigError, match="the transformer is torch.float32 but config.dtype is 'bf16'"):
        compile_prx(model, config="prx-512-bf16", backend="eager")
    with pytest.raises(ConfigError, match="attention_kwargs"):
        compile_prx(model, backend="eager", **SMALL_RANGE)(
            **prx_inputs(model, h=16, w=16), attention_kwargs={"s": 1}
        )


def test_tensorrt_without_gpu_says_how_to_install(monkeypatch):
    from prx_compile.backends.tensorrt import shim

    model = make_prx()
    shim.torch_tensorrt.cache_clear()
    if not torch.cuda.is_available():
        with pytest.raises(
            BackendUnavailableError, match=r"needs a CUDA GPU.*pip install 'prx_compile\[tensorrt\]'"
        ):
            compile_prx(model)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "torch_tensorrt", None)  # import fails as on a machine without it
    shim.torch_tensorrt.cache_clear()
    with pytest.raises(BackendUnavailableError, match=r"needs Torch-TensorRT.*backend='inductor' or 'eager'"):
        compile_prx(model, device="cpu")
    shim.torch_tensorrt.cache_clear()


def test_a_failed_build_on_a_shape_miss_leaves_no_set_behind(monkeypatch):
    from prx_compile.backends.pytorch import TorchBackend

    model = make_prx()
    ct = compile_prx(model, backend="eager", **SMALL_RANGE)
    n = len(ct.backends)

    def boom(self, example):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(TorchBackend, "build", boom)
    with pytest.raises(RuntimeError, match="out of memory"):
        ct(**prx_inputs(model, batch=3, h=16, w=16), return_dict=False)
    assert len(ct.backends) == n


def test_empty_inputs_and_peft_layers_are_refused():
    model = make_prx()
    ct = compile_prx(model, backend="eager", **SMALL_RANGE)
    with pytest.raises(ShapeOutOfRangeError, match="empty input"):
        ct(**prx_inputs(model, batch=0, h=16, w=16), return_dict=False)
    model.peft_config = {"default": object()}  # what PEFT leaves on a model it injected layers into
    with pytest.raises(ConfigError, match="PEFT adapters.*load the LoRA on the compiled pipeline"):
        ct(**prx_inputs(model, h=16, w=16), return_dict=False)
    with pytest.raises(ConfigError, match="holds PEFT adapters"):  # before a compile, too
        compile_prx(model, backend="eager", **SMALL_RANGE)


def test_report_says_where_each_sets_first_call_went(capsys):
    from prx_compile import progress

    model = make_prx()
    ct = compile_prx(model, backend="eager", static=True, specialize=[[16, 16, 2]], **SMALL_RANGE)
    with progress.reporting(True):
        out = ct(**prx_inputs(model, text=16), return_dict=False)[0]
    assert (out - eager(model, prx_inputs(model, text=16))).abs().max() <= 1e-5
    (only,) = ct.report()["engine_sets"]
    times = only["timings"]
    assert set(times) == {"export_s", "kernels_s", "lower_s", "compile_s", "first_run_s"}, times
    assert all(v >= 0 for v in times.values()) and times["export_s"] > 0
    assert only["build_s"] >= times["export_s"] + times["lower_s"]
    assert only["slowest_engines"] == {}  # no TensorRT engine was built (the GPU tests check them)
    err = capsys.readouterr().err
    assert "export (" in err and "first step (" in err
    ct(**prx_inputs(model, text=16, seed=1), return_dict=False)  # a later call times nothing more
    assert ct.report()["engine_sets"][0]["timings"] == times


def test_every_backend_reports_the_same_typed_fields():
    from prx_compile.backends.base import SetReport

    compiled = compile_prx(make_prx(), backend="eager", static=True, **SMALL_RANGE).build()
    report = compiled.backends[0].report()
    assert set(report) == set(SetReport.__annotations__), report
    assert (report["engines"], report["torch_segments"], compiled.report()["engine_calls"]) == (0, 1, 0)


def test_once_every_cuda_graph_is_dropped_the_next_capture_gets_a_new_pool():
    """PyTorch refuses to capture into a pool id whose graphs are all gone (``use_count > 0``), so
    the module forgets the pool then; while one runner still holds a graph the pool is kept."""
    from prx_compile.runtime.cudagraphs import CUDAGraphRunner

    ct = compile_prx(make_prx(), backend="eager", static=True, **SMALL_RANGE)
    a, b = CUDAGraphRunner(lambda: None, pool="p0"), CUDAGraphRunner(lambda: None, pool="p0")
    a.graphs["k"], b.graphs["k"] = "graph a", "graph b"
    ct.sets.graphs, ct.sets.pool = {1: a, 2: b}, "p0"
    ct.sets.drop_graphs([a])
    assert (a.graphs, b.graphs, ct.sets.pool) == ({}, {"k": "graph b"}, "p0")  # b shares the pool still
    ct.sets.drop_graphs()
    assert (b.graphs, ct.sets.pool) == ({}, None)
    b.graphs["k"], ct.sets.pool = "graph b", "p1"
    ct.sets.drop_graphs([])
    assert ct.sets.pool == "p1"  # b's graph is still in it
    ct.sets.graphs.pop(2)  # a range set dropped with its runner
    ct.sets.drop_graphs([])  # what is left holds no graph
    assert ct.sets.pool is None


class _CapturedGraph:
    """Stands in for a CUDA graph runner holding a graph for the call's inputs: what ``replay``
    returns, and how often it replayed (``_replay_ahead``'s decisions on a CPU; the real graphs are
    tests/gpu/test_module_contract_gpu.py's)."""

    def __init__(self):
        self.out, self.calls, self.graphs = torch.full((1,), 7.0), 0, {}

    def reset(self):
        self.graphs.clear()

    def replay(self, inputs):
        if not self.graphs:
            return None
        self.calls += 1
        return self.out


@pytest.mark.parametrize("precision", ["dtype", "fp8"])
def test_a_step_replays_before_the_change_check_only_where_that_is_safe(precision, monkeypatch):
    """A captured step replays before the transformer is checked; a change found then voids it
    (``replays_dropped``) and the call follows it; a tensor whose storage moved stops the replay
    before it starts (the graph would read memory no tensor may hold)."""
    model = make_prx()
    ct = compile_prx(
        model, backend="eager", static=True, precision=precision, fp8_attention=False, **SMALL_RANGE
    )
    kw = prx_inputs(model, text=16)
    inputs = ct._inputs((), kw)
    runner = _CapturedGraph()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    def ahead(follow_first=False):  # _replay_ahead as on a GPU, with the stand-in graph
        if follow_first:
            ct(**kw)  # a real call: runs the set and follows whatever changed
            runner.graphs["inputs"] = "graph"
            ct.sets.graphs[id(ct.engine_set_for(inputs))] = runner
        ct.sets.device = torch.device("cuda")
        try:
            return ct._replay_ahead(inputs)
        finally:
            ct.sets.device = torch.device("cpu")

    assert ahead(follow_first=True) is runner.out and (runner.calls, ct.replays_dropped) == (1, 0)
    layer = model.blocks[0].attention.to_out[0]
    with torch.no_grad():
        layer.weight.mul_(1.5)  # read live with weights: inputs; FP8 copies must be requantised first
    fp8 = precision == "fp8"
    assert (ahead() is None, runner.calls, ct.replays_dropped) == (fp8, 2, int(fp8))
    old = model.blocks[1].down_proj
    model.blocks[1].down_proj = torch.nn.Linear(old.in_features, old.out_features)
    assert ahead() is None  # replayed on the old layer (the watch holds it), then voided
    assert (runner.calls, ct.replays_dropped) == (3, 1 + fp8)
    assert ahead(follow_first=True) is runner.out and runner.calls == 4
    layer.weight.data = layer.weight.data.clone()  # a new storage: not replayed at all
    assert ahead() is None and (runner.calls, ct.replays_dropped) == (4, 1 + fp8)
    ct._ahead = False
    assert ahead(follow_first=True) is None and runner.calls == 4
    ct._ahead = True
    ref = eager(model, kw)
    got = ct(**kw, return_dict=False)[0]
    torch.testing.assert_close(got, ref, rtol=0, atol=(0.05 if fp8 else 1e-5) * ref.abs().max().item())
