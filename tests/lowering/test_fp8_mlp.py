"""The fp8_mlp rule on hand-made graphs: which gated MLPs it fuses, which it leaves, exactness."""

import pytest
import torch
import torch.nn.functional as F

from prx_compile.lowering import LoweringSettings, lower
from prx_compile.ops import FP8_GATED_MLP, FP8_LINEAR
from prx_compile.quant import fp8


class Gated(torch.nn.Module):
    """PRX's MLP over FP8 linears, with the variants the rule must leave alone."""

    def __init__(
        self,
        approximate="tanh",
        reuse_gate=False,
        bias=False,
        swap=False,
        reuse_product=False,
        two_inputs=False,
    ):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        linears = [torch.nn.Linear(k, n, bias=bias) for n, k in ((96, 32), (96, 32), (32, 96))]
        for lin in linears:
            torch.nn.init.normal_(lin.weight, std=0.2, generator=g)
        self.gate, self.up, self.down = (fp8.FP8Linear.from_linear(lin) for lin in linears)
        self.approximate, self.reuse_gate, self.swap = approximate, reuse_gate, swap
        self.reuse_product, self.two_inputs = reuse_product, two_inputs

    def forward(self, x):
        gate = self.gate(x)
        act, up = F.gelu(gate, approximate=self.approximate), self.up(x * 2 if self.two_inputs else x)
        product = up * act if self.swap else act * up
        out = self.down(product)
        if self.reuse_gate:
            out = out + gate[..., :32]
        if self.reuse_product:
            out = out + product[..., :32]
        return out


def lowered(module, **switches):
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    switches = {"fp8_inputs": False, **switches}  # this rule alone (fp8_inputs would share gate's and up's x)
    gm = lower(torch.export.export(module, (x,)).module(), LoweringSettings(**switches))
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    return gm(x), module(x), ops


@pytest.mark.parametrize("swap", [False, True])
def test_fuses_the_gated_mlp_exactly(swap):
    out, ref, ops = lowered(Gated(swap=swap))  # gelu(gate) * up or up * gelu(gate)
    assert ops.count(FP8_GATED_MLP) == 1 and FP8_LINEAR not in ops
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize(
    "variant,switches",
    [
        (dict(approximate="none"), {}),  # erf GELU: the fused kernel computes tanh GELU only
        (dict(reuse_gate=True), {}),  # the gate's output is read elsewhere too
        (dict(reuse_product=True), {}),  # so is the product
        (dict(two_inputs=True), {}),  # gate and up read different inputs
        (dict(bias=True), {}),  # biases: the op has none
        ({}, dict(fp8_mlp=False)),  # the switch
    ],
)
def test_leaves_other_patterns_alone(variant, switches):
    out, ref, ops = lowered(Gated(**variant), **switches)
    assert FP8_GATED_MLP not in ops and ops.count(FP8_LINEAR) == 3
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
