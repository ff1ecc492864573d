"""The fp8_norm rule on hand-made graphs: which modulated layer norms go into the quantising pass
of the FP8 op that reads them, which are left alone, and exactness against the unlowered graph."""

import operator

import pytest
import torch
import torch.nn.functional as F

from prx_compile.ops import FP8_GATED_MLP, FP8_LINEAR, FP8_LINEARS
from prx_compile.quant import fp8

from .test_fp8_inputs import linears, lowered, rand

aten = torch.ops.aten


class Modulated(torch.nn.Module):
    """A block's input: ``norm(x) * (1 + scale) + shift`` (FLUX.1's order; ``prx``: PRX's
    ``(1 + scale) * norm(x) + shift``), read by ``n`` FP8 linears (or the gated MLP)."""

    def __init__(self, n=1, prx=False, mlp=False, affine=False, read_x=False, per_token=False, dims=None):
        super().__init__()
        self.norm = torch.nn.LayerNorm(32, elementwise_affine=affine, eps=1e-6)
        if affine:
            torch.nn.init.normal_(self.norm.weight, 1.0, 0.3)
        self.lin = linears(*[(16 + 8 * i, 32) for i in range(n)])
        self.gate, self.up = linears((48, 32), (48, 32), bias=False, seed=2)
        self.down = linears((32, 48), bias=False, seed=3)[0]
        self.prx, self.mlp, self.read_x, self.per_token, self.dims = prx, mlp, read_x, per_token, dims
        self.mod = torch.nn.Linear(32, 64)

    def forward(self, x, temb):
        scale, shift = self.mod(temb)[:, None, :].chunk(2, dim=-1)  # (B, 1, 32) each
        if self.per_token:  # one scale per token: not a per-batch modulation
            scale = scale.expand(-1, x.shape[1], -1) * torch.linspace(0.5, 1.5, x.shape[1])[None, :, None]
        if self.dims is not None:
            x = x.reshape(self.dims)
            scale, shift = scale[:1, 0], shift[:1, 0]  # (1, 32)
        h = (1 + scale) * self.norm(x) + shift if self.prx else self.norm(x) * (1 + scale) + shift
        if self.mlp:
            return self.down(F.gelu(self.gate(h), approximate="tanh") * self.up(h))
        outs = [lin(h) for lin in self.lin]
        if self.read_x:
            outs.append(h[..., :8] + 1)
        return torch.cat(outs, -1)


def normed(calls):
    """(target, input's target or op, norm eps) of each FP8 op that carries a norm."""
    out = []
    for n in calls:
        if n.target in (FP8_LINEARS, FP8_GATED_MLP) and len(n.args) > (5 if n.target == FP8_LINEARS else 7):
            x = n.args[0][0] if n.target == FP8_LINEARS else n.args[0]
            out.append((n.target, x.target if x.op == "call_function" else x.op, n.args[-1]))
    return out


ARGS = (rand(2, 5, 32), rand(2, 32, seed=2))


@pytest.mark.parametrize("prx", [False, True])
@pytest.mark.parametrize("n", [1, 3])
def test_a_modulated_norm_goes_into_the_quantising_pass_exactly(n, prx):
    out, ref, calls = lowered(Modulated(n, prx=prx), *ARGS)
    assert normed(calls) == [(FP8_LINEARS, "placeholder", 1e-6)]
    targets = [c.target for c in calls]
    assert aten.layer_norm.default not in targets and FP8_LINEAR not in targets
    assert targets.count(operator.getitem) >= n
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("prx", [False, True])
def test_the_gated_mlps_norm_goes_into_its_first_quantisation(prx):
    out, ref, calls = lowered(Modulated(mlp=True, prx=prx), *ARGS)
    assert normed(calls) == [(FP8_GATED_MLP, "placeholder", 1e-6)]
    assert aten.layer_norm.default not in [c.target for c in calls]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize(
    "variant,switches",
    [
        (dict(affine=True), {}),  # a norm with its own weight: the kernel takes none
        (dict(read_x=True), {}),  # the modulated input is read elsewhere too
        (dict(n=3), dict(fp8_inputs=False)),  # three linears read it, one quantisation each
        (dict(per_token=True), {}),  # one scale per token, not per batch row
        (dict(dims=(10, 32)), {}),  # 2-D rows: no batch to take the modulation from
        ({}, dict(fp8_norm=False)),  # the switch
    ],
)
def test_other_norms_are_left_alone(variant, switches):
    out, ref, calls = lowered(Modulated(**variant), *ARGS, **switches)
    assert normed(calls) == []
    assert aten.layer_norm.default in [c.target for c in calls]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_a_modulation_of_another_dtype_is_left_alone():
    """A bf16 scale and shift over an fp32 norm: torch promotes, the op would refuse the mix."""

    class Promoted(Modulated):
        def forward(self, x, temb):
            scale, shift = self.mod(temb)[:, None, :].chunk(2, dim=-1)
            return self.lin[0](self.norm(x) * (1 + scale.bfloat16()) + shift.bfloat16())

    out, ref, calls = lowered(Promoted(), *ARGS)
    assert normed(calls) == [] and aten.layer_norm.default in [c.target for c in calls]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("form", ["n * n + shift", "p + p"])
def test_a_norm_that_is_its_own_modulation_is_left_alone(form):
    """With one token a (B, 1, K) norm output has the modulation's shape: ``n * n + shift`` and
    ``p + p`` (p = n * (1 + scale)) must not be taken for one (the rule would fold what it reads)."""

    class Square(Modulated):
        def forward(self, x, temb):
            scale, shift = self.mod(temb)[:, None, :].chunk(2, dim=-1)
            n = self.norm(x)
            if form == "n * n + shift":
                return self.lin[0](n * n + shift)
            p = n * (1 + scale)
            return self.lin[0](p + p)

    args = (rand(2, 1, 32), ARGS[1])
    out, ref, calls = lowered(Square(), *args)
    assert normed(calls) == []
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_the_ops_check_their_norm_in_one_line():
    x, m, s = rand(2, 5, 24), rand(2, 1, 24, seed=3), rand(2, 1, 24, seed=4)
    (w, ws), (g, gs), (d, ds) = (fp8.quantize_weight(rand(*shape)) for shape in ((8, 24), (16, 24), (24, 16)))
    lins, mlp = torch.ops.prx_compile.fp8_linears, torch.ops.prx_compile.fp8_gated_mlp
    ref = F.layer_norm(x, (24,), eps=1e-5) * m + s
    (out,) = lins([x], [False], [w], [ws], [None], m, s, 1e-5)
    torch.testing.assert_close(out, torch.ops.prx_compile.fp8_linear(ref, w, ws, None), rtol=0, atol=0)
    out = mlp(x, g, gs, g, gs, d, ds, m[:1], s, 1e-5)  # a (1, 1, K) multiplier broadcasts
    ref = F.layer_norm(x, (24,), eps=1e-5) * m[:1] + s
    torch.testing.assert_close(out, mlp(ref, g, gs, g, gs, d, ds), rtol=0, atol=0)
    cases = [
        (([x], [False], [w], [ws], [None], m, None, 1e-5), "come together"),
        (([x[0]], [False], [w], [ws], [None], m[0], s[0], 1e-5), r"needs x \(B, L, K\)"),
        (([x], [False], [w], [ws], [None], rand(2, 5, 24), s, 1e-5), "does not broadcast"),
        (([x], [False], [w], [ws], [None], m.double(), s, 1e-5), "norm_mult is"),
        (([x], [False], [w], [ws], [None], m, s, -1.0), "finite and >= 0"),
        (([x], [False], [w], [ws], [None], m, s, float("nan")), "finite and >= 0"),
        (([x], [True], [w], [ws], [None], m, s, 1e-5), "one part without GELU"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            lins(*args)
    from prx_compile.ops.kernels import rows_quant_fp8

    rows = x.reshape(10, 24)
    bad = [
        ([rows], [False], (m.reshape(2, 24), s.reshape(2, 24)[:, :8], 1e-5), "needs"),
        ([rows], [False], (rand(3, 24), rand(3, 24), 1e-5), "needs"),  # 10 rows are not 3 batches
        ([rows, rows], [False, False], (m.reshape(2, 24), s.reshape(2, 24), 1e-5), "needs"),
        ([rows], [False], (m.reshape(2, 24), s.reshape(2, 24)), "is \\(mult, shift, eps: float\\)"),
        ([rows], [False], (None, s.reshape(2, 24), 1e-5), "is \\(mult"),
        ([rows], [False], (m.reshape(2, 24), s.reshape(2, 24), 0), "is \\(mult"),
    ]
    for parts, gelu, norm, match in bad:
        with pytest.raises(ValueError, match=f"rows_quant_fp8's norm {match}"):
            rows_quant_fp8(parts, gelu, norm)
