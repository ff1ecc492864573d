"""LoRA refit without rebuild, and save/load of the compiled engines, on the GPU."""

import pytest
import torch

from prx_compile import ArtifactError, compile_prx
from prx_compile.bench import rel_err
from prx_compile.lora import load_lora, make_random_lora, set_lora, unload_lora
from prx_compile.serialization import load_compiled, save_compiled
from prx_compile.testing import make_prx

from .conftest import RANGE, SMALL_PRX
from .test_tensorrt import eager, inputs

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def compiled():
    model = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    return model, compile_prx(model, **RANGE).build(inputs(model))


def test_lora_refits_without_rebuild_and_switches_exactly(compiled):
    model, ct = compiled
    kw = inputs(model)
    base = ct(**kw, return_dict=False)[0].clone()
    a, b = make_random_lora(model, 16, seed=1, std=0.05), make_random_lora(model, 16, seed=2, std=0.05)
    rep = load_lora(ct, a, "a")
    assert rep["refit"]["full_refit"] is False and ct.builds == 1
    out_a = ct(**kw, return_dict=False)[0].clone()
    assert rel_err(out_a, eager(model, kw)) < 2e-2 and rel_err(out_a, base) > 1e-2
    load_lora(ct, b, "b")
    set_lora(ct, "b")
    set_lora(ct, "a")
    assert torch.equal(ct(**kw, return_dict=False)[0], out_a)
    unload_lora(ct)
    assert torch.equal(ct(**kw, return_dict=False)[0], base)
    assert ct.report()["engines"] == SMALL_PRX["depth"] + 1 and ct.builds == 1


def test_save_load_roundtrip_and_tamper(compiled, tmp_path):
    model, ct = compiled
    kw = inputs(model)
    expected = ct(**kw, return_dict=False)[0]
    save_compiled(ct, tmp_path / "art")
    loaded = load_compiled(tmp_path / "art")
    assert torch.equal(loaded(**kw, return_dict=False)[0], expected)
    assert loaded.report()["engines"] == SMALL_PRX["depth"] + 1
    engine = next((tmp_path / "art" / "engines").iterdir())
    data = bytearray(engine.read_bytes())
    data[len(data) // 2] ^= 0xFF
    engine.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256"):
        load_compiled(tmp_path / "art")
