"""The prx-compile command as a newcomer runs it on a CPU machine: ``main(argv)`` in this process
(``tests/_cli.py``), what it prints and the files it writes. In processes of their own: the console
script and ``python -m prx_compile`` here, generate's workers in ``tests/test_generate.py``."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from prx_compile import ConfigError, PRXCompileError

from ._cli import run_cli as run


def one_line_error(r, message, code=2):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code, (r.returncode, r.stderr)
    assert lines and lines[-1].startswith("prx-compile: error:") and message in lines[-1], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("sub", [[], ["demo"], ["build"], ["generate"], ["bench"], ["inspect"]])
def test_help_with_defaults(sub):
    r = run(*sub, "--help")
    assert r.returncode == 0 and "usage: prx-compile" in r.stdout
    text = " ".join(r.stdout.split())
    assert "(default: None)" not in text
    if sub == ["generate"]:
        assert "denoising steps (default: 28)" in text and "(default: prx-images)" in text
    if sub == ["bench"]:
        assert "(default: 10)" in text and "default: tensorrt on a GPU, eager otherwise" in text


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("prx-compile 0.")


def test_module_entry_point_runs_the_command():
    """``python -m prx_compile`` (prx_compile/__main__.py, the one library file that imports tools/) is
    the command, in a process of its own."""
    r = subprocess.run(
        [sys.executable, "-m", "prx_compile", "--version"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.startswith("prx-compile 0."), r.stderr


def test_console_script_runs_the_command():
    """``prx-compile`` (pyproject's [project.scripts]: prx_compile.tools.cli:main), in a process of
    its own: the one on PATH, else the one next to this interpreter."""
    exe = shutil.which("prx-compile") or str(Path(sysconfig.get_path("scripts")) / "prx-compile")
    r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("prx-compile 0."), r.stderr


def test_demo_names_what_runs_and_matches_eager():
    r = run("demo")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for expected in (
        "backend eager",
        "aten.im2col.default                             1 ->   0",
        "aten.col2im.default                             1 ->   0",
        "aten.scaled_dot_product_attention.default       2 ->   0",
        "prx_compile.prx_attention.default               0 ->   2",
        "all 16 hidden          max abs 0.00e+00",
        "warm step time on cpu (median of 20 after 3 warm-up calls)",
    ):
        assert expected in out, out
    assert "joint_attention" not in out  # the fused default runs prx_attention
    # progress went to stderr, one line per finished stage, none repeated
    lines = [line for line in r.stderr.splitlines() if line.startswith("prx-compile: ")]
    stages = [line for line in lines if not line.startswith("prx-compile: kernels for ")]
    assert stages and len(stages) == len(set(stages)) and all("done in" in s for s in stages), r.stderr
    assert len(lines) == len(stages) + 1, r.stderr  # one line: the kernels the set chose, and why
    r = run("demo", "--quiet", "--attention", "tensorrt", "--patchify", "reshape")
    assert r.returncode == 0 and "scaled_dot_product_attention.default       2 ->   0" in r.stdout
    assert not r.stderr.strip()


def test_generate_tiny_to_png(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n\na red car on the moon\n")
    r = run(
        "generate",
        "--prompt",
        "an astronaut riding a horse",
        "--prompts-file",
        str(prompts),
        "--steps",
        "2",
        "--out-dir",
        str(tmp_path / "out"),
    )
    assert r.returncode == 0, r.stderr
    pngs = sorted((tmp_path / "out").glob("*.png"))
    assert [p.name for p in pngs] == [
        "000-an-astronaut-riding-a-horse.png",
        "001-a-cat.png",
        "002-a-red-car-on-the-moon.png",
    ]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    leftovers = sorted(p.name for p in (tmp_path / "out").iterdir() if p.suffix != ".png")
    assert leftovers == [".prx-generate", "summary.json"]  # no temporary files or run records left
    assert [p.name for p in (tmp_path / "out" / ".prx-generate").iterdir()] == ["made.json"]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["images"], summary["processes"], summary["missing"]) == (3, 1, [])
    assert "3/3 images in" in r.stdout


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory):
    """``prx-compile build --tiny`` once for the tests that read the artifact: (path, what build said).
    A test that changes the artifact changes a copy."""
    art = tmp_path_factory.mktemp("cli") / "t.art"
    r = run("build", "--tiny", "--out", art)  # a CPU: the eager backend, as --help says
    assert r.returncode == 0, r.stderr
    return art, r


def test_build_inspect_then_generate_with_defaults(tiny_artifact, tmp_path):
    art, r = tiny_artifact
    assert "backend eager" in r.stdout and "engine set: batch 2, latent 32x32" in r.stdout
    r = run("inspect", art)
    assert r.returncode == 0, r.stderr
    assert "backend      eager" in r.stdout and "sizes and sha256 verified" in r.stdout
    r = run("inspect", "--json", art)
    assert json.loads(r.stdout)["format_version"] == 3
    r = run(
        "generate",
        "--artifact",
        str(art),
        "--prompt",
        "a cat",
        "--steps",
        "2",
        "--out-dir",
        str(tmp_path / "o"),
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "o" / "000-a-cat.png").is_file()
    broken = shutil.copytree(art, tmp_path / "broken.art")
    (broken / "weights.safetensors").unlink()
    one_line_error(run("inspect", str(broken)), "weights.safetensors is missing")


def test_tiny_builds_a_bf16_preset_and_generates_from_it(tmp_path):
    art = tmp_path / "p.art"
    r = run("build", "--tiny", "--config", "prx-512-bf16", "--out", str(art))
    assert r.returncode == 0, r.stderr
    assert "engine set: batch 2, latent 64x64, text 256 tokens" in r.stdout
    r = run("inspect", str(art))
    assert "PRXTransformer2DModel, bf16" in r.stdout
    r = run(
        "generate",
        "--artifact",
        str(art),
        "--prompt",
        "a dog",
        "--steps",
        "1",
        "--out-dir",
        str(tmp_path / "o"),
    )
    assert r.returncode == 0, r.stderr
    from PIL import Image

    # the preset's size: the tiny pipeline takes the artifact's 8x VAE (0.27: 64x64, a 1x VAE)
    assert Image.open(tmp_path / "o" / "000-a-dog.png").size == (512, 512)


@pytest.mark.parametrize("model, preset", [("prx", "prx-1024-bf16"), ("flux", "flux-1024-bf16")])
def test_the_tiny_model_under_a_preset_makes_the_presets_image_size(tmp_path, model, preset):
    """``--tiny --config PRESET``: the tiny pipeline takes the preset's 8x VAE and text length, so
    the images have the preset's size (0.27: 1/8 of it for PRX, and FLUX failed: 262144 image tokens)."""
    r = run(
        "generate",
        "--tiny",
        "--model",
        model,
        "--config",
        preset,
        "--prompt",
        "a dog",
        "--steps",
        "1",
        "--out-dir",
        str(tmp_path / "o"),
    )
    assert r.returncode == 0, r.stderr
    from PIL import Image

    assert Image.open(tmp_path / "o" / "000-a-dog.png").size == (1024, 1024)


def test_generate_from_a_saved_pipeline_folder(tmp_path):
    """A PRXPipeline written by save_pretrained loads back (diffusers' own from_pretrained cannot,
    with transformers 5: see README, Limits), compiles and generates."""
    from prx_compile.tools.testing import tiny_pipeline

    tiny_pipeline().save_pretrained(tmp_path / "prx")
    args = ["generate", "--checkpoint", str(tmp_path / "prx"), "--prompt", "a cat", "--steps", "1"]
    args += ["--out-dir", str(tmp_path / "o"), "--config", str(tmp_path / "c.yaml"), "--no-binning"]
    r = run(*args, "--height", "32", "--width", "32")
    one_line_error(r, "c.yaml does not exist")
    (tmp_path / "c.yaml").write_text(
        "resolution: 32\naspect_bins: []\nvae_scale_factor: 1\ntext_len: [1, 16]\nspecialize: [[32, 32, 2]]\n"
    )
    r = run(*args)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "o" / "000-a-cat.png").is_file()
    assert "resolution binning" not in r.stderr  # --no-binning: 32x32 as asked, no 512² engine set


def test_binning_that_changes_the_size_says_so(capsys):
    """Binning maps the tiny saved pipeline's 32x32 to a 512-px bin: one line names the size used
    (the build itself is left out here: the eager step at 512² on a 1x VAE takes minutes)."""
    from prx_compile.models import SPECS
    from prx_compile.tools.cli import _warm_up
    from prx_compile.tools.testing import tiny_pipeline

    pipe = tiny_pipeline()
    built = []

    class Transformer:  # records the shapes the engine set is built for
        config, dtype, device = pipe.transformer.config, pipe.transformer.dtype, pipe.transformer.device
        spec, transformer = SPECS["prx"], pipe.transformer

        def build(self, kw):
            built.append(tuple(kw["hidden_states"].shape))

    pipe.transformer = Transformer()
    _warm_up(pipe, 32, 32, 4.0, binning=True)
    err = capsys.readouterr().err
    assert "makes 32x32 images at 512x512" in err and "--no-binning keeps 32x32" in err
    assert built == [(2, pipe.transformer.config.in_channels, 512, 512)]
    _warm_up(pipe, 32, 32, 4.0, binning=False)
    assert capsys.readouterr().err == "" and built[-1][2:] == (32, 32)


def test_output_paths_are_checked_before_any_work(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    base = ["generate", "--tiny", "--prompt", "a cat", "--steps", "1"]
    one_line_error(run(*base, "--out-dir", str(afile)), "exists and is not a directory")
    r = run(*base, "--out-dir", str(tmp_path / "o"), "--summary", str(afile / "s.json"))
    one_line_error(r, "is not a directory")
    assert not (tmp_path / "o").exists()  # refused before a single image
    one_line_error(run(*base, "--out-dir", str(tmp_path / "o"), "--summary", str(tmp_path)), "is a directory")
    one_line_error(run("inspect", str(afile)), "is not a prx_compile artifact: a file, not a directory")


@pytest.mark.parametrize(
    "args,message",
    [
        (["generate", "--checkpoint", "/no/such/prx", "--prompt", "x"], "model_index.json is missing"),
        (
            ["generate", "--prompts-file", "/no/such/file.txt"],
            "prompts file /no/such/file.txt does not exist",
        ),
        (["generate", "--prompts-file", "/dev/zero"], "prompts file /dev/zero is not a regular file"),
        (["generate", "--prompts-file", "/tmp"], "prompts file /tmp is not a regular file"),
        (["generate", "--steps", "1"], "no prompt given"),
        (["generate", "--prompt", "x", "--num-processes", "100000"], "CPU cores and no GPU"),
        (["generate", "--prompt", "x", "--seed", "-5"], "seed=-5: image i uses seed + i"),
        (["inspect", "/no/such/artifact"], "no such directory"),
        (["build", "--tiny", "--config", "prx-9000", "--out", "/tmp/x"], "no preset named 'prx-9000'"),
        (
            ["build", "--tiny", "--config", "../etc/passwd", "--out", "/tmp/x"],
            "neither a YAML file nor a preset",
        ),
        (["build", "--tiny", "--backend", "tensorrt", "--out", "/tmp/x"], "needs a CUDA GPU"),
        (["bench", "--size", "full"], "needs a CUDA GPU"),
    ],
)
def test_errors_are_one_line_with_a_hint(args, message):
    one_line_error(run(*args), message)


def test_build_refuses_a_directory_that_is_not_an_artifact_before_building(tmp_path):
    (tmp_path / "notes.txt").write_text("keep")
    r = run("build", "--tiny", "--out", str(tmp_path))
    one_line_error(r, "is not a prx_compile artifact")
    assert "engine set" not in r.stderr  # refused before any build
    assert (tmp_path / "notes.txt").read_text() == "keep"


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "--iters", "0"],
        ["generate", "--steps", "-1", "--prompt", "x"],
        ["demo", "--attention", "fast"],
        ["generate", "--guidance", "inf", "--prompt", "x"],
        ["generate", "--guidance", "nan", "--prompt", "x"],
        ["generate", "--guidance", "-1", "--prompt", "x"],
    ],
)
def test_bad_arguments_exit_2_without_a_traceback(args):
    r = run(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "error: argument" in r.stderr


def test_debug_shows_the_traceback():
    """--debug lets the error out of main(), so the interpreter prints its traceback (without --debug:
    one line, exit 2, as test_errors_are_one_line_with_a_hint checks for the same command)."""
    with pytest.raises(PRXCompileError, match="no such directory"):
        run("--debug", "inspect", "/no/such/artifact")


def test_bench_tiny_measures_every_path(tmp_path):
    r = run(
        "bench",
        "--quiet",
        "--iters",
        "2",
        "--paths",
        "eager",
        "compile_prx",
        "--out",
        str(tmp_path / "b.json"),
        "--png",
        str(tmp_path / "b.png"),
    )
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "b.json").read_text())
    assert [rec["path"] for rec in res["records"]] == ["eager", "compile_prx"]
    for rec in res["records"]:
        assert "error" not in rec["extra"] and rec["ms_per_step"] > 0 and rec["rel_err"] < 1e-5, rec
    assert res["records"][1]["extra"]["kept_in_pytorch"] == {"prx_compile.prx_attention.default": 2}
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_reports_a_failing_path_and_exits_1():
    r = run("bench", "--quiet", "--iters", "1", "--paths", "eager", "plain_mttm")
    assert r.returncode == 1 and "plain_mttm on 32x32 b2:" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [["bench", "--iters"], ["generate", "--prompt", "x", "--seed"]])
def test_a_huge_argument_is_echoed_as_a_bounded_excerpt(args):
    r = run(*args, "9" * 100_000)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr) < 3000, len(r.stderr)
    assert "'99999999" in r.stderr and "...999" in r.stderr


def test_build_prints_a_digest_that_inspect_shows_and_generate_checks(tiny_artifact, tmp_path):
    art, r = tiny_artifact
    digest = next(w for w in r.stdout.split() if w.startswith("sha256:"))
    assert len(digest) == 71
    r = run("inspect", str(art))
    assert r.returncode == 0 and f"digest       {digest}" in r.stdout
    base = ["generate", "--prompt", "a cat", "--steps", "1", "--out-dir", str(tmp_path / "o")]
    other = "sha256:" + "0" * 64
    one_line_error(
        run(*base, "--artifact", str(art), "--digest", other), "is not the artifact that was published"
    )
    one_line_error(run(*base, "--tiny", "--digest", digest), "--digest pins an artifact")
    r = run(*base, "--artifact", str(art), "--digest", digest)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "o" / "000-a-cat.png").is_file()


def test_bench_plot_reads_only_a_results_file(tmp_path):
    """A FIFO is refused unread (0.26 waited on it), a file without records or with odd ones is one
    line, exit 2."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "other.json").write_text('{"x": 1}')
    (tmp_path / "odd.json").write_text('{"records": [{"ms_per_step": 1}]}')
    for name, message in (
        ("fifo", "is not a results file"),
        ("other.json", "no list of records"),
        ("odd.json", "is not a bench results file (KeyError"),
    ):
        r = run("bench", "--plot", str(tmp_path / name))
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_generate_never_overwrites_a_file_that_is_not_its_summary(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("my notes")
    r = run("generate", "--tiny", "--prompt", "a cat", "--steps", "1", "--out-dir", str(out))
    assert r.returncode == 2 and "exists and is not a generate summary" in r.stderr, r.stderr
    assert (out / "summary.json").read_text() == "my notes" and not list(out.glob("*.png"))
    r = run(
        "generate", "--tiny", "--prompt", "a cat", "--summary", "/proc/self/x.json", "--out-dir", str(out)
    )
    assert r.returncode == 2 and "cannot be written in /proc/self" in r.stderr, r.stderr  # before any image
    assert not list(out.glob("*.png"))


def test_generate_from_a_flux_artifact_pads_the_text_to_its_sets(tmp_path):
    """FLUX pads every prompt to max_sequence_length: with --artifact it is the artifact's sets' text
    length (0.27 and 0.28's first version took the tiny config's 8 tokens: a set built during
    generation, prompts cut to 8 tokens)."""
    art = tmp_path / "f.art"
    r = run(
        "build",
        "--tiny",
        "--model",
        "flux",
        "--config",
        "flux-1024-bf16",
        "--backend",
        "eager",
        "--out",
        str(art),
    )
    assert r.returncode == 0, r.stderr
    r = run(
        "generate",
        "--artifact",
        str(art),
        "--model",
        "flux",
        "--prompt",
        "a dog",
        "--steps",
        "1",
        "--out-dir",
        str(tmp_path / "o"),
    )
    assert r.returncode == 0, r.stderr
    assert "outside every engine set" not in r.stderr, r.stderr
    made = json.loads((tmp_path / "o" / ".prx-generate" / "made.json").read_text())
    assert made["settings"]["pipeline_kwargs"] == {"max_sequence_length": 512}, made["settings"]


def test_lora_files_on_the_command_line(tmp_path):
    """``--lora FILE[:SCALE]`` on generate and build: the LoRA's images differ from the base model's, an
    artifact built with it makes the same PNG as generate with it, and a resume with another LoRA
    scale is refused (what made the images is recorded)."""
    from safetensors.torch import save_file

    from prx_compile.lora import make_random_lora
    from prx_compile.tools.testing import make_prx

    lora = tmp_path / "style.safetensors"
    save_file(make_random_lora(make_prx(), rank=4, seed=1, std=0.3), str(lora))
    base = ["generate", "--tiny", "--prompt", "a cat", "--steps", "2"]
    assert run(*base, "--out-dir", str(tmp_path / "plain")).returncode == 0
    r = run(*base, "--lora", f"{lora}:0.5", "--out-dir", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    png = (tmp_path / "o" / "000-a-cat.png").read_bytes()
    assert png != (tmp_path / "plain" / "000-a-cat.png").read_bytes()
    one_line_error(run(*base, "--lora", f"{lora}:0.7", "--out-dir", str(tmp_path / "o")), "other settings")
    art = tmp_path / "a.art"
    assert run("build", "--tiny", "--lora", f"{lora}:0.5", "--out", str(art)).returncode == 0
    assert '"style": 0.5' in run("inspect", str(art)).stdout
    r = run(
        "generate",
        "--artifact",
        str(art),
        "--prompt",
        "a cat",
        "--steps",
        "2",
        "--out-dir",
        str(tmp_path / "b"),
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "b" / "000-a-cat.png").read_bytes() == png
    one_line_error(run(*base, "--lora", str(tmp_path / "none.safetensors")), "does not exist")
    r = run(*base, "--lora", f"{lora}:1e9")  # argparse's own error line
    assert r.returncode == 2 and "the LoRA scale must be a number from -100 to 100" in r.stderr


@pytest.mark.parametrize(
    "index,match",
    [
        ('{"_class_name": "PRXPipeline", "x": "' + "a" * (1 << 16) + '"}', "more than 65536 bytes"),
        (
            '{"_class_name": "PRXPipeline", "default_sample_size": 1e300}',
            "default_sample_size 1e[+]300 is not null or",
        ),
        ('{"_class_name": "PRXPipeline", "default_sample_size": true}', "size True is not null or"),
    ],
)
def test_a_hostile_model_index_is_one_line(tmp_path, index, match):
    """A checkpoint folder's model_index.json is read bounded, and the sample size it gives the
    pipeline is checked (0.31 read any size and passed any value on)."""
    from prx_compile.tools.pipeline import load_pipeline

    (tmp_path / "model_index.json").write_text(index)
    for name in ("transformer", "scheduler", "text_encoder", "tokenizer"):
        (tmp_path / name).mkdir()
    with pytest.raises(ConfigError, match=match):
        load_pipeline(tmp_path)
