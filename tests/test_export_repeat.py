"""``export.repeat``: a PRX traced with one block and copied is the graph a full export gives (node for
node, up to which alias of the text mask each block reads)."""

import logging

import pytest
import torch

from prx_compile.export import export_step, weight_tensors
from prx_compile.export.repeat import BOUNDARY, why_not
from prx_compile.models import SPECS
from prx_compile.tools.testing import make_prx

from .conftest import RANGE, eager, prx_inputs

PRX = SPECS["prx"]


def _source(node):
    """Through ``x.to(dtype)`` where x already has that dtype (an alias: the text mask's ``.bool()``,
    which a full export chains from block to block and the copies read from the input)."""
    while (
        node.op == "call_function"
        and node.target is torch.ops.aten.to.dtype
        and node.args[0].meta["val"].dtype == node.args[1]
    ):
        node = node.args[0]
    return node


def _node_key(node, index):
    """A node's op, target and arguments, nodes named by their position: graphs compare by structure."""

    def arg(a):
        if isinstance(a, torch.fx.Node):
            return ("node", index[_source(a)])
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, arg(v)) for k, v in a.items()))
        return repr(a)

    return node.op, str(node.target) if node.op != "placeholder" else "", arg(node.args), arg(node.kwargs)


def _structure(ep):
    nodes = list(ep.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    return [_node_key(n, index) for n in nodes]


def _same_outputs(once, full, model, names, cases):
    """``once`` and ``full`` give the same output, bit for bit, on each case, within 1e-5 of eager."""
    tensors = weight_tensors(model)
    weights = [tensors[n] for n in names]
    for case in cases:
        with torch.no_grad():
            out = once.module()(**case, weights=weights)
            assert torch.equal(out, full.module()(**case, weights=weights))
        assert (out - eager(model, case)).abs().max() <= 1e-5


def _other_shape(model):  # a second point of RANGE: batch 3, 24x12 latent, 7 text tokens
    return prx_inputs(model, batch=3, h=24, w=12, text=7, masked=3, seed=1)


@pytest.fixture(scope="module")
def three_blocks():
    return make_prx({**_tiny(), "depth": 3})


def _tiny():
    from prx_compile.tools.testing import TINY_PRX

    return dict(TINY_PRX)


@pytest.mark.parametrize("shapes", [None, RANGE], ids=["static", "range"])
def test_one_block_traced_and_copied_is_the_full_export_node_for_node(three_blocks, shapes, monkeypatch):
    from prx_compile.export import repeat

    copied = []
    original = repeat.repeat_blocks
    monkeypatch.setattr(repeat, "repeat_blocks", lambda *a: copied.append(original(*a)) or copied[-1])
    model = three_blocks
    kw = prx_inputs(model)
    full, full_names = export_step(
        model, kw, shapes, weights="inputs", fuse_attention=True, trace_blocks_once=False
    )
    once, names = export_step(model, kw, shapes, weights="inputs", fuse_attention=True)
    assert len(copied) == 1 and copied[0] is once  # the one-block path, not a full export
    assert names == full_names == list(weight_tensors(model))
    assert _structure(once) == _structure(full)
    assert BOUNDARY not in {n.target for n in once.graph.nodes}
    expected = ["hidden_states", "timestep", "encoder_hidden_states", "attention_mask"]
    expected += [f"weights_{j}" for j in range(len(names))]
    assert [n.name for n in once.graph.nodes if n.op == "placeholder"] == expected
    assert [s.arg.name for s in once.graph_signature.input_specs] == expected
    _same_outputs(once, full, model, names, [kw] if shapes is None else [kw, _other_shape(model)])


def test_each_copy_reads_its_own_blocks_weights(three_blocks):
    """Changing block 2's weights changes the copied graph's output exactly as it changes eager's."""
    model = three_blocks
    kw = prx_inputs(model)
    once, names = export_step(model, kw, RANGE, weights="inputs", fuse_attention=True)
    tensors = dict(weight_tensors(model))
    key = "blocks.2.down_proj.weight"
    assert key in tensors
    changed = dict(tensors, **{key: tensors[key] * 3.0})
    with torch.no_grad():
        out = once.module()(**kw, weights=[changed[n] for n in names])
        base = once.module()(**kw, weights=[tensors[n] for n in names])
        model.blocks[2].down_proj.weight.mul_(3.0)
        try:
            ref = eager(model, kw)
        finally:
            model.blocks[2].down_proj.weight.div_(3.0)
    assert (out - base).abs().max() > 1e-4
    assert (out - ref).abs().max() <= 1e-5


def test_where_the_blocks_cannot_be_copied_every_block_is_traced(three_blocks, caplog):
    model = three_blocks
    assert why_not(model, PRX, "inputs") is None
    assert "weights='engine'" in why_not(model, PRX, "engine")
    assert "two or more" in why_not(make_prx({**_tiny(), "depth": 1}), PRX, "inputs")
    odd = make_prx({**_tiny(), "depth": 2})
    odd.blocks[1].down_proj = torch.nn.Linear(odd.blocks[1].down_proj.in_features, odd.config.hidden_size)
    assert "differ" in why_not(odd, PRX, "inputs")
    with caplog.at_level(logging.DEBUG, logger="prx_compile.export.step"):
        ep, names = export_step(odd, prx_inputs(odd), weights="inputs")
    assert "tracing every block" in caplog.text
    assert names == list(weight_tensors(odd))
    with torch.no_grad():
        out = ep.module()(**prx_inputs(odd), weights=[weight_tensors(odd)[n] for n in names])
    assert (out - eager(odd, prx_inputs(odd))).abs().max() <= 1e-5


def test_a_hook_or_processor_on_one_block_is_traced_in_that_block_only():
    """An export traces hooks and attention processors: block 0's copy would put a hook of block 1
    on every block, or on none."""
    model = make_prx({**_tiny(), "depth": 3})
    model.blocks[1].register_forward_hook(lambda m, a, out: out * 0.5)
    assert "forward hooks" in why_not(model, PRX, "inputs")
    kw = prx_inputs(model)
    ep, names = export_step(model, kw, weights="inputs")
    with torch.no_grad():
        out = ep.module()(**kw, weights=[weight_tensors(model)[n] for n in names])
    assert (out - eager(model, kw)).abs().max() <= 1e-5
    other = make_prx({**_tiny(), "depth": 3})
    attention = other.blocks[2].attention

    class Mine(type(attention.processor)):
        pass

    attention.set_processor(Mine())
    assert "attention processors" in why_not(other, PRX, "inputs")
    third = make_prx({**_tiny(), "depth": 3})
    mlp = third.blocks[2].down_proj
    mlp.forward = lambda x: torch.nn.Linear.forward(mlp, x) * 0.5
    assert "replaced forwards" in why_not(third, PRX, "inputs")
    fourth = make_prx({**_tiny(), "depth": 3})
    fourth.blocks[1].attention.norm_q.eps = 0.1  # a constant of the graph: block 0's would stand for it
    assert "differ in a setting" in why_not(fourth, PRX, "inputs")
    ep, names = export_step(third, kw, weights="inputs")
    with torch.no_grad():
        out = ep.module()(**kw, weights=[weight_tensors(third)[n] for n in names])
    assert (out - eager(third, kw)).abs().max() <= 1e-5


def test_the_model_is_not_changed_by_the_one_block_export(three_blocks):
    model = three_blocks
    before = [id(b) for b in model.blocks]
    export_step(model, prx_inputs(model), weights="inputs")
    assert [id(b) for b in model.blocks] == before and type(model.blocks) is torch.nn.ModuleList


@pytest.mark.parametrize("shapes", [None, RANGE], ids=["static", "range"])
def test_lowered_and_decomposed_before_the_copy_is_what_it_is_after(three_blocks, shapes):
    """``prepare`` (what the TensorRT backend passes: our rules, then a decomposition table) on the
    one-block program, then the copy, gives what it gives on the full export: the same operations and
    outputs, bit for bit, at two shapes. The core ATen table here stands in for Torch-TensorRT's (which
    needs a GPU); it decomposes more."""
    from collections import Counter

    from prx_compile.lowering import LoweringSettings, lower

    model = three_blocks
    kw = prx_inputs(model)
    seen = []

    def prepare(ep):
        seen.append(sum(n.target is BOUNDARY for n in ep.graph.nodes))
        lower(ep.graph_module, LoweringSettings(linears_in_torch=shapes is not None))
        return ep.run_decompositions(torch.export.default_decompositions())

    once, names = export_step(model, kw, shapes, weights="inputs", fuse_attention=True, prepare=prepare)
    full, full_names = export_step(
        model, kw, shapes, weights="inputs", fuse_attention=True, trace_blocks_once=False, prepare=prepare
    )
    assert seen == [2, 0]  # one marked block, then the full model
    assert names == full_names

    def ops(ep):
        return Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")

    assert ops(once) == ops(full)
    assert ops(once)["prx_compile.prx_attention.default"] == 3
    assert ("prx_compile.linear.default" in ops(once)) == (shapes is not None)
    assert "aten.linear.default" not in ops(once)  # decomposed (or rewritten) in every copy
    _same_outputs(once, full, model, names, [kw] if shapes is None else [kw, _other_shape(model)])
