"""The linear_glue rule on hand-made graphs (linears run in PyTorch, as engine sets run them): which
GELUs go into their GEMM's epilogue, which concatenations split across two GEMMs, which are left
alone, and exactness against the unlowered graph (on a CPU the ops are the composition)."""

import pytest
import torch
import torch.nn.functional as F

from prx_compile.lowering import LoweringSettings, lower
from prx_compile.ops import LINEAR, LINEAR_CAT, LINEAR_GELU

aten = torch.ops.aten


def lin(n, k, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(k, n, bias=bias)
    torch.nn.init.normal_(layer.weight, std=0.2, generator=g)
    if bias:
        torch.nn.init.normal_(layer.bias, std=0.5, generator=g)
    return layer


class FeedForward(torch.nn.Module):
    """FLUX's feed-forward: linear, tanh GELU, an eval dropout, linear."""

    def __init__(self, approximate="tanh", bias=True, reuse=False):
        super().__init__()
        self.up, self.down, self.drop = lin(64, 32, bias), lin(32, 64, seed=1), torch.nn.Dropout(0.0)
        self.approximate, self.reuse = approximate, reuse

    def forward(self, x):
        h = F.gelu(self.up(x), approximate=self.approximate)
        out = self.down(self.drop(h))
        return out + h[..., :32] if self.reuse else out


class Single(torch.nn.Module):
    """A FLUX single block's tail: proj_out(cat([attention, gelu(proj_mlp(x))], -1))."""

    def __init__(self, dim=-1, reuse_cat=False):
        super().__init__()
        self.mlp, self.out = lin(48, 32), lin(32, 16 + 48, seed=1)
        self.dim, self.reuse_cat = dim, reuse_cat

    def forward(self, attn, x):
        act = F.gelu(self.mlp(x), approximate="tanh")
        if self.dim != -1:
            return self.out(torch.cat([attn.new_zeros(attn.shape[0], 1, 64), F.pad(act, (0, 16))], self.dim))
        cat = torch.cat([attn, act], -1)
        out = self.out(cat)
        return out + cat[..., :32] if self.reuse_cat else out


class Gate(torch.nn.Module):
    """PRX's gate: the GELU is read by a product, not a linear (gelu_gate's pattern)."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = lin(64, 32), lin(64, 32, seed=1), lin(32, 64, seed=2)

    def forward(self, x):
        return self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))


def lowered(module, *args, **switches):
    switches = {"linears_in_torch": True, **switches}
    gm = lower(torch.export.export(module.eval(), args).module(), LoweringSettings(**switches))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    return gm(*args), module(*args), targets


def rand(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2


def test_the_feed_forwards_gelu_goes_into_its_gemm():
    out, ref, targets = lowered(FeedForward(), rand(2, 5, 32))
    assert targets.count(LINEAR_GELU) == 1 and targets.count(LINEAR) == 1
    assert aten.gelu.default not in targets and aten.dropout.default not in targets
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_a_single_blocks_tail_is_a_gelu_gemm_and_a_split_gemm():
    out, ref, targets = lowered(Single(), rand(2, 5, 16), rand(2, 5, 32, seed=2))
    assert targets.count(LINEAR_GELU) == 1 and targets.count(LINEAR_CAT) == 1 and LINEAR not in targets
    assert aten.gelu.default not in targets and aten.cat.default not in targets
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize(
    "module,kept",
    [
        (FeedForward(approximate="none"), aten.gelu.default),  # erf GELU: the epilogue computes tanh
        (FeedForward(bias=False), aten.gelu.default),  # cuBLASLt's GELU epilogue comes with a bias
        (FeedForward(reuse=True), aten.gelu.default),  # the GELU's output is read elsewhere
        (Gate(), aten.gelu.default),  # read by a product: gelu_gate's pattern
        (Single(dim=1), aten.cat.default),  # concatenated along the rows
        (Single(reuse_cat=True), aten.cat.default),  # the concatenation is read elsewhere
    ],
)
def test_other_patterns_are_left_alone(module, kept):
    args = (rand(2, 5, 16), rand(2, 5, 32, seed=2)) if isinstance(module, Single) else (rand(2, 5, 32),)
    out, ref, targets = lowered(module, *args)
    assert kept in targets
    if kept == aten.gelu.default:
        assert LINEAR_GELU not in targets
    else:
        assert LINEAR_CAT not in targets
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


class Chained(torch.nn.Module):
    """Two eval dropouts after the GELU; then a linear over [x; GELU] whose own output has a GELU."""

    def __init__(self):
        super().__init__()
        self.up, self.mid, self.down = lin(32, 32), lin(32, 64, seed=1), lin(16, 32, seed=2)
        self.drop = torch.nn.Dropout(0.0)

    def forward(self, x):
        h = self.drop(self.drop(F.gelu(self.up(x), approximate="tanh")))
        return self.down(F.gelu(self.mid(torch.cat([x, h], -1)), approximate="tanh"))


def test_chained_dropouts_go_and_a_split_linear_keeps_its_gelu():
    out, ref, targets = lowered(Chained(), rand(2, 5, 32))
    assert aten.dropout.default not in targets and aten.cat.default not in targets
    # the first GELU goes into its GEMM; the middle linear splits its concatenation and keeps its GELU
    assert targets.count(LINEAR_GELU) == 1 and targets.count(LINEAR_CAT) == 1 and aten.gelu.default in targets
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_a_concatenation_with_an_empty_legacy_part_is_left_alone():
    class Empty(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.out = lin(8, 32)

        def forward(self, x):
            return self.out(torch.cat([x.new_empty(0), x], -1))

    out, ref, targets = lowered(Empty(), rand(2, 5, 32))
    assert aten.cat.default in targets and LINEAR_CAT not in targets
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_the_switch_and_linears_left_to_tensorrt_leave_the_graph():
    for switches in (dict(linear_glue=False), dict(linears_in_torch=False)):
        out, ref, targets = lowered(Single(), rand(2, 5, 16), rand(2, 5, 32, seed=2), **switches)
        assert LINEAR_GELU not in targets and LINEAR_CAT not in targets and aten.cat.default in targets
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_the_ops_check_their_arguments_in_one_line():
    a, b, w, bias = rand(3, 16), rand(3, 8), rand(4, 24), rand(4)
    w8 = w[:, :16].to(torch.float8_e4m3fn)
    ref = F.linear(torch.cat([a, b], -1), w, bias)
    torch.testing.assert_close(torch.ops.prx_compile.linear_cat(a, b, w, bias), ref, rtol=0, atol=0)
    torch.testing.assert_close(
        torch.ops.prx_compile.linear_gelu(a, w[:, :16], bias),
        F.gelu(F.linear(a, w[:, :16], bias), approximate="tanh"),
        rtol=0,
        atol=0,
    )
    cases = [
        (lambda: torch.ops.prx_compile.linear_cat(a, rand(2, 8), w, bias), "differ before their last dim"),
        (lambda: torch.ops.prx_compile.linear_cat(a, b.double(), w, bias), "a is torch.float32, b"),
        (lambda: torch.ops.prx_compile.linear_cat(a, b, w[:, :20], bias), "the input has 24 features"),
        (lambda: torch.ops.prx_compile.linear_cat(a, b, w, rand(3)), r"bias must have shape \(4,\)"),
        (lambda: torch.ops.prx_compile.linear_gelu(a.int(), w[:, :16].int(), None), "must share one of"),
        (lambda: torch.ops.prx_compile.linear_gelu(a, w[:, :16].double(), bias), "must share one of"),
        (lambda: torch.ops.prx_compile.linear_gelu(a.to(torch.float8_e4m3fn), w8, None), "must share one of"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
