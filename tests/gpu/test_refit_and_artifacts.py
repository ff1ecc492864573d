"""LoRA (in place with weights: inputs, refit with weights: engine) and save/load, on the GPU."""

import subprocess
import sys
import time

import pytest
import torch

from prx_compile import (
    ArtifactError,
    compile_prx,
    load_compiled,
    load_lora,
    save_compiled,
    set_lora,
    unload_lora,
)
from prx_compile.lora import make_random_lora
from prx_compile.tools.bench import rel_err
from prx_compile.tools.testing import make_prx

from .conftest import RANGE, SMALL_PRX
from .test_tensorrt import eager, inputs

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["inputs", "engine"])
def compiled(request):
    model = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    ct = compile_prx(model, weights=request.param, static=True, specialize=[[512, 512, 2]], **RANGE)
    return model, ct.build()


def test_lora_switches_exactly_without_rebuild(compiled):
    model, ct = compiled
    kw = inputs(model)
    base = ct(**kw, return_dict=False)[0].clone()
    a, b = make_random_lora(model, 16, seed=1, std=0.05), make_random_lora(model, 16, seed=2, std=0.05)
    t0 = time.perf_counter()
    rep = load_lora(ct, a, "a")
    load_s = time.perf_counter() - t0
    out_a = ct(**kw, return_dict=False)[0].clone()
    assert rel_err(out_a, eager(model, kw)) < 2e-2 and rel_err(out_a, base) > 1e-2
    load_lora(ct, b, "b")
    set_lora(ct, "b")
    set_lora(ct, "a")
    assert torch.equal(ct(**kw, return_dict=False)[0], out_a)
    unload_lora(ct)
    assert torch.equal(ct(**kw, return_dict=False)[0], base)
    assert ct.builds == 1
    if ct.compile_config.weights == "inputs":
        assert rep["refit"]["engines_refit"] == 0 and load_s < 1.0, (rep, load_s)
    else:
        assert rep["refit"]["engines_refit"] > 0


def test_save_load_roundtrip_and_tamper(compiled, tmp_path):
    model, ct = compiled
    kw = inputs(model)
    load_lora(ct, make_random_lora(model, 8, seed=3, std=0.05), "c", 0.5)
    expected = ct(**kw, return_dict=False)[0].clone()
    save_compiled(ct, tmp_path / "art")
    loaded = load_compiled(tmp_path / "art")
    assert torch.equal(loaded(**kw, return_dict=False)[0], expected)
    assert loaded.report()["engines"] == SMALL_PRX["depth"] + 1
    unload_lora(loaded)
    unload_lora(ct)
    assert torch.equal(loaded(**kw, return_dict=False)[0], ct(**kw, return_dict=False)[0])
    engine = next((tmp_path / "art" / "sets" / "0").glob("*.engine"))
    data = bytearray(engine.read_bytes())
    data[len(data) // 2] ^= 0xFF
    engine.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="does not match its (crc32|sha256)"):
        load_compiled(tmp_path / "art")


def test_engine_cache_hit_follows_the_live_weights(tmp_path):
    model = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    cfg = dict(static=True, specialize=[[512, 512, 2]], engine_cache_dir=str(tmp_path / "cache"), **RANGE)
    kw = inputs(model)
    first = compile_prx(model, **cfg)
    base = first(**kw, return_dict=False)[0].clone()
    second = compile_prx(model, **cfg)
    assert torch.equal(second(**kw, return_dict=False)[0], base)
    assert second.cache_hits[0]["load_s"] is not None and second.builds == 0
    load_lora(second, make_random_lora(model, 16, seed=4, std=0.1), "d")
    assert rel_err(second(**kw, return_dict=False)[0], eager(model, kw)) < 2e-2
    assert rel_err(second(**kw, return_dict=False)[0], base) > 1e-2


def test_an_edited_setting_is_another_engine_cache_entry(tmp_path):
    """A norm's eps is a constant of the engines: a model with another one must not load the plain
    model's engines (0.31's key held the config only)."""
    cfg = dict(static=True, specialize=[[512, 512, 2]], engine_cache_dir=str(tmp_path / "cache"), **RANGE)
    plain = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    kw = inputs(plain)
    compile_prx(plain, **cfg)(**kw, return_dict=False)
    edited = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    edited.final_layer.norm_final.eps = 0.5
    ct = compile_prx(edited, **cfg)
    out = ct(**kw, return_dict=False)[0]
    assert ct.cache_hits[0]["load_s"] is None  # built, not the plain model's entry
    assert rel_err(out, eager(edited, kw)) < 2e-2
    assert rel_err(eager(edited, kw), eager(plain, kw)) > 1e-2  # the edit shows in the output


def test_a_loaded_artifact_deserialises_each_engine_set_at_its_first_call(tmp_path):
    model = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    ct = compile_prx(model, specialize=[[512, 512, 2]], **RANGE).build()  # a static set and the range
    kw_static, kw_range = inputs(model), inputs(model, batch=1, seed=5)  # batch 1: only the range fits
    want = [ct(**kw, return_dict=False)[0].clone() for kw in (kw_static, kw_range)]
    save_compiled(ct, tmp_path / "a")
    loaded = load_compiled(tmp_path / "a")
    assert [b.is_loaded for b in loaded.backends] == [False, False]
    assert loaded.report()["engines"] == ct.report()["engines"]  # counted without deserialising
    assert torch.equal(loaded(**kw_static, return_dict=False)[0], want[0])
    assert [b.is_loaded for b in loaded.backends] == [True, False]
    live = next(iter(loaded.backends[0].engines.values()))
    assert live.context is not None and live.runtime_cache_bytes() is not None  # one context, its cache
    save_compiled(loaded, tmp_path / "b")  # a set never run is saved from the bytes it was read from
    again = load_compiled(tmp_path / "b").build()
    assert all(b.is_loaded for b in again.backends)
    for kw, w in zip((kw_static, kw_range), want, strict=True):
        assert torch.equal(again(**kw, return_dict=False)[0], w)
    assert again.builds == 0 and loaded.builds == 0


LOAD_IN_A_NEW_PROCESS = """
import sys, torch
import prx_compile
ct = prx_compile.load_compiled(sys.argv[1])
kw = torch.load(sys.argv[2])
out = ct(**kw, return_dict=False)[0]
torch.save(out.cpu(), sys.argv[3])
print("torch_tensorrt imported:", "torch_tensorrt" in sys.modules)
"""


def test_a_new_process_runs_a_loaded_artifact_without_importing_torch_tensorrt(tmp_path):
    model = make_prx(SMALL_PRX, dtype=torch.bfloat16, device="cuda")
    ct = compile_prx(model, static=True, specialize=[[512, 512, 2]], **RANGE).build()
    kw = inputs(model)
    want = ct(**kw, return_dict=False)[0].cpu()
    save_compiled(ct, tmp_path / "art")
    torch.save(kw, tmp_path / "kw.pt")
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            LOAD_IN_A_NEW_PROCESS,
            str(tmp_path / "art"),
            str(tmp_path / "kw.pt"),
            str(tmp_path / "out.pt"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "torch_tensorrt imported: False" in run.stdout
    assert torch.equal(torch.load(tmp_path / "out.pt"), want)


@pytest.mark.parametrize("chunk", [4096, 1 << 20])
def test_fast_read_copies_through_pinned_buffers_as_safetensors_reads(tmp_path, monkeypatch, chunk):
    """io.fast_read's GPU path: reads in threads into three pinned buffers, reused for chunks across
    tensor boundaries, each hashed and copied on a side stream: the bytes safetensors reads; a byte
    flipped anywhere is found."""
    import hashlib
    import os

    from safetensors.torch import load_file, save_file

    from prx_compile.io import fast_read

    monkeypatch.setattr(fast_read, "CHUNK", chunk)
    monkeypatch.setattr(fast_read, "WORKERS", 3)
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(97 + 31 * i, 63, generator=g).bfloat16() for i in range(12)}
    tensors["scale"] = torch.tensor(2.0)
    path = tmp_path / "w.safetensors"
    save_file(tensors, path)
    data = path.read_bytes()
    hashes = [hashlib.sha256(data[o : o + chunk]).hexdigest() for o in range(0, len(data), chunk)]

    def read():
        fd = os.open(path, os.O_RDONLY)
        try:
            return fast_read.read_to(fd, torch.device("cuda"), hashes)
        finally:
            os.close(fd)

    got = read()
    want = load_file(path, device="cuda")
    assert got.keys() == want.keys()
    assert all(got[k].is_cuda and torch.equal(got[k], want[k]) for k in want)
    bad = bytearray(data)
    bad[len(data) * 2 // 3] ^= 0x01
    path.write_bytes(bytes(bad))
    with pytest.raises(fast_read.HashMismatch):
        read()
