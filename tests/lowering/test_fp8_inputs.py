"""The fp8_inputs rule on hand-made graphs: which FP8 linears share one quantised input, which
concatenations and GELUs fold into it, which are left alone, and exactness against the unlowered graph."""

import operator

import pytest
import torch
import torch.nn.functional as F

from prx_compile.lowering import LoweringSettings, lower
from prx_compile.ops import FP8_LINEAR, FP8_LINEARS
from prx_compile.quant import fp8

aten = torch.ops.aten


def linears(*shapes, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, k in shapes:
        lin = torch.nn.Linear(k, n, bias=bias)
        torch.nn.init.normal_(lin.weight, std=0.2, generator=g)
        if bias:
            torch.nn.init.normal_(lin.bias, std=0.5, generator=g)
        out.append(fp8.FP8Linear.from_linear(lin))
    return torch.nn.ModuleList(out)


class QKV(torch.nn.Module):
    """FLUX's q/k/v projections (and a single block's MLP projection): linears over one x."""

    def __init__(self, n=3, read_x=False, between=False):
        super().__init__()
        self.lin = linears(*[(16 + 8 * i, 32) for i in range(n)])
        self.other = linears((32, 32), seed=1)[0]
        self.read_x, self.between = read_x, between

    def forward(self, x):
        h = x * 2
        outs = [self.lin[0](h)]
        if self.between:  # another FP8 linear between: two runs (PRX's text keys read by every block)
            outs.append(self.other(x))
        outs += [lin(h) for lin in self.lin[1:]]
        if self.read_x:
            outs.append(h + 1)
        return torch.cat(outs, -1)


class Single(torch.nn.Module):
    """A FLUX single block's tail: proj_out(cat([attention, gelu_tanh(mlp)], -1))."""

    def __init__(self, approximate="tanh", dim=-1, parts=2, reuse=None, dropout=False):
        super().__init__()
        self.mlp, self.out = linears((48, 32), (32, 16 + 48 if parts == 2 else 16 + 48 + 16))
        self.approximate, self.dim, self.parts, self.reuse = approximate, dim, parts, reuse
        self.dropout = torch.nn.Dropout(0.0).eval() if dropout else None

    def forward(self, attn, x):
        act = F.gelu(self.mlp(x), approximate=self.approximate)
        if self.dropout is not None:
            act = self.dropout(act)
        if self.dim != -1:  # concatenated along the rows instead
            return self.out(torch.cat([attn.new_zeros(attn.shape[0], 1, 64), F.pad(act, (0, 16))], self.dim))
        parts = [attn, act] if self.parts == 2 else [attn, act, attn]
        cat = torch.cat(parts, -1)
        out = self.out(cat)
        if self.reuse == "cat":
            out = out + cat[..., :32]
        if self.reuse == "gelu":
            out = out + act[..., :32]
        return out


class FeedForward(torch.nn.Module):
    """FLUX's feed-forward: linear, GELU (tanh), an eval-mode dropout, linear."""

    def __init__(self):
        super().__init__()
        self.up, self.down = linears((64, 32), (32, 64))
        self.drop = torch.nn.Dropout(0.0)

    def forward(self, x):
        return self.down(self.drop(F.gelu(self.up(x), approximate="tanh")))


def lowered(module, *args, **switches):
    gm = lower(torch.export.export(module.eval(), args).module(), LoweringSettings(**switches))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    return gm(*args), module(*args), calls


def fused(calls):
    """(parts' targets, gelu flags, how many weights) of each fp8_linears node."""
    out = []
    for n in calls:
        if n.target == FP8_LINEARS:
            parts, gelu, weights = n.args[0], n.args[1], n.args[2]
            kinds = [p.target if p.op == "call_function" else p.op for p in parts]
            out.append((kinds, list(gelu), len(weights)))
    return out


def rand(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("n", [2, 3, 4])
def test_linears_over_one_input_quantise_it_once_exactly(n):
    out, ref, calls = lowered(QKV(n), rand(2, 5, 32))
    assert fused(calls) == [([aten.mul.Tensor], [False], n)]
    targets = [c.target for c in calls]
    assert targets.count(operator.getitem) == n and FP8_LINEAR not in targets
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_a_shared_input_read_elsewhere_too_is_still_shared():
    out, ref, calls = lowered(QKV(3, read_x=True), rand(2, 5, 32))
    assert fused(calls) == [([aten.mul.Tensor], [False], 3)]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_an_fp8_linear_between_splits_the_run():
    out, ref, calls = lowered(QKV(3, between=True), rand(2, 5, 32))
    assert fused(calls) == [([aten.mul.Tensor], [False], 2)]  # the two after the other linear
    assert [c.target for c in calls].count(FP8_LINEAR) == 2  # the first and the one between
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("dropout", [False, True])
def test_the_concatenation_and_its_gelu_fold_into_the_quantisation(dropout):
    out, ref, calls = lowered(Single(dropout=dropout), rand(2, 5, 16), rand(2, 5, 32, seed=2))
    assert fused(calls) == [(["placeholder", FP8_LINEAR], [False, True], 1)]
    targets = [c.target for c in calls]
    assert aten.cat.default not in targets and aten.gelu.default not in targets
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_the_feed_forwards_gelu_folds_through_its_dropout():
    out, ref, calls = lowered(FeedForward(), rand(2, 5, 32))
    assert fused(calls) == [([FP8_LINEAR], [True], 1)]
    assert aten.gelu.default not in [c.target for c in calls]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize(
    "variant,left",
    [
        (dict(approximate="none"), "gelu"),  # erf GELU: the kernel computes tanh GELU only
        (dict(reuse="gelu"), "gelu"),  # the GELU's output is read elsewhere: it stays
        (dict(reuse="cat"), "cat"),  # so is the concatenation
        (dict(parts=3), "cat"),  # three parts: the kernel takes one or two
        (dict(dim=1), "cat"),  # not along the features
    ],
)
def test_other_producers_are_left_alone(variant, left):
    out, ref, calls = lowered(Single(**variant), rand(2, 5, 16), rand(2, 5, 32, seed=2))
    targets = [c.target for c in calls]
    if left == "gelu":  # the concatenation folds, the GELU stays one of its parts
        assert aten.gelu.default in targets and aten.cat.default not in targets
        assert fused(calls) == [(["placeholder", aten.gelu.default], [False, False], 1)]
    if left == "cat":  # one linear over a plain input: nothing to share, nothing to fold
        assert aten.cat.default in targets and FP8_LINEARS not in targets
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_a_concatenation_that_promotes_its_parts_is_left_alone():
    """``cat`` promotes mixed dtypes, the op takes one: a bf16 GELU beside an fp32 part stays."""

    class Mixed(Single):
        def forward(self, attn, x):
            return self.out(torch.cat([attn, F.gelu(self.mlp(x), approximate="tanh").bfloat16()], -1))

    out, ref, calls = lowered(Mixed(), rand(2, 5, 16), rand(2, 5, 32, seed=2))
    assert aten.cat.default in [c.target for c in calls] and FP8_LINEARS not in [c.target for c in calls]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_the_switch_and_a_lone_linear_leave_fp8_linear():
    for module, args, switches in (
        (QKV(3), (rand(2, 5, 32),), dict(fp8_inputs=False)),
        (Single(), (rand(2, 5, 16), rand(2, 5, 32)), dict(fp8_inputs=False)),
        (QKV(1), (rand(2, 5, 32),), {}),
    ):
        out, ref, calls = lowered(module, *args, **switches)
        assert FP8_LINEARS not in [c.target for c in calls]
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_the_op_checks_its_arguments_in_one_line():
    (w, s), k = fp8.quantize_weight(rand(8, 24)), 24
    a, b = rand(3, 16), rand(3, 8)
    op = torch.ops.prx_compile.fp8_linears
    (out,) = op([a, b], [False, True], [w], [s], [None])
    ref = torch.ops.prx_compile.fp8_linear(torch.cat([a, F.gelu(b, approximate="tanh")], -1), w, s, None)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    cases = [
        (([a, b], [False], [w], [s], [None]), "one gelu flag per part"),
        (([a, b], [False, False], [w], [s], []), "one scale and one bias"),
        (([a, rand(2, 8)], [False, False], [w], [s], [None]), "part 1 is"),
        (([a, b.double()], [False, False], [w], [s], [None]), "part 1 is"),
        (([a], [False], [w], [s], [None]), f"the input has 16 features, weights_fp8\\[0\\] {k}"),
        (([a, b], [False, False], [w], [s], [rand(7)]), r"biases\[0\] must have shape \(8,\)"),
        (([a, b[:, :0]], [False, False], [w], [s], [None]), r"part 1 is \(3, 0\)"),
        (([a.int(), b.int()], [False, False], [w], [s], [None]), "takes no torch.int32 input"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            op(*args)
    from prx_compile.ops.kernels import rows_quant_fp8

    bad = (([], []), ([a, rand(2, 8)], [False, False]), ([a], [False, True]), ([a[:, :0]], [False]))
    for parts, gelu in bad:
        with pytest.raises(ValueError, match="rows_quant_fp8 needs"):
            rows_quant_fp8(parts, gelu)
