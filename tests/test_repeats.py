"""Repeated pieces: the partitions of a PRX step between its attention ops key alike exactly when
they compute the same thing, and ``SharedEngines`` converts each distinct one once."""

import functools

import pytest
import torch
from torch.fx.passes.split_module import split_module

from prx_compile.backends.tensorrt.repeats import SharedEngines, structure_key
from prx_compile.export import export_step
from prx_compile.lowering import LoweringSettings, lower
from prx_compile.models.prx import INPUTS
from prx_compile.ops import LINEAR, PRX_ATTENTION
from prx_compile.tools.testing import TINY_PRX, make_prx

from .conftest import RANGE, eager, plan_of, prx_inputs

DEPTH = 4


@functools.cache
def _exported(depth: int, seed: int):
    """(model, ExportedProgram) of the tiny PRX at ``depth``, exported once for every test here (the
    export does not depend on the lowering settings; each use lowers a fresh ``ep.module()``)."""
    model = make_prx({**TINY_PRX, "depth": depth}, seed=seed)
    ep, _ = export_step(model, prx_inputs(model), RANGE, weights="inputs", fuse_attention=True)
    return model, ep


def partitions(settings: LoweringSettings, depth: int = DEPTH, seed: int = 0):
    """The tiny PRX's lowered step (weights as inputs) cut the way Torch-TensorRT cuts it: each op
    kept in PyTorch alone, the runs between them one partition each. Returns (model, root, [(name,
    partition)]) with only the runs (what would become engines), in graph order."""
    model, ep = _exported(depth, seed)
    gm = lower(ep.module(), settings)
    for node in [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]:
        gm.graph.erase_node(node)  # torch.export's input guards (not in what Torch-TensorRT partitions)
    kept = {PRX_ATTENTION, LINEAR} if settings.linears_in_torch else {PRX_ATTENTION}
    part, ids = [0], {}
    for node in gm.graph.nodes:  # a new partition around every kept op
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target in kept:
            part[0] += 1
            ids[node] = part[0]
            part[0] += 1
        else:
            ids[node] = part[0]
    root = split_module(gm, model, lambda n: ids[n])
    root.graph._codegen = gm.graph._codegen  # called with the step's kwargs, as the model is
    root.recompile()
    runs = []
    for name, sub in root.named_children():
        ops = {n.target for n in sub.graph.nodes if n.op == "call_function"}
        if not ops & kept:
            runs.append((name, sub))
    return model, gm, root, runs


def keys(runs):
    return [structure_key(sub, _specs(sub)) for _, sub in runs]


def _specs(sub):
    return [n.meta.get("val") for n in sub.graph.nodes if n.op == "placeholder" and "val" in n.meta]


def test_the_blocks_between_attention_ops_key_alike():
    model, gm, root, runs = partitions(LoweringSettings(attention="flash"))
    ks = keys(runs)
    assert None not in ks
    # before block 0's attention; after block i's attention up to block i+1's (DEPTH-1 alike); the end
    assert len(runs) == DEPTH + 1
    assert len(set(ks[1:DEPTH])) == 1
    assert len(set(ks)) == 3
    # the cut graph still computes the step: the split is the one the keys were taken on
    kw = prx_inputs(model)
    from prx_compile.export import weight_tensors

    with torch.no_grad():
        out = root(**kw, weights=list(weight_tensors(model).values()))
    ref = eager(model, kw)
    assert (out - ref).abs().max() <= 1e-5


def test_a_range_set_with_linears_in_pytorch_has_few_distinct_pieces():
    _, _, _, runs = partitions(LoweringSettings(attention="flash", linears_in_torch=True))
    ks = keys(runs)
    assert len(runs) > 3 * DEPTH  # the pieces between a block's linears
    per_block = len(set(ks))
    assert per_block < len(runs) / 2
    # the same model one block deeper adds runs but no distinct piece
    _, _, _, deeper = partitions(LoweringSettings(attention="flash", linears_in_torch=True), depth=DEPTH + 1)
    assert len(deeper) > len(runs)
    assert len(set(keys(deeper))) == per_block


def test_keys_see_ops_shapes_and_constants_not_names():
    _, _, _, runs = partitions(LoweringSettings(attention="flash"))
    a, b = runs[1][1], runs[2][1]
    assert structure_key(a, _specs(a)) == structure_key(b, _specs(b))
    # another input shape
    spec = _specs(a)
    assert structure_key(a, [torch.empty(3, 5)] + spec[1:]) != structure_key(a, spec)
    # another op: the first mul becomes an add
    c = runs[2][1]
    node = next(n for n in c.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.mul.Tensor)
    node.target = torch.ops.aten.add.Tensor
    c.recompile()
    assert structure_key(c, _specs(c)) != structure_key(a, spec)
    # a constant's value counts; a constant too large to hash makes the piece unique
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.ops.aten.add.Tensor, (x, g.get_attr("k"))))
    one, two = torch.nn.Module(), torch.nn.Module()
    one.register_buffer("k", torch.ones(4))
    two.register_buffer("k", torch.full((4,), 2.0))
    gm1, gm2 = torch.fx.GraphModule(one, g), torch.fx.GraphModule(two, g)
    same = torch.fx.GraphModule(one, g)
    assert structure_key(gm1) == structure_key(same) != structure_key(gm2)
    big = torch.nn.Module()
    big.register_buffer("k", torch.zeros(5 * 2**20))
    assert structure_key(torch.fx.GraphModule(big, g)) is None


def test_shared_engines_converts_each_distinct_piece_once():
    _, _, _, runs = partitions(LoweringSettings(attention="flash"))
    calls = []

    def convert(module, inputs, *, settings=None, name="", engine_cache=None):
        calls.append(name)
        return torch.nn.Identity()

    sharing = SharedEngines().wrap(convert)
    got = {name: sharing(sub, _specs(sub), settings=None, name=name, engine_cache=None) for name, sub in runs}
    assert calls == [runs[0][0], runs[1][0], runs[-1][0]]
    assert sharing.built == calls
    assert sharing.shared == {name: runs[1][0] for name, _ in runs[2:DEPTH]}
    assert all(got[name] is got[runs[1][0]] for name, _ in runs[2:DEPTH])
    assert got[runs[0][0]] is not got[runs[1][0]]
    for name, sub in (runs[0], runs[1]):  # which ops each built piece holds (engine_build_s)
        targets = [n.target for n in sub.graph.nodes if n.op == "call_function"]
        assert sum(sharing.ops[name].values()) == len(targets) > 0
        assert sharing.ops[name][str(targets[0]).removeprefix("aten.")] == targets.count(targets[0])
    assert set(sharing.ops) == set(calls)
    with pytest.raises(RuntimeError, match="wrap"):
        SharedEngines()(runs[0][1], [], name="x")


class StandIn(torch.nn.Module):
    """Stands in for a built engine module in a partitioned graph (it is not TensorRT): a fixed
    function with the attributes a saved state reads."""

    def __init__(self, scale: float, blob: bytes):
        super().__init__()
        self.scale, self.serialized_engine = scale, blob
        self.input_names, self.output_names = ["x", "w"], ["y"]
        self.record = {"inputs": self.input_names, "outputs": self.output_names, "weight_name_map": {}}

    def runtime_cache_bytes(self):
        return None

    def forward(self, x, w):
        return x * w * self.scale


def test_an_engine_set_as_several_partitions_is_called_and_saved_once(monkeypatch):
    from prx_compile.backends.tensorrt import engine
    from prx_compile.backends.tensorrt.backend import TensorRTBackend, program_of
    from prx_compile.backends.tensorrt.program import Program
    from prx_compile.config import CompileConfig
    from prx_compile.ops import choice
    from prx_compile.shapes import ShapeRange

    root = torch.nn.Module()
    root._run_on_acc_0 = StandIn(2.0, b"first")
    shared = root._run_on_acc_1 = StandIn(3.0, b"block")
    root._run_on_acc_2 = shared  # what SharedEngines hands Torch-TensorRT for a repeated block
    g = torch.fx.Graph()
    x = g.placeholder("hidden_states")
    ws = [g.placeholder(f"weights_{i}") for i in range(3)]
    h = g.call_module("_run_on_acc_0", (x, ws[0]))
    h = g.call_function(torch.ops.aten.add.Tensor, (h, h))
    h = g.call_module("_run_on_acc_1", (h, ws[1]))
    g.output(g.call_module("_run_on_acc_2", (h, ws[2])))
    gm = torch.fx.GraphModule(root, g)
    params = {n: torch.rand(4) + 0.5 for n in ("a", "b", "c")}
    hs = torch.rand(4)
    want = gm(hs, *params.values())

    program, engines, constants = program_of(gm, (StandIn,), list(params), params, INPUTS)
    assert list(engines) == ["_run_on_acc_0", "_run_on_acc_1"]
    assert [st.engine for st in program.steps if st.op == "engine"] == [
        "_run_on_acc_0",
        "_run_on_acc_1",
        "_run_on_acc_1",
    ]
    torch.testing.assert_close(program.run({"hidden_states": hs}, params, engines, constants), want)

    monkeypatch.setattr(engine, "bindings", lambda: None)
    model = torch.nn.Module()
    plan = plan_of(CompileConfig())
    backend = TensorRTBackend(model, plan, ShapeRange.static(1, 8, 8, 4))
    backend.program, backend.engines, backend.constants = program, engines, constants
    backend.kernels = choice.unmeasured(plan, backend.shapes, "not measured (a test)")
    state = backend.state()
    assert sorted(state.blobs) == ["_run_on_acc_0.engine", "_run_on_acc_1.engine"]
    assert state.blobs["_run_on_acc_1.engine"] == b"block"
    assert sorted(state.meta["engines"]) == ["_run_on_acc_0", "_run_on_acc_1"]
    again = Program.from_json(
        state.meta["program"], engines=set(engines), params=set(params), constants=set(), inputs=INPUTS
    )
    torch.testing.assert_close(again.run({"hidden_states": hs}, params, engines, constants), want)


def test_workers_convert_distinct_pieces_at_once_and_finish_puts_each_engine_in_place():
    """With workers, a new piece is converted in a thread and Torch-TensorRT gets a stand-in;
    finish() swaps each stand-in for its engine (the same engine under every shared name), applies
    what Torch-TensorRT set on the stand-in, and waits: four pieces of 0.3 s take about 0.3 s."""
    import threading
    import time

    from prx_compile.backends.tensorrt.repeats import Building

    _, _, _, runs = partitions(LoweringSettings(attention="flash"))
    threads, grad = set(), []

    class Engine(torch.nn.Module):
        unowned = False

        def set_output_tensors_as_unowned(self, enabled):
            self.unowned = enabled

    def convert(module, inputs, *, settings=None, name="", engine_cache=None):
        threads.add(threading.get_ident())
        grad.append(torch.is_grad_enabled())
        time.sleep(0.3)
        return Engine()

    root = torch.nn.Module()
    distinct = [runs[0], runs[1], runs[-1]]
    with SharedEngines(workers=4).wrap(convert) as sharing:
        t0 = time.perf_counter()
        with torch.no_grad():
            for name, sub in runs:
                setattr(root, name, sharing(sub, _specs(sub), settings=None, name=name, engine_cache=None))
        assert all(isinstance(getattr(root, name), Building) for name, _ in runs)
        getattr(root, runs[-1][0]).set_output_tensors_as_unowned(True)  # as compile_module does
        sharing.finish(root)
        wall = time.perf_counter() - t0
    assert wall < 0.3 * len(distinct) - 0.2, wall  # side by side, not one after another
    assert threading.get_ident() not in threads and grad == [False] * len(distinct)  # no_grad followed
    got = {name: getattr(root, name) for name, _ in runs}
    assert all(isinstance(m, Engine) for m in got.values())
    assert len({id(m) for m in got.values()}) == len(distinct)
    assert all(got[name] is got[runs[1][0]] for name, _ in runs[2:DEPTH])
    assert got[runs[-1][0]].unowned and not got[runs[0][0]].unowned
    assert sharing.built == [n for n, _ in distinct] and 0.3 <= sharing.wall_s < wall


def test_a_failed_conversion_in_a_thread_is_raised_by_finish():
    _, _, _, runs = partitions(LoweringSettings(attention="flash"))

    def convert(module, inputs, *, settings=None, name="", engine_cache=None):
        raise RuntimeError(f"TensorRT refused {name}")

    root = torch.nn.Module()
    with SharedEngines(workers=2).wrap(convert) as sharing:
        name, sub = runs[0]
        setattr(root, name, sharing(sub, _specs(sub), settings=None, name=name, engine_cache=None))
        with pytest.raises(RuntimeError, match=f"TensorRT refused {name}"):
            sharing.finish(root)
        with pytest.raises(RuntimeError, match="still being built"):
            getattr(root, name)()  # a stand-in never runs as an engine
    with pytest.raises(ValueError, match="at least 1"):
        SharedEngines(workers=0)
