"""CompileConfig: presets, YAML, overrides, engine sets, and errors naming the key and the allowed values."""

import pytest
import torch

from prx_compile import CompileConfig, ConfigError
from prx_compile.config import ENGINE_KEYS, list_presets

from .conftest import plan_of


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
    from prx_compile.tools.testing import TINY_PIXEL_PRX, make_flux, make_prx

    models = {"prx": make_prx(), "prx-pixel": make_prx(TINY_PIXEL_PRX), "flux": make_flux()}
    for n in names:
        cfg = CompileConfig.resolve(n)
        assert cfg.dtype == "bf16" and cfg.weights == "inputs" and cfg.attention == "fused"
        assert cfg.model in ("prx", "flux")  # every preset names its model
        family = "prx-pixel" if n.startswith("prx-pixel") else cfg.model
        assert plan_of(cfg, models[family]).shape_sets()


def test_default_is_the_1024_preset_without_a_dtype():
    preset = CompileConfig.resolve("prx-1024-bf16")
    assert plan_of(CompileConfig().replace(dtype="bf16")).shape_sets() == plan_of(preset).shape_sets()


@pytest.mark.parametrize(
    "preset,families", [("prx-1024-bf16", (1024,)), ("prx-512-bf16", (512,)), ("prx-bins-bf16", (512, 1024))]
)
def test_range_covers_every_aspect_bin(preset, families):
    from diffusers.pipelines.prx.pipeline_prx import ASPECT_RATIO_BINS

    r = plan_of(preset).range_shapes()
    for family in families:
        for h, w in ASPECT_RATIO_BINS[family].values():
            assert r.fits(2, h // 8, w // 8, 77) and r.fits(1, h // 8, w // 8, 256)
    assert r.batch == (1, 2)


def test_engine_sets_specialised_first_then_the_range():
    sets = plan_of().shape_sets()
    assert [s.is_static() for s in sets] == [True, True, False]
    assert sets[0].opt_point() == (2, 128, 128, 256) and sets[1].opt_point() == (1, 128, 128, 256)
    static = plan_of("prx-1024-bf16-static").shape_sets()
    assert len(static) == 1 and static[0].opt_point() == (2, 128, 128, 256)
    bins = plan_of("prx-bins-bf16").shape_sets()
    assert [s.opt_point()[:3] for s in bins[:2]] == [(2, 128, 128), (2, 64, 64)]
    custom = plan_of(CompileConfig(specialize=[[832, 1216, 2], [832, 1216, 2]], static=True)).shape_sets()
    assert len(custom) == 1 and custom[0].height == (104, 104) and custom[0].width == (152, 152)


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"backend": "onnx"}, r"backend='onnx' is not allowed.*tensorrt"),
        ({"attention": "fast"}, r"attention='fast'.*fused.*flash.*tensorrt"),
        ({"weights": "baked"}, r"weights='baked'.*inputs.*engine"),
        ({"batch": [2, 1]}, r"batch=\[2, 1\] must be \[min, max\]"),
        ({"batch": [True, 2]}, r"batch=\[True, 2\] must be \[min, max\] integers"),
        ({"text_len": [1, "256"]}, r"text_len="),
        ({"aspect_bins": ["1024"]}, r"aspect_bins=\['1024'\] must be a list of bin families"),
        ({"dtype": "int8"}, r"dtype='int8'.*bf16"),
        ({"optimization_level": 9}, r"optimization_level=9"),
        ({"optimization_level": True}, r"optimization_level=True"),
        (
            {"resolution": 1004, "vae_scale_factor": 8},
            r"resolution=1004 is not a multiple of vae_scale_factor=8",
        ),
        ({"resolution": True}, r"resolution=True must be a positive integer"),
        ({"cuda_graphs": "yes"}, r"cuda_graphs='yes' must be true or false"),
        ({"device": "banana"}, r"device='banana' is not a device.*'cuda'"),
        ({"device": "mps"}, r"device='mps' is not a device"),
        ({"device": 3}, r"device=3 is not a device"),
        ({"specialize": [[1024, 1024]]}, r"specialize entry \[1024, 1024\] must be \[height, width, batch\]"),
        ({"specialize": [[1004, 1024, 2]], "vae_scale_factor": 8}, r"multiples of vae_scale_factor=8"),
        ({"specialize": "1024"}, r"specialize='1024' must be a list"),
        ({"static": True, "specialize": []}, r"leaves no engines"),
        ({"on_shape_miss": "rebuild"}, r"on_shape_miss='rebuild'.*build.*error"),
        ({"engine_cache_dir": 5}, r"engine_cache_dir=5 must be a directory path"),
        ({"opt_batch": 3, "batch": [1, 2]}, r"opt_batch=3 must be an integer in \[1, 2\]"),
        ({"range_linears": "cublas"}, r"range_linears='cublas'.*torch.*tensorrt"),
        ({"build_workers": 0}, r"build_workers=0 must be an integer from 1 to 64"),
        ({"build_workers": True}, r"build_workers=True must be an integer"),
        ({"share_context_memory": "yes"}, r"share_context_memory='yes' must be true or false"),
        ({"attention_kernel": "flash3"}, r"attention_kernel='flash3'.*auto.*cudnn.*split"),
        ({"attention_kernel": True}, r"attention_kernel=True is not allowed"),
    ],
)
def test_bad_values_name_key_and_allowed(bad, match):
    with pytest.raises(ConfigError, match=match):
        CompileConfig.resolve(None, **bad)


def test_device_strings_are_parsed():
    assert CompileConfig(device="cuda:1").device == "cuda:1"
    assert CompileConfig(device=torch.device("cpu")).device == "cpu"


def test_unknown_keys_are_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("backend: eager\nbatchsize: 4\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['batchsize'\].*valid keys"):
        CompileConfig.resolve(p)


@pytest.mark.parametrize("text", ["[1, 2", "- a\n- b\n", "a: [" * 2000, "\x00\x01"])
def test_broken_yaml_is_a_config_error(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError):
        CompileConfig.resolve(p)


@pytest.mark.parametrize("name", ["prx-2048", "../configs/prx-1024-bf16", "a/b", "..", "", "~"])
def test_preset_names_are_names(name):
    with pytest.raises(ConfigError, match="prx-1024-bf16"):  # the message lists the presets
        CompileConfig.resolve(name)


def test_a_file_that_is_not_a_config_is_a_config_error(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConfigError, match="expected a mapping"):
        CompileConfig.resolve(tmp_path / "notes.txt")


def test_yaml_roundtrip_and_engine_keys(tmp_path):
    import yaml

    cfg = CompileConfig.resolve("prx-512-bf16", backend="eager")
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg.to_dict()))
    assert CompileConfig.resolve(p) == cfg
    assert set(ENGINE_KEYS) <= set(cfg.to_dict())
    for runtime in ({"cuda_graphs": False}, {"build_workers": 1}, {"share_context_memory": False}):
        assert cfg.engine_settings() == CompileConfig.resolve(p, **runtime).engine_settings()
    assert cfg.engine_settings() != CompileConfig.resolve(p, weights="engine").engine_settings()
    assert (
        plan_of(cfg).lowering().attention == "flash"
        and plan_of(CompileConfig(attention="tensorrt")).lowering().attention == "tensorrt"
    )


def test_range_and_static_linears_each_key_the_engine_cache_of_their_sets_only(monkeypatch):
    from types import SimpleNamespace

    from prx_compile.io import artifact, cache
    from prx_compile.shapes import ShapeRange
    from prx_compile.tools.testing import make_prx

    monkeypatch.setattr(artifact, "versions", lambda with_tensorrt: {})  # no Torch-TensorRT here
    model = make_prx()
    rng, static = ShapeRange((1, 2), (8, 16), (8, 16), (1, 12)), ShapeRange.static(2, 16, 16, 12)

    def key(shapes, **overrides):
        plan = plan_of(CompileConfig(**overrides), model)
        backend = SimpleNamespace(config=plan.config, plan=plan, shapes=shapes, model=model)
        return cache.cache_key(backend, {})

    assert key(rng) != key(rng, range_linears="tensorrt")
    assert key(static) == key(static, range_linears="tensorrt")  # range_linears: range sets only
    assert key(static) != key(static, static_linears="tensorrt")
    assert key(rng) == key(rng, static_linears="tensorrt")  # static_linears: static sets only
    assert key(rng, weights="engine") == key(rng, weights="engine", range_linears="tensorrt")


def test_a_key_typo_gets_a_suggestion_and_an_empty_yaml_is_refused(tmp_path):
    with pytest.raises(
        ConfigError, match=r"unknown key\(s\) \['resolutoin'\]\. 'resolutoin': did you mean 'resolution'\?"
    ):
        CompileConfig.from_dict({"resolutoin": 512})
    with pytest.raises(ConfigError) as e:
        CompileConfig.from_dict({"zzzz": 1})
    assert "did you mean" not in str(e.value) and "valid keys" in str(e.value)
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="empty.yaml is empty: it sets no key"):
        CompileConfig.resolve(str(empty))


# -- untrusted YAML and bounded messages (issue 26) -----------------------------------------------
LAUGHS = (
    "".join(
        f"{k}: &{k} [{', '.join([f'*{p}'] * 9 if p else ['lol'] * 9)}]\n"
        for p, k in zip([None, "a", "b", "c", "d", "e", "f", "g"], "abcdefgh", strict=True)
    )
    + "batch: [*h, *h]\n"
)


def test_billion_laughs_fails_fast_naming_the_file(tmp_path):
    import time

    p = tmp_path / "laughs.yaml"
    p.write_text(LAUGHS)
    assert len(LAUGHS) < 500
    t = time.perf_counter()
    with pytest.raises(ConfigError, match=r"laughs\.yaml.*anchors and aliases") as e:
        CompileConfig.resolve(p)
    assert time.perf_counter() - t < 1.0
    assert len(str(e.value)) < 400 and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "text,match",
    [
        ("a: &x 1\nbackend: eager\n", "anchors and aliases"),  # an anchor alone is refused too
        ("batch: [" + "1" * 5000 + ", 2]\n", "integer of 5000 characters is too long"),
        ("batch: [1" + ":59" * 20_000 + ", 2]\n", "integer of 60001 characters"),  # base 60: quadratic
        ("resolution: 1" + ":1" * 200 + ".5\n", "a number of 403 characters is too long"),  # float overflow
        ("backend: eager\nbackend: tensorrt\n", "the key 'backend' is given twice"),
        ("<<: {backend: eager, backend: tensorrt}\n", "the key 'backend' is given twice"),  # in a merge
        ("<<: {backend: eager}\n<<: {batch: [1, 2]}\n", "the key '<<' is given twice"),
        ('engine_cache_dir: "a\\0b"\n', "engine_cache_dir='a.x00b' must be a directory path"),
        ("backend: eager\nbatch: [2, 1]\n", r"c\.yaml: batch=\[2, 1\] must be"),  # value errors too
        ("x" * 20 + ": 1\n" + "".join(f"k{i}: 1\n" for i in range(5000)), r"and 4991 more\."),
        ("x: 1\n" * 20_000, "more than 65536"),  # PyYAML parses about 15 s a MiB
        # PyYAML's constructors raise these themselves (0.31 let them through raw)
        ("resolution: 2001-13-45\n", "not valid YAML: ValueError: month must be in 1..12"),
        ("resolution: !!int abc\n", "not valid YAML: ValueError"),
        ("static: !!bool abc\n", "not valid YAML: KeyError"),
        ("resolution: !!int ''\n", "not valid YAML: IndexError"),
        ("specialize: !!map [1]\n", "a sequence tagged as a mapping"),
    ],
)
def test_yaml_values_are_bounded_and_errors_name_the_file(tmp_path, text, match):
    import time

    p = tmp_path / "c.yaml"
    p.write_text(text)
    t = time.perf_counter()
    with pytest.raises(ConfigError, match=match) as e:
        CompileConfig.resolve(p)
    assert time.perf_counter() - t < 2.0
    assert str(p) in str(e.value) and len(str(e.value)) < 1000


def test_merge_keys_written_out_still_work(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("<<: {backend: eager}\nbatch: [1, 3]\n")
    cfg = CompileConfig.resolve(p)
    assert (cfg.backend, cfg.batch) == ("eager", [1, 3])


def test_a_file_over_64_kib_is_refused_unread(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("backend: eager\n" + "#" * (1 << 16))
    with pytest.raises(ConfigError, match=r"c\.yaml is 65551 bytes, more than 65536"):
        CompileConfig.resolve(p)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    import os

    p = tmp_path / "c.yaml"
    os.mkfifo(p)
    with pytest.raises(ConfigError, match=r"c\.yaml is not a regular file"):
        CompileConfig.resolve(p)


@pytest.mark.parametrize(
    "bad,shown",
    [
        ({"batch": [1] * 10_000_000}, "batch=[1, 1, 1, 1, 1, 1, 1, 1, ...] must be"),
        ({"device": "x" * 10_000_000}, "device='xxxxx"),
        ({"resolution": 10**5000}, "resolution=<16610-bit int> must be"),
        ({"specialize": [[10**400, 8, 1]]}, "specialize entry [<1329-bit int>, 8, 1]"),
        ({"specialize": [[8, 8, 1]] * 10_000}, "specialize has 10000 entries, more than 256"),
        ({"x" * 10_000_000: 1}, "unknown key(s) ['xxxxx"),
    ],
)
def test_messages_show_a_bounded_excerpt_of_the_value(bad, shown):
    with pytest.raises(ConfigError) as e:
        CompileConfig.from_dict(bad)
    msg = str(e.value)
    assert shown in msg and len(msg) < 800, msg[
        :800
    ]  # an unknown key's hint lists the ~600 characters of valid keys


def test_excerpt_is_bounded_in_length_and_time():
    import time

    from prx_compile.errors import excerpt

    laughs = ["lol"] * 9
    for _ in range(8):
        laughs = [laughs] * 9  # 9**9 leaves, shared
    t = time.perf_counter()
    out = [excerpt(v) for v in (laughs, 10**5000, "a" * 10**8, {"a": [1] * 100})]
    assert time.perf_counter() - t < 0.5
    assert all(len(s) <= 80 for s in out)
    assert out[1] == "<16610-bit int>" and out[3] == "{'a': [1, 1, 1, 1, 1, 1, 1, 1, ...]}"
    assert excerpt("fast") == "'fast'" and excerpt([2, 1]) == "[2, 1]"


def test_the_model_defaults_fill_what_the_config_leaves_unset_and_bins_are_the_models():
    from prx_compile.tools.testing import TINY_PIXEL_PRX, make_flux, make_prx

    prx = plan_of().config
    assert (prx.batch, prx.text_len, prx.resolution, prx.vae_scale_factor, prx.aspect_bins) == (
        [1, 2],
        [1, 256],
        1024,
        8,
        [1024],
    )
    assert plan_of(batch=[1, 4]).config.batch == [1, 4]  # what the config sets stays
    pixel = plan_of(model=make_prx(TINY_PIXEL_PRX)).config
    assert pixel.vae_scale_factor == 1 and pixel.model == "prx"
    flux = plan_of(model=make_flux()).config
    assert (flux.batch, flux.text_len, flux.aspect_bins, flux.model) == ([1, 1], [512, 512], [], "flux")
    with pytest.raises(ConfigError, match=r"aspect_bins: 768 is not a PRX bin family.*\[256, 512, 1024\]"):
        plan_of(aspect_bins=[768])
    with pytest.raises(
        ConfigError, match=r"config is for model 'flux' and the transformer is a PRXTransformer2DModel"
    ):
        plan_of(CompileConfig(model="flux"))


def test_a_directory_as_config_is_one_line(tmp_path):
    """0.16 opened the path before checking it was a regular file: a raw IsADirectoryError."""
    for config in (tmp_path, str(tmp_path), tmp_path / "sub.yaml"):
        (tmp_path / "sub.yaml").mkdir(exist_ok=True)
        with pytest.raises(ConfigError, match=r"is a directory, not a YAML file.*prx-1024-bf16"):
            CompileConfig.resolve(config)
