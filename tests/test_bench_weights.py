"""The benchmarks' full-size models get their weights from ``benchmarks/common.made_model``: checked
here on the tiny configurations (the same code path the GPU runs take, on a CPU)."""

import sys
from pathlib import Path

import pytest
import torch

from prx_compile.models import SPECS
from prx_compile.tools.testing import TINY_FLUX, TINY_PIXEL_PRX

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import common  # noqa: E402


@pytest.mark.parametrize("family,config", [("flux", TINY_FLUX), ("prx", TINY_PIXEL_PRX)])
def test_constructed_weights_are_diffusers_own_and_not_degenerate(family, config):
    spec = SPECS[family]
    model = common.made_model(spec, config, "constructed", "cpu", torch.float32, seed=3)
    torch.manual_seed(3)
    ref = spec.nondegenerate_(spec.model_class()(**config), seed=3)
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    weights = [p for name, p in model.named_parameters() if p.dim() == 2]
    assert all(p.std() > 0 for p in weights)  # PRX's zero modulation re-drawn; nothing left at zero
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    half = common.made_model(spec, config, "constructed", "cpu", torch.bfloat16, seed=3)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored


def test_scaled_weights_are_init_random_and_a_bad_name_is_refused():
    spec = SPECS["flux"]
    model = common.made_model(spec, TINY_FLUX, "scaled", "cpu", torch.float32)
    ref = common.init_random_(spec.construct(TINY_FLUX).to_empty(device="cpu").requires_grad_(False), seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    with pytest.raises(ValueError, match="is not one of"):
        common.made_model(spec, TINY_FLUX, "zeros", "cpu", torch.float32)
