"""PRXPixel (PRX in pixel space: RGB in, a large patch, a bottleneck ``img_in``, resolution embeddings),
tiny, on a CPU: the compiled step against eager (static and over a range, where the resolution
embedding follows the size), its defaults and presets, and the PRXPixelPipeline drop-in."""

import torch

from prx_compile import CompileConfig, compile_prx
from prx_compile.tools.testing import TINY_PIXEL_PRX, make_prx, tiny_pixel_pipeline

from .conftest import eager, plan_of, prx_inputs

SMALL = dict(batch=[1, 2], text_len=[1, 16], resolution=64, aspect_bins=[], specialize=[[64, 64, 2]])


def test_a_pixel_prx_compiles_against_eager_static_and_over_a_range():
    from torch.export import Dim

    model = make_prx(TINY_PIXEL_PRX)
    assert model.config.in_channels == 3 and model.resolution_embedder is not None
    ct = compile_prx(model, backend="eager", device="cpu", static=True, **SMALL)
    assert ct.compile_config.vae_scale_factor == 1  # no VAE: latents are pixels
    kw = prx_inputs(model, batch=2, h=64, w=64, text=16, masked=5)
    torch.testing.assert_close(ct(**kw, return_dict=False)[0], eager(model, kw), rtol=0, atol=1e-5)
    ct.set_expected_dynamic_shape_range(
        kwargs_dynamic_shape={
            "hidden_states": {2: Dim("h", min=32, max=96), 3: Dim("w", min=32, max=96)},
            "encoder_hidden_states": {0: Dim("b", min=1, max=2), 1: Dim("t", min=1, max=16)},
        }
    )
    for h, w in ((32, 96), (48, 40)):  # the resolution embedding differs per size, on one range set
        kw = prx_inputs(model, batch=1, h=h, w=w, text=9, masked=2, seed=h)
        torch.testing.assert_close(ct(**kw, return_dict=False)[0], eager(model, kw), rtol=0, atol=1e-5)
    assert ct.builds == 2


def test_the_pixel_presets_plan_pixel_sets_and_the_pixel_bins():
    from diffusers.pipelines.prx.pipeline_prx_pixel import ASPECT_RATIO_BINS

    model = make_prx(TINY_PIXEL_PRX)
    plan = plan_of("prx-pixel-1024-bf16", model)
    sets = plan.shape_sets()
    assert [s.opt_point() for s in sets[:2]] == [(2, 1024, 1024, 256), (1, 1024, 1024, 256)]
    r = sets[2]
    for h, w in ASPECT_RATIO_BINS[1024].values():
        assert r.fits(2, h, w, 256)
    assert plan_of("prx-pixel-1024-fp8", model).config.precision == "fp8"
    assert CompileConfig.resolve("prx-pixel-1024-bf16").vae_scale_factor == 1


def test_the_pixel_pipeline_runs_the_compiled_transformer_and_makes_eagers_image():
    pipe = tiny_pixel_pipeline()
    args = dict(prompt="a red car", height=64, width=64, num_inference_steps=2, use_resolution_binning=False)
    ref = pipe(**args, output_type="pt", generator=torch.Generator().manual_seed(0)).images
    pipe.transformer = compile_prx(pipe.transformer, backend="eager", device="cpu", **SMALL)
    out = pipe(**args, output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert torch.equal(out, ref) and ref.std() > 0.01
    assert pipe.transformer.builds == 1
