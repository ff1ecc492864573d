"""The prx-compile command, through real subprocesses."""

import shutil
import subprocess
import sys

import pytest

CMD = (
    [shutil.which("prx-compile")]
    if shutil.which("prx-compile")
    else [sys.executable, "-m", "prx_compile.cli"]
)


def run(*args, timeout=300):
    return subprocess.run(CMD + list(args), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("sub", [[], ["demo"], ["build"], ["generate"], ["bench"], ["inspect"]])
def test_help(sub):
    r = run(*sub, "--help")
    assert r.returncode == 0 and "usage: prx-compile" in r.stdout


def test_demo_rewrites_and_matches_eager():
    r = run("demo", "--quiet")
    assert r.returncode == 0, r.stderr
    for expected in (
        "aten.im2col.default",
        "aten.col2im.default",
        "prx_compile.joint_attention.default",
        "all 12 hidden",
        "max abs 0.00e+00",
    ):
        assert expected in r.stdout
    r = run("demo", "--quiet", "--attention", "tensorrt", "--patchify", "reshape")
    assert r.returncode == 0 and "scaled_dot_product_attention.default       2 ->   0" in r.stdout


def test_generate_tiny_to_png(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n\na red car on the moon\n")
    r = run(
        "generate",
        "--quiet",
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


def test_build_inspect_and_generate_from_artifact(tmp_path):
    art = tmp_path / "art"
    r = run("build", "--quiet", "--tiny", "--backend", "eager", "--out", str(art))
    assert r.returncode == 0, r.stderr
    r = run("inspect", str(art))
    assert r.returncode == 0 and '"format_version": 1' in r.stdout and '"backend": "eager"' in r.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["generate", "--checkpoint", "/no/such/prx", "--prompt", "x"], "model_index.json is missing"),
        (
            ["generate", "--prompts-file", "/no/such/file.txt"],
            "prompts file /no/such/file.txt does not exist",
        ),
        (["generate", "--steps", "1"], "no prompt given"),
        (["inspect", "/no/such/artifact"], "manifest.json is missing"),
        (
            ["build", "--tiny", "--backend", "eager", "--config", "prx-9000", "--out", "/tmp/x"],
            "no preset named 'prx-9000'",
        ),
    ],
)
def test_errors_are_one_line_with_a_hint(args, message):
    r = run(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prx-compile: error:") and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_debug_shows_the_traceback():
    r = run("--debug", "inspect", "/no/such/artifact")
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_bad_arguments_exit_nonzero():
    r = run("demo", "--attention", "fast")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_bench_tiny_writes_json_and_chart(tmp_path):
    r = run(
        "bench",
        "--quiet",
        "--iters",
        "2",
        "--out",
        str(tmp_path / "b.json"),
        "--png",
        str(tmp_path / "b.png"),
    )
    assert r.returncode == 0, r.stderr
    import json

    res = json.loads((tmp_path / "b.json").read_text())
    assert {r["path"] for r in res["records"]} == {"eager", "compile_prx"}
    for rec in res["records"]:
        assert set(rec) >= {
            "path",
            "resolution",
            "batch",
            "mask",
            "dtype",
            "ms_per_step",
            "build_s",
            "peak_mem_gb",
            "rel_err",
            "engines",
            "torch_segments",
        }
    assert set(res["env"]) >= {"gpu", "torch", "torch_tensorrt", "diffusers"}
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
