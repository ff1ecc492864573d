"""Property tests: the unfold/fold rules against F.unfold / F.fold on random configurations."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from prx_compile.lowering import lower

aten = torch.ops.aten


class Unfold(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, x):
        return F.unfold(x, **self.kw)


class Fold(torch.nn.Module):
    def __init__(self, size, **kw):
        super().__init__()
        self.size, self.kw = size, kw

    def forward(self, x):
        return F.fold(x, self.size, **self.kw)


def targets(gm):
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def lowered(module, x, dynamic_shapes=None):
    ep = torch.export.export(module, (x,), dynamic_shapes=dynamic_shapes)
    return lower(ep.module())


configs = st.fixed_dictionaries(
    {
        "kh": st.integers(1, 4),
        "kw": st.integers(1, 4),
        "sh": st.integers(1, 3),
        "sw": st.integers(1, 3),
        "ph": st.integers(0, 2),
        "pw": st.integers(0, 2),
        "dh": st.integers(1, 2),
        "dw": st.integers(1, 2),
        "c": st.integers(1, 3),
        "b": st.integers(1, 2),
        "extra_h": st.integers(0, 6),
        "extra_w": st.integers(0, 6),
        "batched": st.booleans(),
    }
)


def _kw(p):
    return dict(
        kernel_size=(p["kh"], p["kw"]),
        stride=(p["sh"], p["sw"]),
        padding=(p["ph"], p["pw"]),
        dilation=(p["dh"], p["dw"]),
    )


def _size(p):
    # the smallest input that gives at least one block, plus some extra rows/columns
    h = p["dh"] * (p["kh"] - 1) + 1 - 2 * p["ph"] + p["extra_h"]
    w = p["dw"] * (p["kw"] - 1) + 1 - 2 * p["pw"] + p["extra_w"]
    return max(h, 1), max(w, 1)


@settings(max_examples=40, deadline=None)
@given(configs)
def test_unfold_rule_is_exact(p):
    h, w = _size(p)
    x = torch.randn(p["b"], p["c"], h, w) if p["batched"] else torch.randn(p["c"], h, w)
    m = Unfold(**_kw(p))
    try:
        ref = m(x)
    except RuntimeError:  # configurations F.unfold itself refuses
        return
    gm = lowered(m, x)
    assert aten.im2col.default not in targets(gm)
    assert torch.equal(gm(x), ref)


@settings(max_examples=40, deadline=None)
@given(configs)
def test_fold_rule_matches_f_fold(p):
    h, w = _size(p)
    kw = _kw(p)
    x = torch.randn(p["b"], p["c"], h, w) if p["batched"] else torch.randn(p["c"], h, w)
    try:
        cols = F.unfold(x, **kw)
        ref = F.fold(cols, (h, w), **kw)
    except RuntimeError:
        return
    m = Fold((h, w), **kw)
    gm = lowered(m, cols)
    assert aten.col2im.default not in targets(gm)
    out = gm(cols)
    # overlapping blocks are summed; the rule sums in col2im's order, so this is exact in practice
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_patchify_form_is_reshape_only():
    m = Unfold(kernel_size=2, stride=2)
    x = torch.randn(2, 3, 8, 12)
    t = targets(lowered(m, x))
    assert aten.im2col.default not in t and aten.slice.Tensor not in t and aten.permute.default in t


@pytest.mark.parametrize(
    "module,shape",
    [
        (Unfold(kernel_size=2, stride=2), (2, 3, 8, 12)),
        (Unfold(kernel_size=3, stride=1, padding=1), (2, 3, 8, 12)),
    ],
)
def test_rules_keep_dynamic_shapes(module, shape):
    x = torch.randn(*shape)
    h = torch.export.Dim("h", min=2, max=32)
    w = torch.export.Dim("w", min=2, max=32)
    gm = lowered(module, x, dynamic_shapes=({2: 2 * h, 3: 2 * w},))
    for hh, ww in ((4, 6), (16, 10)):
        y = torch.randn(2, 3, hh, ww)
        assert torch.equal(gm(y), module(y))


def test_dynamic_fold_patchify():
    class RoundTrip(torch.nn.Module):
        def forward(self, x):
            return F.fold(F.unfold(x, 2, stride=2), x.shape[-2:], 2, stride=2)

    x = torch.randn(2, 3, 8, 8)
    d = torch.export.Dim("d", min=2, max=32)
    gm = lowered(RoundTrip(), x, dynamic_shapes=({2: 2 * d, 3: 2 * d},))
    y = torch.randn(2, 3, 12, 12)
    assert torch.equal(gm(y), y)
    assert not {aten.im2col.default, aten.col2im.default} & targets(gm)
