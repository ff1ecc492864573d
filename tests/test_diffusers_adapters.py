"""diffusers' adapter methods on a compiled transformer (``runtime/adapters.py``): they act on the
LoRA ``prx_compile.load_lora`` loaded, the same as PEFT's act on PEFT layers (0.27's were PEFT's own:
``disable_lora``, ``delete_adapters`` and ``unload_lora_weights`` left the LoRA in the weights, silently).
CPU, eager backend, the tiny FLUX.1; outputs compared with diffusers' own LoRA (PEFT) on an eager
copy where PEFT is installed (the dev extra has it), and with ``set_lora`` on an eager copy."""

import pytest
import torch

from prx_compile import ConfigError, LoRAError, compile_transformer, load_lora, set_lora, unload_lora
from prx_compile.lora import make_random_lora
from prx_compile.tools.testing import make_flux, tiny_flux_pipeline

from .conftest import eager


def inputs(model):
    from prx_compile.export import example_inputs

    return example_inputs(model, 1, 64, 1, 8)  # FLUX: 64 image tokens, 8 text tokens


def loras(model):
    return {n: make_random_lora(model, rank=2, seed=s, std=0.2) for n, s in (("a", 1), ("b", 2))}


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_the_transformers_adapter_methods_act_on_the_loaded_lora():
    model, twin = make_flux(seed=0), make_flux(seed=0)
    ct = compile_transformer(model, backend="eager")
    kw = inputs(model)
    base = ct(**kw, return_dict=False)[0]
    with pytest.raises(LoRAError, match="set_adapters: no LoRA is loaded"):
        ct.set_adapters(["a"])
    ct.disable_lora(), ct.enable_lora(), ct.unload_lora()  # nothing loaded: nothing to do, as PEFT
    assert ct.active_adapters() == [] and not hasattr(ct, "peft_config")
    for name, lora in loras(model).items():
        load_lora(ct, lora, name)
        load_lora(twin, lora, name)

    def expect(names, scales):  # set_lora on the eager twin
        set_lora(twin, names, scales)
        return eager(twin, kw)

    def now():
        return ct(**kw, return_dict=False)[0]

    ct.set_adapters(["a", "b"], [0.5, None])  # None: 1.0, as diffusers
    both = expect(["a", "b"], [0.5, 1.0])
    assert rel(now(), both) < 1e-5 and rel(now(), base) > 1e-2  # the LoRA matters
    assert ct.active_adapters() == ["a", "b"] and list(ct.peft_config) == ["a", "b"]
    ct.disable_lora()
    assert torch.equal(now(), base) and ct.active_adapters() == []
    ct.set_adapters("a", 2.0)  # while disabled: what enable applies (PEFT keeps layers disabled)
    assert torch.equal(now(), base)
    ct.enable_lora()
    assert rel(now(), expect(["a"], [2.0])) < 1e-5
    ct.set_adapter("b")
    assert rel(now(), expect(["b"], [1.0])) < 1e-5
    ct.delete_adapters("b")  # the active one: as PEFT, the first left is active, at its last scale
    assert rel(now(), expect(["a"], [2.0])) < 1e-5 and list(ct.peft_config) == ["a"]
    with pytest.raises(LoRAError, match=r"no adapter named \['b'\] is loaded"):
        ct.set_adapters("b")
    ct.set_adapters("a")
    unload_lora(twin, "b")
    assert rel(now(), expect(["a"], [1.0])) < 1e-5
    ct.unload_lora()
    assert torch.equal(now(), base) and not hasattr(ct, "peft_config")
    for call, match in (
        (lambda: ct.load_lora_adapter({}), "use prx_compile.load_lora"),
        (lambda: ct.add_adapter(None), "use prx_compile.load_lora"),
        (lambda: ct.fuse_lora(), "LoRA is in its weights already"),
        (lambda: ct.unfuse_lora(), "LoRA is in its weights already"),
    ):
        with pytest.raises(ConfigError, match=match):
            call()
    load_lora(ct, loras(model)["a"], "a")
    with pytest.raises(LoRAError, match="per-block LoRA weights"):
        ct.set_adapters(["a"], [{"transformer_blocks.0": 1.0}])
    with pytest.raises(LoRAError, match="got 1 adapter names and 2 scales"):
        ct.set_adapters(["a"], [1.0, 2.0])


def test_a_pipelines_lora_methods_match_diffusers_peft_on_an_eager_copy():
    """The same sequence on a FluxPipeline with a compiled transformer (prx_compile's LoRA) and on one
    with the eager transformer (diffusers' load_lora_weights: PEFT layers)."""
    pytest.importorskip("peft")
    ours, theirs = tiny_flux_pipeline(make_flux(seed=0)), tiny_flux_pipeline(make_flux(seed=0))
    ours.transformer = compile_transformer(ours.transformer, backend="eager")
    kw = inputs(theirs.transformer)
    for name, lora in loras(theirs.transformer).items():
        load_lora(ours, lora, name)
        theirs.load_lora_weights(lora, adapter_name=name)

    def close():
        with torch.no_grad():
            a = ours.transformer(**kw, return_dict=False)[0]
            b = theirs.transformer(**kw, return_dict=False)[0]
        assert rel(a, b) < 1e-5, rel(a, b)
        assert ours.get_list_adapters() == theirs.get_list_adapters()

    # after loading, diffusers has the last adapter active, prx_compile's load_lora all it loaded
    for step in (
        lambda p: p.set_adapters(["a", "b"], adapter_weights=[0.5, 1.5]),
        lambda p: p.disable_lora(),
        lambda p: p.set_adapters("b", 0.7),
        lambda p: p.enable_lora(),
        lambda p: p.delete_adapters("b"),
        lambda p: p.set_adapters("a"),
        lambda p: p.unload_lora_weights(),
    ):
        step(ours), step(theirs)
        close()
    with pytest.raises(ConfigError, match="use prx_compile.load_lora"):
        ours.load_lora_weights(loras(theirs.transformer)["a"], adapter_name="c")
    assert not hasattr(ours.transformer.transformer, "peft_config")  # no PEFT layers were added
