"""CompileConfig: presets, YAML, overrides, and errors that name the key and the allowed values."""

import pytest

from prx_compile import CompileConfig, ConfigError
from prx_compile.config import list_presets


def test_presets_exist_and_load():
    names = list_presets()
    for required in (
        "prx-1024-bf16",
        "prx-512-bf16",
        "prx-bins-bf16",
        "prx-1024-bf16-static",
        "prx-1024-bf16-distilled",
    ):
        assert required in names
    for n in names:
        cfg = CompileConfig.resolve(n)
        assert cfg.dtype == "bf16"
        cfg.shape_range()


@pytest.mark.parametrize(
    "preset,families", [("prx-1024-bf16", (1024,)), ("prx-512-bf16", (512,)), ("prx-bins-bf16", (512, 1024))]
)
def test_presets_cover_every_aspect_bin(preset, families):
    from diffusers.pipelines.prx.pipeline_prx import ASPECT_RATIO_BINS

    r = CompileConfig.resolve(preset).shape_range()
    for family in families:
        for h, w in ASPECT_RATIO_BINS[family].values():
            assert r.height[0] <= h // 8 <= r.height[1] and r.width[0] <= w // 8 <= r.width[1]
            assert not r.problems(
                __import__("torch").zeros(2, 16, h // 8, w // 8), __import__("torch").zeros(2, 77, 1)
            )
    assert r.batch == (1, 2)


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"backend": "onnx"}, r"backend='onnx' is not allowed.*tensorrt"),
        ({"attention": "fast"}, r"attention='fast'.*flash"),
        ({"batch": [2, 1]}, r"batch=\[2, 1\] must be \[min, max\]"),
        ({"aspect_bins": [768]}, r"aspect_bins=\[768\].*\[256, 512, 1024\]"),
        ({"dtype": "int8"}, r"dtype='int8'.*bf16"),
        ({"optimization_level": 9}, r"optimization_level=9"),
        ({"resolution": 1004}, r"resolution=1004 is not a multiple of vae_scale_factor=8"),
        ({"cuda_graphs": "yes"}, r"cuda_graphs='yes' must be true or false"),
        ({"fused_attention": 1}, r"fused_attention=1 must be true or false"),
    ],
)
def test_bad_values_name_key_and_allowed(bad, match):
    with pytest.raises(ConfigError, match=match):
        CompileConfig.resolve(None, **bad)


def test_unknown_keys_are_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("backend: eager\nbatchsize: 4\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['batchsize'\].*valid keys"):
        CompileConfig.resolve(p)


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(ConfigError, match="prx-1024-bf16"):
        CompileConfig.resolve("prx-2048")


def test_yaml_roundtrip_and_overrides(tmp_path):
    import yaml

    cfg = CompileConfig.resolve("prx-512-bf16", backend="eager")
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg.to_dict()))
    assert CompileConfig.resolve(p) == cfg
    assert cfg.rebuild_keys_changed(CompileConfig.resolve(p, cuda_graphs=False)) == []
    assert cfg.rebuild_keys_changed(CompileConfig.resolve(p, attention="tensorrt")) == ["attention"]
    assert cfg.rebuild_keys_changed(CompileConfig.resolve(p, fused_attention=False)) == ["fused_attention"]
    assert cfg.fuses_attention() and not CompileConfig.resolve(p, attention="tensorrt").fuses_attention()
