"""FLUX.1 through the model spec, on a CPU (eager backend): the compiled step against eager, the export
that traces one block of each list, LoRA in diffusers' and kohya's layouts, save and load, FP8, the
FluxPipeline drop-in, and the classes that are refused at compile time."""

import math

import pytest
import torch

from prx_compile import (
    ConfigError,
    compile_prx,
    compile_transformer,
    load_compiled,
    load_lora,
    save_compiled,
    set_lora,
    unload_lora,
)
from prx_compile.export import example_inputs, export_step, weight_tensors
from prx_compile.lora import make_random_lora
from prx_compile.shapes import ShapeRange
from prx_compile.tools.testing import TINY_FLUX, make_flux, make_prx, tiny_flux_pipeline

from .conftest import eager

#: one static set: 16² pixels with a 1x VAE are 64 packed image tokens; 8 text tokens, batch 1..2
SMALL = dict(
    batch=[1, 2], text_len=[8, 8], resolution=16, vae_scale_factor=1, aspect_bins=[], specialize=[[16, 16, 2]]
)


def flux_inputs(model, batch=2, tokens=64, text=8, seed=0):
    return example_inputs(model, batch, tokens, 1, text, seed=seed)


def test_the_compiled_step_is_eagers_and_takes_flux_arguments():
    model = make_flux()
    ct = compile_transformer(model, backend="eager", device="cpu", static=True, **SMALL)
    assert ct.spec.name == "flux" and ct.compile_config.model == "flux"
    assert [b.shapes.describe() for b in ct.backends] == ["batch 2, 64 image tokens, text 8 tokens"]
    kw = flux_inputs(model)
    assert torch.equal(ct(**kw).sample, eager(model, kw))
    # positional, as diffusers' signature orders them; 3-D ids (deprecated) and a scalar timestep
    args = [kw[k] for k in ("hidden_states", "encoder_hidden_states", "pooled_projections")]
    out = ct(*args, timestep=0.5, img_ids=kw["img_ids"][None], txt_ids=kw["txt_ids"], guidance=kw["guidance"])
    ref = eager(model, {**kw, "timestep": torch.full((2,), 0.5)})
    assert torch.equal(out.sample, ref)
    kernels = ct.report()["kernels"]  # a CPU measures nothing: the first candidate, PyTorch's cuDNN SDPA
    assert (kernels["attention"], kernels["how"]) == ("cudnn", "not measured (no CUDA)"), kernels


def test_bad_flux_inputs_are_one_line_before_any_work():
    model = make_flux()
    ct = compile_transformer(model, backend="eager", device="cpu", static=True, **SMALL)
    kw = flux_inputs(model)
    cases = [
        (
            {"pooled_projections": kw["pooled_projections"][:1]},
            r"batch: hidden_states 2.*pooled_projections 1",
        ),
        ({"img_ids": kw["img_ids"][:5]}, r"img_ids has shape \(5, 3\), expected \(64, 3\)"),
        ({"guidance": None}, r"guidance is None, and this FLUX transformer has a guidance embedding"),
        ({"timestep": torch.zeros(2, 3)}, r"timestep has shape \(2, 3\), expected \(2,\), \(1,\)"),
        ({"joint_attention_kwargs": {"scale": 0.5}}, r"joint_attention_kwargs \['scale'\].*set_adapters"),
        ({"controlnet_block_samples": [kw["hidden_states"]]}, r"ControlNet residuals are not supported"),
        ({"prompt": "a cat"}, r"forward: got an unexpected keyword argument 'prompt'.*its arguments"),
    ]
    for change, message in cases:
        with pytest.raises(
            ConfigError
            if "ControlNet" in message or "forward" in message or "joint" in message
            else Exception,
            match=message,
        ):
            ct(**{**kw, **change})
    assert not any(b.is_built for b in ct.backends)  # refused before anything was built


def test_a_token_range_follows_set_expected_dynamic_shape_range():
    from torch.export import Dim

    model = make_flux()
    ct = compile_transformer(model, backend="eager", device="cpu", static=True, **SMALL)
    shapes = ct.set_expected_dynamic_shape_range(
        kwargs_dynamic_shape={"hidden_states": {0: Dim("b", min=1, max=2), 1: Dim("l", min=16, max=144)}}
    )
    assert shapes == ShapeRange((1, 2), (16, 144), (1, 1), (8, 8), multiple=1, tokens=True)
    for tokens in (36, 100):  # two grids on one range set
        kw = flux_inputs(model, batch=1, tokens=tokens, seed=tokens)
        torch.testing.assert_close(ct(**kw, return_dict=False)[0], eager(model, kw), rtol=0, atol=1e-5)
    assert [b.shapes.is_static() for b in ct.backends] == [True, False] and ct.builds == 1


def test_one_block_of_each_list_is_traced_and_copied_to_the_full_graph():
    """Two block lists (19 double, 38 single in FLUX.1; 3 and 4 here), each block returning
    (encoder_hidden_states, hidden_states): the copied export runs the same operations as the full
    one and gives eager's numbers, static and over a token range."""
    from collections import Counter

    model = make_flux({**TINY_FLUX, "num_layers": 3, "num_single_layers": 4})
    kw = flux_inputs(model, batch=2, tokens=16)
    names = list(weight_tensors(model))
    weights = list(weight_tensors(model).values())
    for shapes in (None, ShapeRange((1, 2), (4, 64), (1, 1), (4, 16), multiple=1, tokens=True)):
        once, n1 = export_step(model, kw, shapes, weights="inputs", fuse_attention=True)
        full, n2 = export_step(
            model, kw, shapes, weights="inputs", fuse_attention=True, trace_blocks_once=False
        )
        assert n1 == n2 == names

        def ops(ep):
            return Counter(
                str(n.target)
                for n in ep.graph.nodes
                if n.op == "call_function" and "sym" not in str(n.target)
            )

        assert ops(once)["prx_compile.flux_attention.default"] == 7
        assert {k: v for k, v in ops(once).items() if "sym" not in k and k != "<built-in function add>"} == {
            k: v for k, v in ops(full).items() if "sym" not in k and k != "<built-in function add>"
        }
        for other in (
            [kw] if shapes is None else [kw, flux_inputs(model, batch=2, tokens=36, text=12, seed=1)]
        ):
            with torch.no_grad():
                got = once.module()(**other, weights=weights)
            assert torch.equal(got, eager(model, other))


@pytest.mark.parametrize("axes", [[4, 6, 4], [4, 12], [4, 5, 7]], ids=["sum", "count", "odd"])
def test_rope_axes_diffusers_accepts_but_cannot_run_are_refused_at_compile_time(axes):
    """FLUX's RoPE takes 3 even sizes (one per id column) summing to the head dimension; diffusers
    builds the model and fails at its first call."""
    model = make_flux({**TINY_FLUX, "axes_dims_rope": axes})
    with pytest.raises(ConfigError, match=r"axes_dims_rope=.* must be 3 positive even sizes summing to 16"):
        compile_transformer(model, backend="eager", device="cpu")


def test_unsupported_classes_are_refused_at_compile_time_in_one_line():
    from diffusers import SD3Transformer2DModel

    sd3 = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=8,
        out_channels=4,
    )
    with pytest.raises(
        ConfigError,
        match=r"SD3Transformer2DModel is not a transformer prx_compile can compile.*"
        r"supported: PRXTransformer2DModel, FluxTransformer2DModel",
    ):
        compile_transformer(sd3, backend="eager", device="cpu")
    with pytest.raises(
        ConfigError,
        match=r"compile_prx takes a PRXTransformer2DModel, got FluxTransformer2DModel.*"
        r"compile_transformer",
    ):
        compile_prx(make_flux(), backend="eager", device="cpu")
    with pytest.raises(
        ConfigError, match=r"config is for model 'flux' and the transformer is a PRXTransformer2DModel"
    ):
        compile_transformer(make_prx(), config="flux-1024-bf16", backend="eager", device="cpu")


def _merged(model, lora, scale=1.0):
    """The weights of ``model`` with a PEFT-layout LoRA merged by hand: W + scale * B @ A (alpha = r)."""
    out = {}
    for key, down in lora.items():
        if not key.endswith("lora_A.weight"):
            continue
        module = key[len("transformer.") : -len(".lora_A.weight")]
        up = lora[key.replace("lora_A", "lora_B")]
        w = model.get_submodule(module).weight
        out[f"{module}.weight"] = (w.float() + scale * up.float() @ down.float()).to(w.dtype)
    return out


def test_lora_in_diffusers_layout_switches_exactly_on_the_compiled_module():
    model = make_flux()
    ct = compile_transformer(model, backend="eager", device="cpu", static=True, **SMALL)
    kw = flux_inputs(model)
    base = ct(**kw, return_dict=False)[0].clone()
    a, b = make_random_lora(model, rank=4, seed=1, std=0.1), make_random_lora(model, rank=4, seed=2, std=0.1)
    assert len(a) == 2 * (12 * 2 + 5 * 2)  # every block linear of 2 double and 2 single blocks
    expected = _merged(model, a, 0.8)
    load_lora(ct, a, "a", scale=0.8)
    for fqn, w in expected.items():
        torch.testing.assert_close(model.get_parameter(fqn), w, rtol=0, atol=1e-6)
    with_a = ct(**kw, return_dict=False)[0].clone()
    assert (with_a - base).abs().max() > 1e-3
    torch.testing.assert_close(with_a, eager(model, kw), rtol=0, atol=1e-6)
    load_lora(ct, b, "b")
    set_lora(ct, "a", 0.8)
    assert torch.equal(ct(**kw, return_dict=False)[0], with_a)  # A -> B -> A: the same bits
    unload_lora(ct)
    assert torch.equal(ct(**kw, return_dict=False)[0], base)


def _kohya_flux(model, rank=4, seed=0, std=0.1, alpha=2.0):
    """A kohya-layout FLUX LoRA (the original model's layer names: q, k and v fused in one matrix)
    for the tiny FLUX, and what it means in diffusers' layers, worked out by hand: {weight FQN: delta}."""
    g = torch.Generator().manual_seed(seed)
    dim = model.config.num_attention_heads * model.config.attention_head_dim
    mlp = model.single_transformer_blocks[0].mlp_hidden_dim
    sd, deltas = {}, {}

    def add(key, out_features, in_features, targets):
        down = torch.randn(rank, in_features, generator=g) * std
        up = torch.randn(out_features, rank, generator=g) * std
        sd[f"lora_unet_{key}.lora_down.weight"], sd[f"lora_unet_{key}.lora_up.weight"] = down, up
        sd[f"lora_unet_{key}.alpha"] = torch.tensor(alpha)
        start = 0
        for fqn, rows in targets:
            deltas[fqn] = (up[start : start + rows] @ down) * (alpha / rank)
            start += rows

    for i in range(len(model.transformer_blocks)):
        p = f"transformer_blocks.{i}.attn"
        add(f"double_blocks_{i}_img_attn_qkv", 3 * dim, dim, [(f"{p}.to_{x}.weight", dim) for x in "qkv"])
        add(f"double_blocks_{i}_txt_attn_proj", dim, dim, [(f"{p}.to_add_out.weight", dim)])
    for i in range(len(model.single_transformer_blocks)):
        p = f"single_transformer_blocks.{i}"
        targets = [(f"{p}.attn.to_{x}.weight", dim) for x in "qkv"] + [(f"{p}.proj_mlp.weight", mlp)]
        add(f"single_blocks_{i}_linear1", 3 * dim + mlp, dim, targets)
    return sd, deltas


def test_a_kohya_flux_lora_names_the_original_layers_and_means_the_same():
    model = make_flux()
    sd, deltas = _kohya_flux(model)
    base = {fqn: model.get_parameter(fqn).detach().clone() for fqn in deltas}
    ct = compile_transformer(model, backend="eager", device="cpu", static=True, **SMALL)
    report = load_lora(ct, sd, "kohya")
    assert report["layers"] == len(deltas)
    for fqn, delta in deltas.items():
        torch.testing.assert_close(model.get_parameter(fqn), base[fqn] + delta, rtol=0, atol=1e-6)
    kw = flux_inputs(model)
    torch.testing.assert_close(ct(**kw, return_dict=False)[0], eager(model, kw), rtol=0, atol=1e-6)
    unload_lora(ct)
    assert all(torch.equal(model.get_parameter(fqn), base[fqn]) for fqn in deltas)
    broken = {k: v for k, v in sd.items() if "lora_up" not in k or "single" not in k}
    with pytest.raises(Exception, match=r"LoRA 'broken'"):
        load_lora(ct, broken, "broken")


def test_save_and_load_with_a_lora_keep_the_adapters_and_the_numbers(tmp_path):
    model = make_flux()
    ct = compile_transformer(model, backend="eager", device="cpu", static=True, **SMALL)
    load_lora(ct, make_random_lora(model, rank=4, seed=3, std=0.1), "style", scale=0.7)
    kw = flux_inputs(model)
    want = ct(**kw, return_dict=False)[0].clone()
    save_compiled(ct, tmp_path / "flux.art")
    loaded = load_compiled(tmp_path / "flux.art")
    assert loaded.spec.name == "flux" and type(loaded.transformer).__name__ == "FluxTransformer2DModel"
    assert torch.equal(loaded(**kw, return_dict=False)[0], want)
    unload_lora(ct)
    unload_lora(loaded)
    assert torch.equal(loaded(**kw, return_dict=False)[0], ct(**kw, return_dict=False)[0])


def test_fp8_quantises_every_block_linear_and_stays_close():
    model = make_flux()
    ref = eager(model, flux_inputs(model))
    ct = compile_transformer(model, backend="eager", device="cpu", static=True, precision="fp8", **SMALL)
    from prx_compile.quant import fp8

    assert fp8.fp8_modules(model) == 12 * 2 + 5 * 2
    out = ct(**flux_inputs(model), return_dict=False)[0]
    err = float((out - ref).norm() / ref.norm())
    assert 0 < err < 0.05 and math.isfinite(err)


def test_fp8_inputs_are_quantised_once_with_their_norm_gelu_and_concatenation():
    """Rules ``fp8_inputs`` and ``fp8_norm`` on FLUX.1: per double block the image and text q/k/v
    projections share one quantisation each and both feed-forwards' second linears take their GELU
    into it; per single block the q/k/v and MLP projections share one, and ``proj_out`` takes the
    concatenation and the MLP's GELU. Each modulated norm (both q/k/v groups, both feed-forwards'
    first linears, a single block's group) runs in its quantisation. On a CPU the step equals the
    unfused one bit for bit."""
    model = make_flux()
    kw = flux_inputs(model)
    outs, ops = [], []
    for inputs, norm in ((True, True), (True, False), (False, False)):
        ct = compile_transformer(
            model,
            backend="eager",
            device="cpu",
            static=True,
            precision="fp8",
            fp8_inputs=inputs,
            fp8_norm=norm,
            **SMALL,
        )
        outs.append(ct(**kw, return_dict=False)[0])
        ops.append(ct.report()["torch_ops"])
    double, single = TINY_FLUX["num_layers"], TINY_FLUX["num_single_layers"]
    assert ops[0]["prx_compile.fp8_linears.default"] == 6 * double + 2 * single
    assert ops[0]["prx_compile.fp8_linear.default"] == 2 * double  # to_out, to_add_out
    assert ops[1]["prx_compile.fp8_linears.default"] == 4 * double + 2 * single
    assert ops[1]["prx_compile.fp8_linear.default"] == 4 * double  # to_out, to_add_out, both MLPs' first
    assert ops[2]["prx_compile.fp8_linear.default"] == 12 * double + 5 * single
    assert "prx_compile.fp8_linears.default" not in ops[2]
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2])


def test_the_flux_pipeline_runs_the_compiled_transformer_and_makes_eagers_latents():
    pipe = tiny_flux_pipeline()
    args = dict(prompt="a cat", height=16, width=16, num_inference_steps=3, max_sequence_length=8)
    ref = pipe(**args, output_type="latent", generator=torch.Generator().manual_seed(0)).images
    pipe.transformer = compile_transformer(pipe.transformer, backend="eager", device="cpu", **SMALL)
    out = pipe(**args, output_type="latent", generator=torch.Generator().manual_seed(0)).images
    assert torch.equal(out, ref) and ref.abs().max() > 0.1
    image = pipe(**args, generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (16, 16)


def test_another_flux_pipeline_from_pipe_takes_the_compiled_transformer_when_named():
    """diffusers' ``from_pipe`` carries a model over only if its type is exactly the type hint's (a
    compiled transformer's class is a subclass: diffusers warns and raises); named, it is carried
    over, and an img2img run makes eager's latents."""
    import numpy as np
    from diffusers import FluxImg2ImgPipeline
    from PIL import Image

    pipe, ref = tiny_flux_pipeline(make_flux(seed=0)), tiny_flux_pipeline(make_flux(seed=0))
    pipe.transformer = compile_transformer(pipe.transformer, backend="eager", device="cpu", **SMALL)
    with pytest.raises(ValueError, match="transformer"):
        FluxImg2ImgPipeline.from_pipe(pipe)
    img2img = FluxImg2ImgPipeline.from_pipe(pipe, transformer=pipe.transformer)
    assert img2img.transformer is pipe.transformer
    image = Image.fromarray((np.random.RandomState(0).rand(16, 16, 3) * 255).astype("uint8"))
    args = dict(prompt="a cat", image=image, strength=0.8, height=16, width=16, num_inference_steps=2)
    args.update(max_sequence_length=8, output_type="latent")
    out = img2img(**args, generator=torch.Generator().manual_seed(0)).images
    want = FluxImg2ImgPipeline.from_pipe(ref)(**args, generator=torch.Generator().manual_seed(0)).images
    assert torch.equal(out, want) and want.abs().max() > 0.1


def test_the_fused_attention_is_diffusers_processor_op_for_op():
    """``flux_attention`` (norms, text first, RoPE as rotations, attention) in place of diffusers'
    processor: the same numbers in fp32 (CPU), in double and single blocks; a rotation table that
    swapped sin's sign or the pair order would be 1e-1 off."""
    from prx_compile.models.flux import fused_attention_processors

    model = make_flux({**TINY_FLUX, "num_layers": 2, "num_single_layers": 2})
    kw = example_inputs(model, 2, 16, 1, 8, seed=3)
    ref = eager(model, kw)
    with fused_attention_processors(model) as swapped:
        out = eager(model, kw)
    assert swapped == 4
    assert (out - ref).norm() / ref.norm() < 1e-5


def test_the_fused_attention_names_a_bad_operand_in_one_line():
    from prx_compile.ops import flux_attention

    b, n, t, h, d = 1, 4, 2, 2, 8
    x, tx = torch.randn(b, n, h * d), torch.randn(b, t, h * d)
    w = torch.ones(d)
    cos, sin = torch.ones(t + n, d), torch.zeros(t + n, d)
    out = flux_attention(x, x, x, tx, tx, tx, w, w, w, w, cos, sin, h, 1e-6, d**-0.5, "sdpa")
    assert out.shape == (b, t + n, h * d)
    with pytest.raises(ValueError, match="text_key has shape"):
        flux_attention(x, x, x, tx, x, tx, w, w, w, w, cos, sin, h, 1e-6, d**-0.5, "sdpa")
    with pytest.raises(ValueError, match="cos and sin"):
        flux_attention(x, x, x, tx, tx, tx, w, w, w, w, cos[:n], sin[:n], h, 1e-6, d**-0.5, "sdpa")
    with pytest.raises(ValueError, match="text_q_weight"):
        flux_attention(x, x, x, tx, tx, tx, w, w, None, w, cos, sin, h, 1e-6, d**-0.5, "sdpa")
    with pytest.raises(ValueError, match="for heads=3"):  # 16 channels are no 3 heads
        flux_attention(x, x, x, tx, tx, tx, w, w, w, w, cos, sin, 3, 1e-6, d**-0.5, "sdpa")
    with pytest.raises(ValueError, match="for heads=2"):  # no channel at all: heads would be unbounded
        e = x[..., :0]
        flux_attention(e, e, e, None, None, None, w[:0], w[:0], None, None, None, None, 2, 1e-6, 1.0, "sdpa")
    odd, w3 = torch.randn(b, n, 6), torch.ones(3)  # 2 heads of 3: RoPE needs pairs
    with pytest.raises(ValueError, match="must be even"):
        flux_attention(
            odd,
            odd,
            odd,
            None,
            None,
            None,
            w3,
            w3,
            None,
            None,
            cos[:n, :3],
            sin[:n, :3],
            2,
            1e-6,
            1.0,
            "sdpa",
        )


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_a_lowered_and_decomposed_flux_export_copies_both_block_lists(precision):
    """As a TensorRT build exports (``prepare``: our rules, then the decompositions, both of which drop
    dead code): the last single block's text tokens, which nothing reads after it, keep their place in
    the block's boundary, so one block of each list is traced and copied (0.18 traced every block:
    11-13 s of FLUX.1-dev's first call) and the result is the full export's. In fp8 the copies hold
    ``fp8_linears`` (lists of weights in, a list out) like the block they copy."""
    from prx_compile.export.repeat import BOUNDARY
    from prx_compile.lowering import lower
    from prx_compile.models import spec_for
    from prx_compile.quant import fp8

    model = make_flux({**TINY_FLUX, "num_layers": 3, "num_single_layers": 4})
    if precision == "fp8":
        fp8.install(model, spec_for(model).block_linears)
    kw = flux_inputs(model, batch=2, tokens=16)
    prepared = []

    def prepare(ep):
        prepared.append(sum(n.target is BOUNDARY for n in ep.graph.nodes))
        lower(ep.graph_module, None, kernels=False)
        return ep.run_decompositions(torch.export.default_decompositions())

    once, names = export_step(model, kw, None, weights="inputs", fuse_attention=True, prepare=prepare)
    assert prepared == [4]  # one marked block per list, its inputs and its outputs; no full export after
    full, _ = export_step(
        model, kw, None, weights="inputs", fuse_attention=True, trace_blocks_once=False, prepare=prepare
    )
    from collections import Counter

    def ops(ep):
        return Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")

    assert ops(once) == ops(full)
    if precision == "fp8":
        assert ops(once)["prx_compile.fp8_linears.default"] == 6 * 3 + 2 * 4
    weights = [weight_tensors(model)[n] for n in names]
    with torch.no_grad():
        got = once.module()(**kw, weights=weights)
        assert torch.equal(got, full.module()(**kw, weights=weights))
    assert (got - eager(model, kw)).abs().max() <= 1e-5
