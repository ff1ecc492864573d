"""io.fast_read: a safetensors file read into tensors by offsets (the GPU's copy path is in
tests/gpu/test_refit_and_artifacts.py), against safetensors' own reader, and headers that lie."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from prx_compile.errors import ArtifactError
from prx_compile.io import fast_read


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(37, 29, generator=g),
        "b": torch.randn(301, generator=g).bfloat16(),
        "h": torch.randn(5, 7, 3, generator=g).half(),
        "q": (torch.randn(64, 16, generator=g) * 10).to(torch.float8_e4m3fn),
        "i": torch.arange(-50, 50, dtype=torch.int64),
        "m": torch.rand(33, generator=g) > 0.5,
        "s": torch.tensor(3.5),
        "e": torch.empty(0, 4),
    }


def _read(path, device="cpu"):
    fd = os.open(path, os.O_RDONLY)
    try:
        return fast_read.read_to(fd, torch.device(device))
    finally:
        os.close(fd)


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_every_dtype_and_shape_reads_as_safetensors_does(tmp_path, monkeypatch, chunk):
    """Chunks of 7 bytes split every tensor at odd places; 1 MiB holds each whole."""
    monkeypatch.setattr(fast_read, "CHUNK", chunk)
    path = tmp_path / "t.safetensors"
    save_file(_tensors(), path, metadata={"k": "v"})
    got, want = _read(path), load_file(path)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k  # bytes


_WHOLE = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


def _file(tmp_path, header: dict, data: bytes = b"\0" * 16, n: int | None = None) -> str:
    raw = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes((len(raw) if n is None else n).to_bytes(8, "little") + raw + data)
    return path


@pytest.mark.parametrize(
    "header, n, match",
    [
        ({"x": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, None, "cover 32 of"),  # past end
        ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, None, "do not match"),  # size
        ({"x": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, None, "malformed"),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [12, 4]}}, None, "do not match"),
        ({"x": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}}, None, "malformed"),
        ({"x": {"dtype": "F32", "shape": [4.0], "data_offsets": [0, 16]}}, None, "malformed"),
        ({"x": {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 16]}}, None, "malformed"),
        ({"x": {"dtype": "F32", "shape": [2**70], "data_offsets": [0, 16]}}, None, "malformed"),
        ({"x": {"dtype": "F32", "shape": [1] * 65 + [4], "data_offsets": [0, 16]}}, None, "malformed"),
        ({"x": {"dtype": "F32", "shape": [4]}}, None, "malformed"),
        ({"x": {"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}}, None, "malformed"),
        ({"x": [1, 2]}, None, "malformed"),
        # every entry claiming the whole data: memory would be entries x file size
        ({f"x{i}": _WHOLE for i in range(3)}, None, "overlap"),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, None, "overlap or leave gaps"),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, None, "cover 8 of"),
        ({}, 1 << 40, "header of"),
        ({}, 0, "header of"),
    ],
)
def test_a_header_that_lies_is_one_artifact_error_before_anything_is_allocated(tmp_path, header, n, match):
    """Each as safetensors refuses it; the reader checks again (the file may change after that check)."""
    with pytest.raises(ArtifactError, match=match):
        _read(_file(tmp_path, header, n=n))


def test_a_header_that_is_not_json_is_an_artifact_error(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes((4).to_bytes(8, "little") + b"{{{{")
    with pytest.raises(ArtifactError, match="not JSON"):
        _read(path)


def test_a_dtype_it_does_not_know_leaves_the_file_to_safetensors(tmp_path):
    path = _file(tmp_path, {"x": {"dtype": "U16", "shape": [8], "data_offsets": [0, 16]}})
    assert _read(path) is None


def test_a_file_shorter_than_its_header_says_is_an_artifact_error(tmp_path, monkeypatch):
    """The header is checked against the file's size, but a file may shrink while it is read."""
    path = _file(tmp_path, {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})
    monkeypatch.setattr(fast_read.os, "preadv", lambda fd, bufs, offset: 0)
    with pytest.raises(ArtifactError, match="ended before"):
        _read(path)


def test_a_device_it_does_not_copy_to_leaves_the_file_to_safetensors(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"w": torch.ones(3)}, path)
    assert _read(path, "meta") is None
