"""Artifacts: round trips (LoRA included), damaged and hostile files, atomic saves, and an engine cache
shared by real processes. Loading is attacked through every manifest field and the files themselves;
it must either load the same weights or raise ArtifactError, and never read or write outside."""

import importlib
import json
import os
import pickle
import resource
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from prx_compile import ArtifactError, compile_prx, inspect_artifact, load_compiled, save_compiled
from prx_compile.io.artifact import CHUNK, FORMAT_VERSION, MANIFEST, _chunk_hashes
from prx_compile.io.saving import LORA, WEIGHTS, check_compatible
from prx_compile.lora import load_lora, make_random_lora, summary, unload_lora
from prx_compile.models import prx
from prx_compile.tools.testing import make_prx

from .conftest import prx_inputs

RANGE = dict(batch=[1, 2], text_len=[1, 16], resolution=16, aspect_bins=[], vae_scale_factor=1, static=True)
ROOT = Path(__file__).resolve().parents[1]


def manifest(path):
    return json.loads((path / MANIFEST).read_text())


def write_manifest(path, m):
    (path / MANIFEST).write_text(json.dumps(m))


def rehash(path, rel):
    """Rewrite the manifest's size and hashes of ``rel``, as a tamperer could."""
    m = manifest(path)
    with open(path / rel, "rb") as f:
        m["files"][rel] = {"bytes": os.fstat(f.fileno()).st_size, "sha256": _chunk_hashes(f.fileno())}
    write_manifest(path, m)


def retag(path, rel, key, record):
    """Put ``record`` in both the safetensors header of ``rel`` and the manifest, as a tamperer could."""
    save_file(load_file(str(path / rel)), str(path / rel), metadata={key: json.dumps(record)})
    rehash(path, rel)
    m = manifest(path)
    m[key.split(".")[1]] = record
    write_manifest(path, m)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An eager artifact of a tiny PRX with a LoRA active, and what it computes."""
    model = make_prx()
    ct = compile_prx(model, backend="eager", specialize=[[16, 16, 2]], **RANGE)
    kw = prx_inputs(model, h=16, w=16, text=16)
    base = ct(**kw, return_dict=False)[0]
    load_lora(ct, make_random_lora(model, 4, std=0.1), "a", 0.7)
    out = ct(**kw, return_dict=False)[0]
    path = save_compiled(ct, tmp_path_factory.mktemp("saved") / "art")
    return path, kw, base, out, model


@pytest.fixture
def artifact(saved, tmp_path):
    """A fresh copy of the saved artifact to damage."""
    dst = tmp_path / "art"
    shutil.copytree(saved[0], dst)
    return dst


def test_roundtrip_holds_the_weights_once_and_the_lora(saved):
    path, kw, base, out, model = saved
    m = manifest(path)
    assert m["format_version"] == FORMAT_VERSION and m["kind"] == "artifact"
    assert m["config"]["backend"] == "eager" and m["config"]["engine_cache_dir"] is None
    assert m["model"]["class"] == "PRXTransformer2DModel" and m["model"]["config"]["hidden_size"] == 64
    assert set(m["files"]) == {WEIGHTS, LORA}
    assert m["lora"]["active"] == {"a": 0.7}
    loaded = load_compiled(path)
    assert torch.equal(loaded(**kw, return_dict=False)[0], out)
    assert {k: v for k, v in dict(loaded.config).items() if not k.startswith("_")} == m["model"]["config"]
    assert summary(loaded)["active"] == {"a": 0.7}
    for k, v in model.state_dict().items():  # the fused weights come back bit for bit
        assert torch.equal(loaded.transformer.state_dict()[k], v), k
    unload_lora(loaded)  # exact after a reload: the originals were saved, not the fused weights
    assert torch.equal(loaded(**kw, return_dict=False)[0], base)
    load_lora(loaded, make_random_lora(model, 4, std=0.1), "b")
    unload_lora(loaded)
    assert torch.equal(loaded(**kw, return_dict=False)[0], base)


def test_a_new_process_loads_it_and_computes_the_same(saved, tmp_path):
    """What a server does: a new Python process whose first prx_compile call is ``load_compiled``
    (the import-ahead thread and the load both import diffusers' class: 0.17's first cut raced there
    and raised a raw AttributeError every time)."""
    path, kw, base, out, model = saved
    torch.save(kw, tmp_path / "inputs.pt")
    code = textwrap.dedent(
        f"""
        import torch
        from prx_compile import load_compiled
        kw = torch.load({str(tmp_path / "inputs.pt")!r})
        torch.save(load_compiled({str(path)!r})(**kw, return_dict=False)[0], {str(tmp_path / "out.pt")!r})
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert torch.equal(torch.load(tmp_path / "out.pt"), out)


def test_loaded_weights_are_not_a_map_of_the_file(artifact):
    loaded = load_compiled(artifact)
    before = {k: v.clone() for k, v in loaded.transformer.state_dict().items()}
    data = (artifact / WEIGHTS).read_bytes()
    (artifact / WEIGHTS).write_bytes(data[:-4096] + bytes(4096))  # the file changes under the module
    after = loaded.transformer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_inspect_summarises_and_verifies(artifact):
    info = inspect_artifact(artifact)
    assert info["backend"] == "eager" and info["lora"]["active"] == {"a": 0.7} and info["verified"]
    assert info["engine_sets"] == [{"shapes": "batch 2, latent 16x16, text 16 tokens", "engines": 0}]
    (artifact / WEIGHTS).unlink()
    with pytest.raises(ArtifactError, match="weights.safetensors is missing"):
        inspect_artifact(artifact)


def flip_byte(p: Path):
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def symlink_weights_outside(p: Path):
    outside = p.parent / "outside.safetensors"
    (p / WEIGHTS).rename(outside)
    (p / WEIGHTS).symlink_to(outside)


def symlink_manifest(p: Path):
    (p / MANIFEST).rename(p.parent / "m.json")
    (p / MANIFEST).symlink_to(p.parent / "m.json")


def list_outside_file(rel):
    def damage(p: Path):
        m = manifest(p)
        m["files"][rel] = {"bytes": 1, "sha256": ["0" * 64]}
        write_manifest(p, m)

    return damage


def symlinked_dir(p: Path):
    (p.parent / "elsewhere").mkdir()
    (p.parent / "elsewhere" / "x.engine").write_bytes(b"x")
    (p / "sets").symlink_to(p.parent / "elsewhere")
    list_outside_file("sets/x.engine")(p)


@pytest.mark.parametrize(
    "damage,match",
    [
        (lambda p: flip_byte(p / WEIGHTS), "does not match its crc32"),
        (lambda p: (p / WEIGHTS).write_bytes((p / WEIGHTS).read_bytes()[:100]), "truncated or replaced"),
        (lambda p: (p / WEIGHTS).unlink(), "weights.safetensors is missing"),
        (lambda p: (p / MANIFEST).write_text("{not json"), "not valid JSON"),
        (lambda p: (p / MANIFEST).write_text("[" * 100000 + "]" * 100000), "not valid JSON"),
        (lambda p: (p / MANIFEST).unlink(), "manifest.json is missing"),
        (lambda p: write_manifest(p, {**manifest(p), "format_version": 99}), "format version 99"),
        (symlink_weights_outside, "weights.safetensors is a symbolic link"),
        (symlink_manifest, "is it a link"),
        (list_outside_file("../outside"), "not allowed in an artifact"),
        (list_outside_file("/etc/passwd"), "not allowed in an artifact"),
        (list_outside_file("sets/x.engine\n"), "not allowed in an artifact"),
        (lambda p: (p / MANIFEST).write_text('{"format": 1' + "1" * 5000 + "}"), "not valid JSON"),
        (symlinked_dir, r"sets/x.engine is a symbolic link|lists files no load reads \(sets/x.engine\)"),
        (
            lambda p: write_manifest(p, {k: v for k, v in manifest(p).items() if k != "config"}),
            r"manifest\.config is missing",
        ),
        (lambda p: write_manifest(p, {**manifest(p), "config": []}), r"manifest\.config: expected a mapping"),
        (lambda p: write_manifest(p, {**manifest(p), "sets": {}}), r"manifest\.sets: expected a list"),
        (lambda p: write_manifest(p, {**manifest(p), "extra": 1}), r"manifest has the key 'extra'"),
        (lambda p: write_manifest(p, {**manifest(p), "gpu": {"name": "x"}}), r"manifest\.gpu: expected"),
        (lambda p: write_manifest(p, {**manifest(p), "lora": None}), "manifest.lora does not match"),
        (lambda p: write_manifest(p, {**manifest(p), "model": {}}), "manifest.model does not match"),
    ],
)
def test_damaged_artifacts_give_clear_errors(artifact, damage, match):
    damage(artifact)
    with pytest.raises(ArtifactError, match=match):
        load_compiled(artifact)


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['PRX_PWNED']}",))


@pytest.mark.parametrize("target", [WEIGHTS, LORA, MANIFEST])
@pytest.mark.parametrize("verify", [True, False])
def test_pickle_payloads_are_refused_and_never_run(artifact, tmp_path, monkeypatch, target, verify):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("PRX_PWNED", str(marker))
    (artifact / target).write_bytes(pickle.dumps(Payload()))
    if target != MANIFEST:  # a tamperer also rewrites the manifest's hash
        rehash(artifact, target)
    with pytest.raises(ArtifactError):
        load_compiled(artifact, verify=verify)
    assert not marker.exists()


@pytest.mark.parametrize(
    "key,record,match",
    [
        ("prx_compile.model", {"class": "os.system", "config": {}}, "model.class"),
        ("prx_compile.model", {"class": "PRXTransformer2DModel", "config": {"depth": 10**9}}, "depth"),
        (
            "prx_compile.model",
            {"class": "PRXTransformer2DModel", "config": {"hidden_size": 65}},
            "make a PRXTransformer2DModel",
        ),
        (
            "prx_compile.model",
            {"class": "PRXTransformer2DModel", "config": {"__class__": 1}},
            "not a PRXTransformer2DModel setting",
        ),
        (
            "prx_compile.model",
            {"class": "PRXTransformer2DModel", "config": {"theta": "1e4"}},
            "not an allowed value",
        ),
        (
            "prx_compile.model",
            {"class": "PRXTransformer2DModel", "config": {"theta": 10**400}},
            r"config\.theta=<1329-bit int> is not an allowed value",
        ),
        (
            "prx_compile.model",
            {"class": "PRXTransformer2DModel", "config": {"depth": 10**400}},
            r"config\.depth=<1329-bit int> is not an allowed value",
        ),
        (
            "prx_compile.model",
            {"class": "PRXTransformer2DModel", "config": {"depth": None}},
            "not an allowed",
        ),
        ("prx_compile.model", {"class": "PRXTransformer2DModel", "config": {"depth": [1]}}, "not an allowed"),
        (
            "prx_compile.model",
            {"class": "PRXTransformer2DModel", "config": {"mlp_ratio": "x"}},
            "not an allowed",
        ),
        (
            "prx_compile.model",
            {"class": "PRXTransformer2DModel", "config": {"resolution_embeds": 1}},
            "not an allowed",
        ),
        (
            "prx_compile.lora",
            {"adapters": {"../x": {"source": "", "layers": {}}}, "active": {}},
            "cannot be restored",
        ),
        ("prx_compile.lora", {"adapters": {}, "active": {"a": 1.0}}, "cannot be restored"),
        (
            "prx_compile.lora",
            {"adapters": {"a": {"source": "", "layers": {"x": 1.0}}}, "active": {}},
            "unknown",
        ),
        ("prx_compile.lora", {"adapters": {}, "active": {}, "extra": 1}, "cannot be restored"),
        # 0.28's fields: what disable_lora set aside, and each adapter's last scale
        ("prx_compile.lora", {"adapters": {}, "active": {}, "disabled": {"a": 1.0}}, "cannot be restored"),
        ("prx_compile.lora", {"adapters": {}, "active": {}, "disabled": [1]}, "cannot be restored"),
        (
            "prx_compile.lora",
            {"adapters": {"a": {"source": "", "layers": {}}}, "active": {"a": 1.0}, "disabled": {"a": 1.0}},
            "cannot be restored",
        ),
        (
            "prx_compile.lora",
            {"adapters": {"a": {"source": "", "layers": {}, "scale": 1e9}}, "active": {}},
            "cannot be restored",
        ),
        (
            "prx_compile.lora",
            {"adapters": {"a": {"source": "", "layers": {}, "scale": float("nan")}}, "active": {}},
            "cannot be restored",
        ),
    ],
)
def test_hostile_records_in_hashed_files_are_artifact_errors(artifact, key, record, match):
    retag(artifact, WEIGHTS if key.endswith("model") else LORA, key, record)
    with pytest.raises(ArtifactError, match=match):
        load_compiled(artifact)


@pytest.mark.parametrize(
    "value,match",
    [
        ({"backend": "eager", "device": "cpu; rm -rf /"}, "device"),
        ({"backend": "__import__('os').system('x')"}, "backend"),
        ({"batch": [True, 2]}, "batch"),
        ({"dtype": "bf16"}, "expected one dtype"),
        ({"weights": "exec"}, "weights"),
        ({"resolution": 10**400}, r"resolution=<1329-bit int> must be a positive integer"),
    ],
)
def test_hostile_config_values_are_artifact_errors(artifact, value, match):
    m = manifest(artifact)
    m["config"] = {**m["config"], **value}
    write_manifest(artifact, m)
    with pytest.raises(ArtifactError, match=match):
        load_compiled(artifact)


def test_hostile_engine_set_records_are_artifact_errors(artifact):
    for sets, match in (
        ([{"shapes": {"batch": [1, "2"]}, "state": {}}], r"sets\[0\]"),
        ([{"shapes": None, "state": {}}], r"sets\[0\]"),
        (
            [
                {
                    "shapes": manifest(artifact)["sets"][0]["shapes"],
                    "state": {"meta": {"kind": "torch", "x": 1}, "blobs": [], "tensors": False},
                }
            ],
            r"sets\[0\]: a torch backend state",
        ),
        (
            [
                {
                    "shapes": manifest(artifact)["sets"][0]["shapes"],
                    "state": {"meta": {"kind": "torch"}, "blobs": ["../../x"], "tensors": False},
                }
            ],
            r"manifest\.sets\[0\]\.state\.blobs\[0\]: expected a file name, got '\.\./\.\./x'",
        ),
    ):
        write_manifest(artifact, {**manifest(artifact), "sets": sets})
        with pytest.raises(ArtifactError, match=match):
            load_compiled(artifact)


def test_a_module_an_artifact_could_not_hold_is_refused_before_saving(tmp_path):
    ct = compile_prx(make_prx(), backend="eager", **{**RANGE, "resolution": 2048, "static": False})
    with pytest.raises(ArtifactError, match="plans an engine set beyond what an artifact may hold"):
        save_compiled(ct, tmp_path / "art")
    assert not (tmp_path / "art").exists() and not ct.is_built  # refused before any build


def test_what_load_compiled_would_not_make_again_is_refused_before_saving(tmp_path):
    """load_compiled constructs the model from its config: a processor, a hook or a setting changed
    on the transformer would be gone after a load (0.31 saved without them, silently: 1.6e-1 off
    after ``norm_out.norm.eps = 0.1`` on FLUX.1). Undone, the module saves."""
    model = make_prx()
    ct = compile_prx(model, backend="eager", **RANGE)
    attention = model.blocks[1].attention

    class Mine(type(attention.processor)):
        pass

    plain = attention.processor
    handle = model.blocks[0].register_forward_hook(lambda m, a, out: out)
    for edit, undo, match in (
        (lambda: None, handle.remove, r"blocks\.0 \(hooks, forward or processor\)"),
        (
            lambda: attention.set_processor(Mine()),
            lambda: attention.set_processor(plain),
            r"blocks\.1\.attention \(",
        ),
        (
            lambda: setattr(model.final_layer.norm_final, "eps", 0.1),
            lambda: setattr(model.final_layer.norm_final, "eps", 1e-6),
            r"final_layer\.norm_final\.eps",
        ),
    ):
        edit()
        with pytest.raises(ArtifactError, match=f"cannot hold what was changed on this transformer.*{match}"):
            save_compiled(ct, tmp_path / "art")
        undo()
    save_compiled(ct, tmp_path / "art")


def test_every_engine_set_a_loaded_module_can_build_is_held_to_the_disk_limits(artifact):
    """Without saved sets the module builds what the manifest's config plans: those are held to the
    limits of a set read from disk (0.26 let ``"sets": []`` ask for a 65536² latent, 17.6 TB)."""
    m = manifest(artifact)
    m["sets"] = []
    m["config"].update(resolution=65536, specialize=[[65536, 65536, 256]], batch=[1, 256], text_len=[16, 16])
    write_manifest(artifact, m)
    with pytest.raises(ArtifactError, match="plans an engine set beyond the limits: shapes.width"):
        load_compiled(artifact)
    m["config"].update(resolution=2048, specialize=[[2048, 2048, 2]], batch=[1, 2])  # 2**21 tokens a step
    write_manifest(artifact, m)
    with pytest.raises(ArtifactError, match="tokens a step, more than 1048576"):
        load_compiled(artifact)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"multiple": 1, "height": [15, 17], "width": [15, 17]}, "latent sizes in multiples of 1; this"),
        ({"tokens": True, "height": [1, 64], "width": [1, 1], "multiple": 1}, "a range of image tokens"),
    ],
    ids=["multiple", "tokens"],
)
def test_a_saved_set_the_model_cannot_take_is_refused_at_load(artifact, change, match):
    m = manifest(artifact)
    m["sets"][0]["shapes"].update(change)
    write_manifest(artifact, m)
    with pytest.raises(ArtifactError, match=match):
        load_compiled(artifact)


def test_a_model_config_its_class_accepts_but_cannot_run_is_refused_at_load(artifact):
    """PRX's RoPE takes one size per id column (row, column): diffusers accepts ``axes_dim=[16]``
    and fails at the first call."""
    record = manifest(artifact)["model"]
    record["config"]["axes_dim"] = [16]
    retag(artifact, WEIGHTS, "prx_compile.model", record)
    with pytest.raises(ArtifactError, match=r"axes_dim=\[16\] must be 2 positive even sizes"):
        load_compiled(artifact)


def test_a_lora_file_with_tensors_its_record_does_not_name_is_refused(artifact):
    from safetensors import safe_open

    with safe_open(str(artifact / LORA), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(artifact / LORA))
    save_file({**tensors, "smuggled": torch.zeros(4, dtype=torch.int64)}, str(artifact / LORA), metadata=meta)
    rehash(artifact, LORA)
    with pytest.raises(ArtifactError, match="1 tensor.s. the LoRA record does not name, e.g. 'smuggled'"):
        load_compiled(artifact)


def test_a_dtype_torch_cannot_read_is_an_artifact_error(artifact):
    """F4 is a safetensors dtype torch's reader does not know (a raw KeyError in 0.26)."""
    path = artifact / WEIGHTS
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    end = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
    header["extra"] = {"dtype": "F4", "shape": [4], "data_offsets": [end, end + 2]}
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :] + b"\0\0")
    rehash(artifact, WEIGHTS)
    with pytest.raises(ArtifactError, match=r"not a readable safetensors file \(KeyError: 'F4'\)"):
        load_compiled(artifact)


def test_engines_of_another_backend_are_refused(artifact):
    """The loader follows the config's backend only: a TensorRT state under an eager config is refused."""
    m = manifest(artifact)
    m["sets"][0]["state"]["meta"] = {
        "kind": "tensorrt",
        "weights": "inputs",
        "program": {},
        "engines": {},
        "provenance": {},
    }
    write_manifest(artifact, m)
    with pytest.raises(ArtifactError, match=r"sets\[0\]: a torch backend state"):
        load_compiled(artifact)


def test_the_manifest_cannot_choose_where_anything_is_written(artifact, tmp_path):
    m = manifest(artifact)
    m["config"]["engine_cache_dir"] = str(tmp_path / "chosen-by-the-manifest")
    write_manifest(artifact, m)
    loaded = load_compiled(artifact)
    assert loaded.compile_config.engine_cache_dir is None
    loaded(**prx_inputs(loaded.transformer, h=16, w=16, text=16), return_dict=False)
    assert not (tmp_path / "chosen-by-the-manifest").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the version check needs Torch-TensorRT")
def test_engine_and_gpu_mismatch_are_named():
    m = {
        "versions": {"tensorrt": "0.0.1", "tensorrt_package": "tensorrt"},
        "gpu": {"name": "X", "capability": [1, 0]},
    }
    with pytest.raises(ArtifactError, match="built with tensorrt 0.0.1.*rebuild=True"):
        check_compatible(m)


def test_tensorrt_artifact_on_a_cpu_machine_says_what_to_do(artifact):
    m = manifest(artifact)
    m["config"]["backend"] = "tensorrt"
    write_manifest(artifact, m)
    if not torch.cuda.is_available():
        with pytest.raises(ArtifactError, match="cannot run here.*CUDA GPU.*backend='eager', device='cpu'"):
            load_compiled(artifact)
    loaded = load_compiled(artifact, backend="eager", device="cpu")  # rebuilds from the weights
    assert loaded.compile_config.backend == "eager" and not loaded.backends[0].is_built


def test_rebuild_from_saved_weights(saved):
    path, kw, _, out, _ = saved
    loaded = load_compiled(path, rebuild=True)
    assert not loaded.is_built
    assert torch.equal(loaded(**kw, return_dict=False)[0], out)


# -- saving ------------------------------------------------------------------------------------
def test_a_failed_save_keeps_the_previous_artifact(artifact, monkeypatch):
    import prx_compile.io.artifact as a

    old = manifest(artifact)
    model = make_prx(seed=5)
    ct = compile_prx(model, backend="eager", specialize=[[16, 16, 2]], **RANGE)

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(a.os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        save_compiled(ct, artifact)
    monkeypatch.undo()
    assert manifest(artifact) == old
    load_compiled(artifact)  # still complete and loadable
    assert not [p for p in artifact.parent.iterdir() if ".tmp-" in p.name]
    save_compiled(ct, artifact)  # replaces it
    assert manifest(artifact)["lora"] is None


def test_leftovers_of_a_killed_save_are_removed_by_the_next(artifact):
    leftover = artifact.parent / ".art.tmp-killed"
    leftover.mkdir()
    (leftover / WEIGHTS).write_bytes(b"x" * 1000)
    save_compiled(load_compiled(artifact), artifact)
    assert not leftover.exists()


@pytest.mark.parametrize("kind", ["file", "dir", "symlink"])
def test_save_never_overwrites_what_is_not_an_artifact(tmp_path, saved, kind):
    ct = load_compiled(saved[0])
    target = tmp_path / "target"
    if kind == "file":
        target.write_text("precious")
    elif kind == "dir":
        target.mkdir()
        (target / "notes.txt").write_text("precious")
    else:
        (tmp_path / "real").mkdir()
        target.symlink_to(tmp_path / "real")
    with pytest.raises(ArtifactError, match="not a prx_compile artifact|symbolic link|not a directory"):
        save_compiled(ct, target)
    if kind == "dir":
        assert (target / "notes.txt").read_text() == "precious"


def test_a_save_leaves_no_lock_file_and_follows_no_planted_one(tmp_path, saved):
    ct = load_compiled(saved[0])
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (tmp_path / ".art.lock").symlink_to(victim)  # where 0.5 kept its lock file
    save_compiled(ct, tmp_path / "art")
    assert victim.read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".art.lock", "art", "victim.txt"]


def test_saved_files_take_the_umask_as_open_would(tmp_path, saved):
    ct = load_compiled(saved[0])
    old = os.umask(0o027)
    try:
        save_compiled(ct, tmp_path / "art")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "art").stat().st_mode) == 0o750
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "art").rglob("*") if p.is_file()} == {0o640}


def test_files_are_hashed_per_chunk(artifact):
    for entry in manifest(artifact)["files"].values():
        assert len(entry["sha256"]) == len(entry["crc32"]) == max(1, -(-entry["bytes"] // CHUNK))


# -- the loader reads and writes nothing outside the artifact -----------------------------------------
class FileAudit:
    """Records file events while active (an audit hook cannot be removed, so it is switched)."""

    events: list = []
    active = False

    @classmethod
    def hook(cls, event, args):
        if cls.active and event in (
            "open",
            "os.rename",
            "os.remove",
            "os.mkdir",
            "os.rmdir",
            "shutil.rmtree",
        ):
            cls.events.append((event, args))


sys.addaudithook(FileAudit.hook)


def outside_access(root: Path) -> list:
    bad = []
    for event, args in FileAudit.events:
        if event != "open":
            bad.append((event, args))
            continue
        path, mode, flags = args
        if isinstance(path, int) or path is None:
            continue
        path = str(path)
        writes = (mode and any(c in str(mode) for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        )
        # /proc/meminfo: the memory free for the weights, read (only) before they are made
        inside = (
            not os.path.isabs(path)
            or path.startswith(str(root))
            or path.startswith("/proc/self/fd/")
            or (path == "/proc/meminfo" and not writes)
        )
        if writes or not inside:
            bad.append((event, args))
    return bad


def test_loading_touches_nothing_outside(artifact):
    load_compiled(artifact)  # warm: lazy imports happen here
    FileAudit.events, FileAudit.active = [], True
    try:
        load_compiled(artifact)
    finally:
        FileAudit.active = False
    assert FileAudit.events and not outside_access(artifact), outside_access(artifact)


# -- every malformed field: the same weights, or ArtifactError (property test) -----------------------
JSON_VALUES = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**63,
    1e308,
    float("nan"),
    "",
    "x",
    "../../etc/passwd",
    "/etc/passwd",
    "__import__('os').system('touch pwned')",
    [],
    [1, 2],
    {},
    {"a": 1},
    [[1024, 1024, 2]],
]


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _mutate(obj, path, op, value):
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    if op == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return obj


def test_every_malformed_field_is_an_artifact_error(saved, tmp_path):
    """Deletes or retypes manifest fields (huge integers too) and damages the weights file: loading
    either gives the saved weights and LoRA state, bit for bit, or raises ArtifactError, in under a
    second and 1 GiB per case; nothing else is opened."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    original = manifest(saved[0])
    paths = [p for p in _paths(original) if p]
    want = {k: v.clone() for k, v in saved[4].state_dict().items()}
    root = tmp_path / "art"
    shutil.copytree(saved[0], root)
    weights = (root / WEIGHTS).read_bytes()
    load_compiled(root)  # imports and first-use set-up happen once per process, not per case
    # and what a field's default imports when first asked: the aspect bins (diffusers' pipelines), the
    # tensorrt backend's modules (config.backend's default)
    prx._pipeline_bins(), prx._pixel_bins(), importlib.import_module("prx_compile.backends.tensorrt")

    @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(
        st.sampled_from(paths),
        st.sampled_from(["delete", "replace"]),
        st.sampled_from(JSON_VALUES)
        | st.text(max_size=20)
        | st.integers()
        | st.sampled_from([2**20, 2**31, 2**44, 10**400, -(2**63)]),
        st.sampled_from([None, "flip", "truncate", "empty"]),
    )
    def check(path, op, value, file_damage):
        rss, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
        (root / MANIFEST).write_text(json.dumps(_mutate(json.loads(json.dumps(original)), path, op, value)))
        if file_damage == "flip":
            flip_byte(root / WEIGHTS)
        elif file_damage == "truncate":
            (root / WEIGHTS).write_bytes(weights[: len(weights) // 3])
        elif file_damage == "empty":
            (root / WEIGHTS).write_bytes(b"")
        FileAudit.events, FileAudit.active = [], True
        try:
            loaded = load_compiled(root)
        except ArtifactError:
            loaded = None
        finally:
            FileAudit.active = False
            (root / WEIGHTS).write_bytes(weights)
        assert not outside_access(root), outside_access(root)
        assert time.perf_counter() - t0 < 1.0  # bounded, whatever the field holds
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 2**20  # and under 1 GiB more
        if loaded is not None:
            state = loaded.transformer.state_dict()
            bad = [k for k in want if not torch.equal(state[k], want[k])]
            assert state.keys() == want.keys() and not bad, bad[:3]
            assert summary(loaded)["active"] == {"a": 0.7}

    check()


# -- two processes -----------------------------------------------------------------------------
#: what each of the two processes does: this one (the test's) and a new one, in step
STEPS = textwrap.dedent("""
    import json, sys, torch
    from prx_compile import compile_prx, save_compiled
    from prx_compile.tools.testing import make_prx
    from prx_compile.export import example_inputs
    RNG = dict(batch=[1, 2], text_len=[1, 16], resolution=16, aspect_bins=[], vae_scale_factor=1,
               static=True, specialize=[[16, 16, 2]])

    def prepare():
        model = make_prx()
        return model, example_inputs(model, 2, 16, 16, 16, masked_tokens=5)

    def save(model, kw, artifact):  # 1. both write the same artifact
        ct = compile_prx(model, backend="eager", **RNG)
        ct(**kw, return_dict=False)
        save_compiled(ct, artifact)

    def fill(model, kw, cache):  # 2. both build one engine set through one engine cache
        import logging
        said = []  # the cache's warnings (an entry it could not use), for the assertion's message
        handler = logging.Handler()
        handler.emit = lambda record: said.append(record.getMessage()[:500])
        logging.getLogger("prx_compile.io.cache").addHandler(handler)
        try:
            ct = compile_prx(model, backend="eager", engine_cache_dir=cache, **RNG)
            out = ct(**kw, return_dict=False)[0]
        finally:
            logging.getLogger("prx_compile.io.cache").removeHandler(handler)
        out = out.double()
        return {"hit": ct.cache_hits[0]["load_s"] is not None, "key": ct.cache_hits[0]["key"],
                "sum": float(out.sum()), "abs": float(out.abs().sum()), "said": said}
""")
WORKER = STEPS + textwrap.dedent("""
    model, kw = prepare()
    print("ready", flush=True)
    sys.stdin.readline()
    save(model, kw, sys.argv[1])
    print("saved", flush=True)
    sys.stdin.readline()
    print(json.dumps(fill(model, kw, sys.argv[2])), flush=True)
""")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """This process and a new one, each saving the same artifact to one path at the same moment, then
    building the same engine set through one engine cache at the same moment (the new one waits on
    its stdin for each start, after its imports): (folder, [each process's cache result])."""
    root = tmp_path_factory.mktemp("two")
    (root / "writers").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    art, cache = root / "writers" / "art", root / "cache"
    steps: dict = {}
    exec(STEPS, steps)
    model, kw = steps["prepare"]()
    with open(root / "stderr.txt", "w") as err:
        other = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(art), str(cache)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
    try:

        def step(expected: str) -> None:
            line = other.stdout.readline().strip()
            assert line == expected, (root / "stderr.txt").read_text()[-2000:]
            other.stdin.write("go\n")
            other.stdin.flush()

        step("ready")
        steps["save"](model, kw, str(art))
        step("saved")
        mine = steps["fill"](model, kw, str(cache))
        out, _ = other.communicate(timeout=300)
        assert other.returncode == 0, (root / "stderr.txt").read_text()[-2000:]
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
    return root, [mine, json.loads(out.strip().splitlines()[-1])]


def test_concurrent_writers_leave_a_valid_artifact(two_processes):
    root, _ = two_processes
    load_compiled(root / "writers" / "art")  # verifies every hash
    assert [p.name for p in (root / "writers").iterdir() if not p.name.startswith(".")] == ["art"]


def test_engine_cache_shared_by_two_processes(two_processes):
    root, results = two_processes
    said = (root / "stderr.txt").read_text()[-1500:]
    assert results[0]["key"] == results[1]["key"], (results, said)  # one engine set, one key in both
    assert sorted(r["hit"] for r in results) == [False, True], (results, said)  # built once, loaded once
    # the same engine set and weights: equal but for a CPU matmul's last bits, which depend on how
    # each process's buffers are aligned (0.27 compared the sums exactly: it failed once)
    assert abs(results[0]["sum"] - results[1]["sum"]) <= 1e-6 * results[0]["abs"], results
    entries = [p for p in (root / "cache").iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(entries) == 1 and (entries[0] / MANIFEST).is_file()


def test_engine_cache_keys_on_what_engines_depend_on(tmp_path):
    """The same engines whether the config names the model's dtype or leaves it to the model; other
    weights (a fine-tune) hit the same entry with weights as inputs."""
    cfg = dict(RANGE, specialize=[[16, 16, 2]], engine_cache_dir=str(tmp_path / "cache"), backend="eager")
    kw = prx_inputs(make_prx(), h=16, w=16, text=16)
    first = compile_prx(make_prx(), **cfg)
    first(**kw, return_dict=False)
    second = compile_prx(make_prx(), dtype="fp32", **cfg)
    second(**kw, return_dict=False)
    tuned = make_prx(seed=7)
    third = compile_prx(tuned, **cfg)
    out = third(**kw, return_dict=False)[0]
    assert [c.cache_hits[0]["load_s"] is not None for c in (first, second, third)] == [False, True, True]
    torch.testing.assert_close(out, tuned(**kw, return_dict=False)[0], rtol=0, atol=1e-5)
    other = compile_prx(make_prx(), attention="flash", **cfg)
    other(**kw, return_dict=False)
    assert other.cache_hits[0]["load_s"] is None  # another engine setting: another entry


def test_weights_of_a_foreign_dtype_are_refused(artifact):
    state = load_file(str(artifact / WEIGHTS))
    meta = {"prx_compile.model": json.dumps(manifest(artifact)["model"])}
    save_file({k: v.to(torch.int32) for k, v in state.items()}, str(artifact / WEIGHTS), metadata=meta)
    rehash(artifact, WEIGHTS)
    m = manifest(artifact)
    m["config"]["dtype"] = None
    write_manifest(artifact, m)
    with pytest.raises(ArtifactError, match="expected one dtype"):
        load_compiled(artifact)


@pytest.mark.parametrize("what", ["fifo", "hardlink"])
def test_special_files_are_refused(artifact, what):
    if what == "fifo":
        (artifact / MANIFEST).unlink()
        os.mkfifo(artifact / MANIFEST)  # opening a FIFO must not block forever
        match = "not a regular file"
    else:
        os.link(artifact / WEIGHTS, artifact.parent / "elsewhere.safetensors")
        match = "hard link"
    with pytest.raises(ArtifactError, match=match):
        load_compiled(artifact)


def test_inspect_survives_fields_of_the_wrong_type(artifact):
    m = manifest(artifact)
    m.update(model="x", versions=[1], gpu="y", lora=3, sets=[None, {"shapes": 1}])
    write_manifest(artifact, m)
    info = inspect_artifact(artifact)
    assert info["model"] is None and info["versions"] == {} and info["lora"] is None
    assert [s["shapes"] for s in info["engine_sets"]] == ["?", "?"]


def test_a_gpu_artifact_on_a_cpu_machine_names_the_way_out(artifact):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    m = manifest(artifact)
    m["config"]["device"] = "cuda"
    write_manifest(artifact, m)
    with pytest.raises(ArtifactError, match="no CUDA GPU.*backend='eager', device='cpu'"):
        load_compiled(artifact)
    assert load_compiled(artifact, device="cpu").compile_config.device == "cpu"


def test_a_save_killed_between_its_renames_loses_nothing(artifact):
    import prx_compile.io.artifact as a

    aside = artifact.parent / ".art.old-killed"
    aside.mkdir()
    artifact.rename(aside / "previous")  # what a kill between the two renames leaves
    (artifact.parent / ".art.tmp-killed").mkdir()
    a._recover(artifact)
    assert manifest(artifact)["kind"] == "artifact" and not aside.exists()
    assert not (artifact.parent / ".art.tmp-killed").exists()
    load_compiled(artifact)


def test_cleanup_touches_only_its_own_leftovers(tmp_path, saved):
    other = tmp_path / ".abc.tmp-in-progress"
    other.mkdir()
    save_compiled(load_compiled(saved[0]), tmp_path / "a*")
    assert other.exists()


def test_an_artifact_never_replaces_an_engine_cache_entry(tmp_path, saved):
    cfg = dict(RANGE, specialize=[[16, 16, 2]], engine_cache_dir=str(tmp_path / "cache"), backend="eager")
    ct = compile_prx(make_prx(), **cfg)
    ct(**prx_inputs(make_prx(), h=16, w=16, text=16), return_dict=False)
    entry = next(p for p in (tmp_path / "cache").iterdir() if p.is_dir() and not p.name.startswith("."))
    with pytest.raises(ArtifactError, match="not a prx_compile artifact"):
        save_compiled(load_compiled(saved[0]), entry)


def test_saving_a_float64_model_is_refused_before_any_build(tmp_path):
    ct = compile_prx(make_prx().double(), backend="eager", specialize=[[16, 16, 2]], **RANGE)
    with pytest.raises(ArtifactError, match="cannot save a torch.float64 model"):
        save_compiled(ct, tmp_path / "x")
    assert ct.builds == 0


def test_a_listed_sparse_file_is_refused_before_it_is_hashed(artifact):
    """A 16 TiB file of holes (0 bytes on disk) listed with its size: refused at once, not hashed for
    hours; a listing above the size bound is refused from the manifest alone."""
    from prx_compile.io.artifact import CHUNK, MAX_FILE_BYTES

    m = manifest(artifact)
    weights = next(rel for rel in m["files"] if rel.endswith(".safetensors"))
    huge = 2**44  # the manifest alone is refused: the file is never opened
    m["files"][weights] = {"bytes": huge, "sha256": ["0" * 64] * (huge // CHUNK)}
    write_manifest(artifact, m)
    t0 = time.perf_counter()
    with pytest.raises(ArtifactError, match=r"files\['.*'\]\.bytes: expected an integer in"):
        load_compiled(artifact)
    small = MAX_FILE_BYTES // 2**10
    with open(artifact / weights, "r+b") as f:
        f.truncate(small)
    m["files"][weights] = {"bytes": small, "sha256": ["0" * 64] * -(-small // CHUNK)}
    write_manifest(artifact, m)
    with pytest.raises(ArtifactError, match="is a sparse file"):
        load_compiled(artifact)
    assert time.perf_counter() - t0 < 5.0


def test_a_digest_pins_the_artifact_that_was_published(artifact, saved):
    from prx_compile import artifact_digest

    path, kw, _, out, _ = saved
    digest = artifact_digest(artifact)
    assert digest.startswith("sha256:") and len(digest) == 71
    assert digest == artifact_digest(path) == inspect_artifact(artifact)["digest"]  # the same bytes
    loaded = load_compiled(artifact, digest=digest.upper().replace("SHA256", "sha256"))
    assert torch.equal(loaded(**kw, return_dict=False)[0], out)
    # an edit that every per-file hash still accepts (the manifest is where they sit) changes it
    m = manifest(artifact)
    m["created"] = "2026-01-01T00:00:00Z"
    write_manifest(artifact, m)
    assert artifact_digest(artifact) != digest
    with pytest.raises(ArtifactError, match="is not the artifact that was published"):
        load_compiled(artifact, digest=digest)
    for bad, why in (("sha256:abc", "64 hex digits"), ("md5:" + "0" * 64, "64 hex digits")):
        with pytest.raises(ArtifactError, match=why):
            load_compiled(artifact, digest=bad)
    with pytest.raises(ArtifactError, match="leave verify on"):
        load_compiled(artifact, digest=digest, verify=False)


def test_a_listed_file_no_load_reads_is_refused_before_hashing(artifact):
    (artifact / "extra.bin").write_bytes(b"x" * 1000)
    rehash(artifact, "extra.bin")  # listed with its true size and hashes, as a tamperer could
    with pytest.raises(ArtifactError, match=r"lists files no load reads \(extra.bin\)"):
        load_compiled(artifact)


def test_an_artifact_saves_into_a_folder_reached_through_a_link(saved, tmp_path):
    """0.16 refused a user's own linked working folder ("cannot open the lock file ... remove it if
    it is a link"); the artifact path itself being a link is still refused."""
    ct = load_compiled(saved[0])
    kw, want = saved[1], saved[3]
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "work").symlink_to(real)
    path = save_compiled(ct, tmp_path / "work" / "linked.art")
    assert (real / "linked.art" / "manifest.json").is_file()
    assert torch.equal(load_compiled(path)(**kw, return_dict=False)[0], want)
    save_compiled(ct, tmp_path / "work" / "linked.art")  # replaced in place, through the link
    (tmp_path / "art-link").symlink_to(real / "linked.art")
    with pytest.raises(ArtifactError, match="is a symbolic link"):
        save_compiled(ct, tmp_path / "art-link")


def test_a_load_reads_each_byte_once_and_checks_it(artifact, monkeypatch):
    """The weights are hashed as they are read (one pass): the bytes read by a load are the
    artifact's size, not twice it, and a flipped byte is still found."""
    from prx_compile.io import artifact as artifact_module
    from prx_compile.io import fast_read

    read = [0]
    preadv, pread = os.preadv, os.pread

    def counting_preadv(fd, bufs, offset):
        n = preadv(fd, bufs, offset)
        read[0] += n
        return n

    def counting_pread(fd, n, offset):
        data = pread(fd, n, offset)
        read[0] += len(data)
        return data

    monkeypatch.setattr(fast_read.os, "preadv", counting_preadv)
    monkeypatch.setattr(artifact_module.os, "pread", counting_pread)
    load_compiled(artifact)
    files = sum(e["bytes"] for e in manifest(artifact)["files"].values())
    headers = sum(
        8 + int.from_bytes((artifact / rel).read_bytes()[:8], "little")
        for rel in manifest(artifact)["files"]
        if rel.endswith(".safetensors")
    )
    assert files <= read[0] <= files + headers + (1 << 16)  # the headers are parsed before the read


def test_a_corrupted_file_is_found_however_it_is_read(artifact, tmp_path):
    """Reader.verify_when_read: read_bytes and read_tensors refuse a damaged file; a file never read
    is never hashed."""
    from prx_compile.io import artifact as artifact_module

    copy = tmp_path / "copy"
    shutil.copytree(artifact, copy)
    flip_byte(copy / WEIGHTS)
    reader = artifact_module.open_artifact(copy, kind="artifact", verify=True, when_read=True)
    assert reader.unverified == set(manifest(copy)["files"])
    with pytest.raises(ArtifactError, match="weights.safetensors does not match its crc32"):
        reader.read_tensors(WEIGHTS)
    with pytest.raises(ArtifactError, match="weights.safetensors does not match its crc32"):
        reader.read_bytes(WEIGHTS)
    other = next(rel for rel in reader.files if rel != WEIGHTS)
    reader.read_bytes(other)
    assert other not in reader.unverified and WEIGHTS in reader.unverified
    with pytest.raises(ArtifactError, match="does not match its sha256"):
        reader.verify()  # what was never read is checked now


def artifact_digest_unverified(path) -> str:
    """The digest ``artifact_digest`` prints (the manifest's sha256), without verifying the files."""
    import hashlib

    return "sha256:" + hashlib.sha256((path / MANIFEST).read_bytes()).hexdigest()


def test_a_load_checks_crc32_and_a_pinned_load_sha256(artifact, saved):
    """Without a digest a load checks the cheap crc32 (corruption and truncation); with one, the
    sha256 the digest pins; inspect checks both. An artifact of 0.25 (format 2, sha256 only) loads,
    checked against its sha256."""
    _, kw, _, out, _ = saved
    m = manifest(artifact)
    good = m["files"][WEIGHTS]["crc32"]
    m["files"][WEIGHTS]["crc32"] = ["0" * 8] * len(good)  # the crc32 alone wrong
    write_manifest(artifact, m)
    with pytest.raises(ArtifactError, match="weights.safetensors does not match its crc32"):
        load_compiled(artifact)
    pinned = load_compiled(artifact, digest=artifact_digest_unverified(artifact))  # by sha256 alone
    assert torch.equal(pinned(**kw, return_dict=False)[0], out)
    with pytest.raises(ArtifactError, match="weights.safetensors does not match its crc32"):
        inspect_artifact(artifact)  # inspect (and artifact_digest) check both: no digest of a bad list
    m["files"][WEIGHTS]["crc32"] = ["0" * 8] * (len(good) + 1)
    write_manifest(artifact, m)
    with pytest.raises(ArtifactError, match="sha256 and crc32 \\(one per 64 MiB\\)"):
        load_compiled(artifact)
    m["files"][WEIGHTS]["crc32"] = good
    sha = m["files"][WEIGHTS]["sha256"]
    m["files"][WEIGHTS]["sha256"] = ["0" * 64] * len(sha)  # now the sha256 alone wrong
    write_manifest(artifact, m)
    assert torch.equal(load_compiled(artifact)(**kw, return_dict=False)[0], out)  # crc32 checked
    with pytest.raises(ArtifactError, match="weights.safetensors does not match its sha256"):
        load_compiled(artifact, digest=artifact_digest_unverified(artifact))
    with pytest.raises(ArtifactError, match="weights.safetensors does not match its sha256"):
        inspect_artifact(artifact)
    m["files"][WEIGHTS]["sha256"] = sha
    m["format_version"] = 2  # as 0.25 wrote them: sha256 only
    for entry in m["files"].values():
        entry.pop("crc32", None)
    write_manifest(artifact, m)
    assert torch.equal(load_compiled(artifact)(**kw, return_dict=False)[0], out)
    flip_byte(artifact / WEIGHTS)
    with pytest.raises(ArtifactError, match="weights.safetensors does not match its sha256"):
        load_compiled(artifact)


def test_a_damaged_header_is_named_as_damaged(artifact):
    """A flipped byte in the weights' header fails safetensors' parse before any checksum is
    computed; the file is then checked, and the error says it does not match its crc32."""
    data = bytearray((artifact / WEIGHTS).read_bytes())
    data[9] ^= 0x40  # inside the JSON header: '{' no longer opens it
    (artifact / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="weights.safetensors does not match its crc32"):
        load_compiled(artifact)
    with pytest.raises(ArtifactError, match="weights.safetensors is not a readable safetensors file"):
        load_compiled(artifact, verify=False)


@pytest.mark.parametrize("fn", [load_compiled, inspect_artifact])
def test_a_path_too_long_to_examine_is_an_artifact_error(fn):
    """0.31 let the OSError of ``Path.is_dir`` through (a name over 255 bytes)."""
    with pytest.raises(ArtifactError, match="cannot be examined"):
        fn("a" * 5000)


def test_weights_larger_than_the_free_memory_are_refused_before_they_are_made(artifact, monkeypatch):
    """An artifact's tensors are allocated before their bytes are checked: a file of 128 GiB with 2
    GiB on disk passes the sparse check and would take the host's memory. Refused first, in one line."""
    from prx_compile.io import artifact as artifact_module

    monkeypatch.setattr(artifact_module, "available_bytes", lambda device: 1024)
    with pytest.raises(
        ArtifactError, match=r"weights\.safetensors holds .* GiB, more than the 0\.0 GiB free"
    ):
        load_compiled(artifact)
