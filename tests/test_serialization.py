"""Artifacts: manifest and hashes, atomic writes, corrupted/truncated/tampered files, version checks,
pickle-free loading, and an engine cache shared by real processes."""

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from prx_compile import ArtifactError, compile_prx
from prx_compile.serialization import (
    FORMAT_VERSION,
    MANIFEST,
    WEIGHTS,
    check_compatible,
    inspect_artifact,
    load_compiled,
    read_manifest,
    save_compiled,
    sha256_file,
)
from prx_compile.testing import make_prx

from .conftest import prx_inputs

RANGE = dict(batch=[1, 2], text_len=[1, 16], resolution=16, aspect_bins=[], vae_scale_factor=1)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def artifact(tmp_path):
    model = make_prx()
    ct = compile_prx(model, backend="eager", **RANGE)
    kw = prx_inputs(model, h=16, w=16)
    out = ct(**kw, return_dict=False)[0]
    return save_compiled(ct, tmp_path / "art"), kw, out, model


def test_roundtrip_manifest_and_hashes(artifact):
    path, kw, out, model = artifact
    m = read_manifest(path)
    assert m["format_version"] == FORMAT_VERSION and m["backend"] == "eager"
    assert m["model_config"]["hidden_size"] == 64 and m["config"]["resolution"] == 16
    assert m["lowering"]["rules"] == ["unfold", "fold", "attention", "select"]
    assert set(m["versions"]) >= {"torch", "diffusers", "prx_compile"}
    for rel, entry in m["files"].items():
        assert sha256_file(path / rel) == entry["sha256"] and (path / rel).stat().st_size == entry["bytes"]
    loaded = load_compiled(path)
    public = lambda c: {k: v for k, v in dict(c).items() if not k.startswith("_")}  # noqa: E731
    assert public(loaded.config) == public(model.config) and loaded.shapes.batch == (1, 2)
    assert torch.equal(loaded(**kw, return_dict=False)[0], out)
    assert "graph" not in inspect_artifact(path)


def test_artifact_after_lora_holds_the_refitted_weights(tmp_path):
    from prx_compile.lora import load_lora, make_random_lora

    model = make_prx()
    ct = compile_prx(model, backend="eager", **RANGE)
    load_lora(ct, make_random_lora(model, 4, std=0.1), "a")
    kw = prx_inputs(model, h=16, w=16)
    out = ct(**kw, return_dict=False)[0]
    save_compiled(ct, tmp_path / "a")
    assert read_manifest(tmp_path / "a")["lora"]["active"] == {"a": 1.0}
    assert torch.equal(load_compiled(tmp_path / "a")(**kw, return_dict=False)[0], out)


def flip_byte(p: Path):
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage,match",
    [
        (lambda p: flip_byte(p / WEIGHTS), "does not match its sha256"),
        (lambda p: (p / WEIGHTS).write_bytes((p / WEIGHTS).read_bytes()[:100]), "truncated or replaced"),
        (lambda p: (p / WEIGHTS).unlink(), "weights.safetensors is missing"),
        (lambda p: (p / MANIFEST).write_text("{not json"), "not valid JSON"),
        (lambda p: (p / MANIFEST).unlink(), "manifest.json is missing"),
        (
            lambda p: (p / MANIFEST).write_text(
                json.dumps({**json.loads((p / MANIFEST).read_text()), "format_version": 99})
            ),
            "format version 99",
        ),
    ],
)
def test_damaged_artifacts_give_clear_errors(artifact, damage, match):
    path = artifact[0]
    damage(path)
    with pytest.raises(ArtifactError, match=match):
        load_compiled(path)


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['PRX_PWNED']}",))


@pytest.mark.parametrize("target", [WEIGHTS, MANIFEST])
@pytest.mark.parametrize("verify", [True, False])
def test_pickle_payloads_are_refused_and_never_run(artifact, tmp_path, monkeypatch, target, verify):
    path = artifact[0]
    marker = tmp_path / "pwned"
    monkeypatch.setenv("PRX_PWNED", str(marker))
    blob = pickle.dumps(Payload())
    (path / target).write_bytes(blob)
    if target == WEIGHTS:  # a tamperer can also rewrite the manifest's hash
        m = json.loads((path / MANIFEST).read_text())
        m["files"][WEIGHTS] = {"bytes": len(blob), "sha256": sha256_file(path / WEIGHTS)}
        (path / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ArtifactError):
        load_compiled(path, verify=verify)
    assert not marker.exists()


def test_engine_and_gpu_mismatch_are_named():
    m = {
        "backend": "tensorrt",
        "versions": {"tensorrt": "0.0.1", "tensorrt_package": "tensorrt"},
        "gpu": {"name": "X", "capability": [1, 0]},
    }
    with pytest.raises(ArtifactError, match="built with tensorrt 0.0.1.*rebuild=True"):
        check_compatible(m)
    check_compatible({**m, "backend": "eager"})  # no engines: nothing to match


def test_rebuild_from_saved_weights(artifact):
    path, kw, out, _ = artifact
    loaded = load_compiled(path, rebuild=True)
    assert torch.equal(loaded(**kw, return_dict=False)[0], out)


def test_writes_are_atomic(artifact, monkeypatch):
    """A save that fails half-way leaves no loadable half-artifact and no temporary files."""
    import prx_compile.serialization as s

    path, kw, out, model = artifact
    old = (path / WEIGHTS).read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(s.os, "fsync", boom)
    ct = compile_prx(model, backend="eager", **RANGE)
    with pytest.raises(OSError, match="disk full"):
        save_compiled(ct, path)
    assert (path / WEIGHTS).read_bytes() == old  # the old file was never partly overwritten
    assert not [p for p in path.iterdir() if ".tmp-" in p.name]
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        load_compiled(path)


WORKER = textwrap.dedent("""
    import json, sys, torch
    from prx_compile import compile_prx
    from prx_compile.serialization import save_compiled
    from prx_compile.testing import make_prx
    from prx_compile.export import example_inputs
    mode, path = sys.argv[1], sys.argv[2]
    model = make_prx()
    rng = dict(batch=[1, 2], text_len=[1, 16], resolution=16, aspect_bins=[], vae_scale_factor=1)
    kw = example_inputs(model.config, 2, 16, 16, 12, masked_tokens=5)
    if mode == "save":
        ct = compile_prx(model, backend="eager", **rng)
        ct(**kw, return_dict=False)
        save_compiled(ct, path)
        print(json.dumps({"ok": True}))
    else:
        ct = compile_prx(model, backend="eager", engine_cache_dir=path, **rng)
        out = ct(**kw, return_dict=False)[0]
        print(json.dumps({"hit": ct.cache_hit["load_s"] is not None, "sum": float(out.double().sum())}))
""")


def _spawn(mode, path, n=2):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, mode, str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(n)
    ]
    outs = []
    for p in procs:
        so, se = p.communicate(timeout=300)
        assert p.returncode == 0, se[-2000:]
        outs.append(json.loads(so.strip().splitlines()[-1]))
    return outs


def test_concurrent_writers_leave_a_valid_artifact(tmp_path):
    _spawn("save", tmp_path / "art")
    m = read_manifest(tmp_path / "art")
    load_compiled(tmp_path / "art")  # verifies every hash
    assert m["files"]


def test_engine_cache_shared_by_two_processes(tmp_path):
    results = _spawn("cache", tmp_path / "cache")
    assert sorted(r["hit"] for r in results) == [False, True]  # built once, loaded once
    assert results[0]["sum"] == results[1]["sum"]
    entries = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert len(entries) == 1 and (entries[0] / MANIFEST).is_file()
