"""The Program (engines and PyTorch ops between them, as validated JSON) on the CPU.

The tensorrt backend makes a Program from Torch-TensorRT's partitioned graph. Here the same lowered
PRX graph is partitioned by torch.fx's ``split_module`` at the attention ops, and the pieces between
them stand in for engines (run by PyTorch, named as such): conversion, JSON round trip, the
interpreter, and the validation of hostile JSON are all checked against eager."""

import json
import operator

import pytest
import torch
from torch.fx.passes.split_module import split_module

from prx_compile.backends.tensorrt.program import OPS, Program, ProgramError, from_graph_module
from prx_compile.export import export_step
from prx_compile.lowering import LoweringSettings, lower
from prx_compile.models.prx import INPUTS
from prx_compile.ops import PRX_ATTENTION, PRX_ATTENTION_CUDNN, PRX_ATTENTION_FLASH4
from prx_compile.shapes import ShapeRange
from prx_compile.tools.testing import make_prx

from .conftest import eager, prx_inputs

RANGE = ShapeRange(batch=(1, 4), height=(8, 32), width=(8, 32), text=(4, 16))


def partitioned(weights, settings=None, op=PRX_ATTENTION, kernels=True):
    """(model, split GraphModule, the 'engine' children, weight names): attention ops (``op``) between
    pieces (``kernels``: lowered with the kernel rules, else as a TensorRT set before its build)."""
    model = make_prx()
    ep, names = export_step(model, prx_inputs(model), RANGE, weights=weights, fuse_attention=True)
    lower(ep.graph_module, settings or LoweringSettings(), kernels=kernels)
    gm = ep.module()
    part = {"i": 0}

    def split(node):
        if node.op == "call_function" and node.target == op:
            part["i"] += 2
            return part["i"] - 1
        return part["i"]

    sp = split_module(gm, gm, split)
    engines = {
        n: m
        for n, m in sp.named_children()
        if isinstance(m, torch.fx.GraphModule) and not any(x.target == op for x in m.graph.nodes)
    }
    return model, sp, engines, names


@pytest.fixture(scope="module", params=["inputs", "engine"])
def program(request):
    model, sp, engines, names = partitioned(request.param)
    prog, consts = from_graph_module(
        sp, engines=set(engines), weight_names=names, params=dict(model.named_parameters()), inputs=INPUTS
    )
    return model, prog, consts, engines


def run(prog, model, engines, consts, kw):
    out = prog.run(kw, dict(model.named_parameters()), engines, consts)
    return out[0] if isinstance(out, (list, tuple)) else out


def test_program_matches_eager_and_reads_live_weights(program):
    model, prog, consts, engines = program
    assert prog.torch_ops() == {"prx_compile.prx_attention.default": model.config.depth}
    assert prog.segments == model.config.depth and len(prog.engine_names()) == model.config.depth + 1
    assert not consts  # every tensor the steps read is a live parameter
    for kw in (prx_inputs(model), prx_inputs(model, batch=3, h=24, w=12, text=7, masked=3, seed=1)):
        assert (run(prog, model, engines, consts, kw) - eager(model, kw)).abs().max() <= 1e-5
    kw = prx_inputs(model)
    before = run(prog, model, engines, consts, kw)
    with torch.no_grad():
        model.blocks[0].attention.norm_q.weight.mul_(2)  # read between engines, by the attention op
    try:
        assert (run(prog, model, engines, consts, kw) - before).abs().max() > 1e-4
    finally:
        with torch.no_grad():
            model.blocks[0].attention.norm_q.weight.div_(2)


def test_json_roundtrip_runs_the_same(program):
    model, prog, consts, engines = program
    data = json.loads(json.dumps(prog.to_json()))
    again = Program.from_json(
        data,
        engines=set(engines),
        params={n for n, _ in model.named_parameters()},
        constants=set(consts),
        inputs=INPUTS,
    )
    kw = prx_inputs(model)
    assert torch.equal(run(again, model, engines, consts, kw), run(prog, model, engines, consts, kw))


@pytest.mark.parametrize("kind", ["cudnn", "flash4"])
def test_a_program_with_the_one_call_attention_round_trips(kind):
    """``attention_kernel: cudnn`` / ``flash4`` put ``prx_attention_cudnn`` / ``prx_attention_flash4``
    between the engines: a Program and its JSON take it, and on a CPU it runs ``prx_attention``'s
    path (the same numbers as eager)."""
    op = {"cudnn": PRX_ATTENTION_CUDNN, "flash4": PRX_ATTENTION_FLASH4}[kind]
    ops = round_trip_against_eager(LoweringSettings(padded_attention=kind), op)
    assert ops == {f"prx_compile.prx_attention_{kind}.default": make_prx().config.depth}


@pytest.mark.parametrize("kind", ["cudnn", "flash4"])
def test_the_kernel_chosen_after_the_partition_reaches_the_program(kind):
    """A TensorRT set partitions with the attention in its first form and applies the kernel rules
    to the partitioned module once the kernels are measured (``lower_kernels``): the Program calls
    the chosen op in every block and computes eager's numbers (its CPU path)."""
    from prx_compile.lowering import lower_kernels

    settings = LoweringSettings(padded_attention=kind)
    model, sp, engines, names = partitioned("inputs", settings, PRX_ATTENTION, kernels=False)
    lower_kernels(sp, settings)
    prog, consts = from_graph_module(
        sp, engines=set(engines), weight_names=names, params=dict(model.named_parameters()), inputs=INPUTS
    )
    assert prog.torch_ops() == {f"prx_compile.prx_attention_{kind}.default": model.config.depth}
    kw = prx_inputs(model, batch=2, masked=3)
    assert (run(prog, model, engines, consts, kw) - eager(model, kw)).abs().max() <= 1e-5


def round_trip_against_eager(settings, op):
    """Lower with ``settings``, split at ``op``, make a Program, send it through JSON and check the
    copy against eager (masked text, batch 2; 1e-5). Returns the Program's PyTorch ops."""
    model, sp, engines, names = partitioned("inputs", settings, op)
    prog, consts = from_graph_module(
        sp, engines=set(engines), weight_names=names, params=dict(model.named_parameters()), inputs=INPUTS
    )
    again = Program.from_json(
        json.loads(json.dumps(prog.to_json())),
        engines=set(engines),
        params={n for n, _ in model.named_parameters()},
        constants=set(consts),
        inputs=INPUTS,
    )
    kw = prx_inputs(model, batch=2, masked=3)
    assert (run(again, model, engines, consts, kw) - eager(model, kw)).abs().max() <= 1e-5
    return prog.torch_ops()


def mutations(data):
    """(description, mutated program JSON) pairs, each one an attack or a corruption."""
    first = next(i for i, s in enumerate(data["steps"]) if s["op"] != "engine")

    def with_step(i, **changes):
        d = json.loads(json.dumps(data))
        d["steps"][i].update(changes)
        return d

    yield "file-reading op", with_step(first, op="aten.from_file.default")
    yield "in-place op", with_step(first, op="aten.copy_.default")
    yield "dotted escape", with_step(first, op="aten.__class__.__base__")
    yield "python builtin", with_step(first, op="builtins.eval")
    yield "unknown engine", with_step(0, engine="_run_on_acc_99")
    yield "engine path", with_step(0, engine="../../etc/passwd")
    yield "later value", with_step(0, args=[{"ref": f"v{len(data['steps']) - 1}"}])
    yield "unknown parameter", with_step(0, args=[{"ref": "w:no.such.weight"}])
    yield "unknown constant", with_step(0, args=[{"ref": "c:x"}])
    yield "unknown input", with_step(0, args=[{"ref": "in:__import__"}])
    yield "bad ref", with_step(0, args=[{"ref": "__import__('os')"}])
    yield "code as string", with_step(first, args=["__import__('os').system('x')"])
    yield "unknown kind", with_step(first, args=[{"eval": "1"}])
    yield "bad dtype", with_step(first, args=[{"dtype": "object"}])
    yield "unhashable dtype", with_step(first, args=[{"dtype": []}])
    yield "unhashable float", with_step(first, args=[{"float": {}}])
    yield "name with a newline", with_step(1, out="v1\n")
    yield "bad float", with_step(first, args=[{"float": "1e999"}])
    yield "deep nesting", with_step(first, args=[json.loads('{"list": [' * 20 + "]}" * 20)])
    yield "kwarg name", with_step(first, kwargs={"__class__": 1})
    yield "duplicate result", with_step(1, out="v0")
    yield "bad result name", with_step(1, out="x; import os")
    yield "extra key", with_step(0, python="print(1)")
    d = json.loads(json.dumps(data))
    d["inputs"] = ["hidden_states", "weights"]
    yield "bad input name", d
    yield "not a program", []


def test_hostile_json_is_refused_with_a_named_field(program):
    model, prog, consts, engines = program
    data = prog.to_json()
    for what, bad in mutations(data):
        with pytest.raises(ProgramError, match=r"program|steps|must|not"):
            Program.from_json(
                bad,
                engines=set(engines),
                params={n for n, _ in model.named_parameters()},
                constants=set(consts),
                inputs=INPUTS,
            )
            pytest.fail(f"accepted: {what}")


def test_the_op_table_is_functional_and_file_free():
    for name, op in OPS.items():
        if isinstance(op, torch._ops.OpOverload):
            schema = op._schema
            assert not schema.is_mutable, name
            assert not any(a.name == "out" for a in schema.arguments), name
    for forbidden in (
        "aten.from_file.default",
        "aten.as_strided.default",
        "aten.copy_.default",
        "aten.set_.source_Tensor",
    ):
        assert forbidden not in OPS


def test_a_program_with_the_fused_mlp_gate_matches_eager():
    """``fuse_mlp_gate`` puts one ``gelu_gate`` per block between the engines, on the PRX export (the
    rule finds PRX's own MLP): a Program and its JSON take it, and on a CPU it is the composition."""
    from prx_compile.ops import GELU_GATE

    ops = round_trip_against_eager(LoweringSettings(gelu_gate=True, padded_attention="cudnn"), GELU_GATE)
    assert ops["prx_compile.gelu_gate.default"] == make_prx().config.depth, ops


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_a_flux_program_with_list_results_and_fused_glue_round_trips(precision):
    """FLUX.1 in fp8 (rule ``fp8_inputs``): each ``fp8_linears`` returns a list that ``getitem`` takes
    apart in its PyTorch piece, as Torch-TensorRT leaves a getitem with the op it reads; with its
    linears in PyTorch (rule ``linear_glue``): ``linear_gelu`` and ``linear_cat``. The Program and
    its JSON copy take them and compute the eager model's numbers (their CPU path: the composition)."""
    from prx_compile.export import example_inputs, weight_tensors
    from prx_compile.models import spec_for
    from prx_compile.ops import FLUX_ATTENTION, FP8_LINEAR, FP8_LINEARS, LINEAR, LINEAR_CAT, LINEAR_GELU
    from prx_compile.quant import fp8
    from prx_compile.tools.testing import make_flux

    model = make_flux()
    spec = spec_for(model)
    if precision == "fp8":
        fp8.install(model, spec.block_linears)
    kw = example_inputs(model, 2, 64, 1, 8)
    ep, names = export_step(model, kw, weights="inputs", fuse_attention=True)
    lower(ep.graph_module, LoweringSettings(linears_in_torch=precision == "bf16"))
    gm = ep.module()
    for node in [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]:
        gm.graph.erase_node(node)  # torch.export's input guards (not in what Torch-TensorRT partitions)
    kept, ids, part = {FLUX_ATTENTION, FP8_LINEAR, FP8_LINEARS, LINEAR, LINEAR_CAT, LINEAR_GELU}, {}, 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in kept:
            part += 2
            ids[node] = part - 1
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in ids:
            ids[node] = ids[node.args[0]]  # with the op it takes apart
        else:
            ids[node] = part
    sp = split_module(gm, model, lambda n: ids[n])
    sp.graph._codegen = gm.graph._codegen
    sp.recompile()
    engines = {
        n: m
        for n, m in sp.named_children()
        if isinstance(m, torch.fx.GraphModule) and not any(x.target in kept for x in m.graph.nodes)
    }
    inputs = spec.inputs(model)
    weights = weight_tensors(model)  # the FP8 copies and scales are buffers
    prog, consts = from_graph_module(
        sp, engines=set(engines), weight_names=names, params=weights, inputs=inputs
    )
    ops = prog.torch_ops()
    if precision == "fp8":
        # per double block: q/k/v of image and text, both feed-forwards' first (with their norms)
        # and second linears (with their GELUs); per single block q/k/v + MLP, and proj_out
        assert ops["prx_compile.fp8_linears.default"] == 6 * 2 + 2 * 2, ops
        assert ops["prx_compile.fp8_linear.default"] == 2 * 2, ops  # to_out, to_add_out
    else:  # per double block both feed-forwards' GELUs, per single block its MLP's; its proj_out
        assert ops["prx_compile.linear_gelu.default"] == 2 * 2 + 2, ops
        assert ops["prx_compile.linear_cat.default"] == 2, ops
    again = Program.from_json(
        json.loads(json.dumps(prog.to_json())),
        engines=set(engines),
        params=set(weights),
        constants=set(consts),
        inputs=inputs,
    )
    ref = eager(model, kw)
    for p in (prog, again):
        out = p.run(kw, weights, engines, consts)[0]
        assert (out - ref).abs().max() <= 1e-5 * ref.abs().max(), (out - ref).abs().max()
