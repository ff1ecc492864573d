"""io.fast_read: a safetensors file read into tensors by offsets (the GPU's copy path is in
tests/gpu/test_refit_and_artifacts.py), against safetensors' own reader, and headers that lie."""

import contextlib
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


def _hashes(path, chunk: int, kind: str = "sha256") -> list[str]:
    import hashlib
    import zlib

    data = path.read_bytes()
    one = {"sha256": lambda b: hashlib.sha256(b).hexdigest(), "crc32": lambda b: f"{zlib.crc32(b):08x}"}[kind]
    return [one(data[o : o + chunk]) for o in range(0, max(len(data), 1), chunk)]


@pytest.mark.parametrize("kind", fast_read.SUMS)
@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_each_chunk_is_checked_against_its_checksum_as_it_is_read(tmp_path, monkeypatch, chunk, kind):
    """The bytes read are the bytes hashed (sha256 or crc32, as hashlib and zlib compute them):
    matching checksums give safetensors' tensors; a byte flipped in the header, the first tensor or
    the last gives an ArtifactError and no tensors."""
    monkeypatch.setattr(fast_read, "CHUNK", chunk)
    path = tmp_path / "t.safetensors"
    save_file(_tensors(), path, metadata={"k": "v"})
    hashes = _hashes(path, chunk, kind)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = fast_read.read_to(fd, torch.device("cpu"), hashes, kind)
    finally:
        os.close(fd)
    want = load_file(path)
    assert all(
        torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
        for k, v in want.items()
    )
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    for at in (data.index(b'"v"') + 1, 8 + n + 1, len(data) - 1):  # metadata, a tensor's bytes, the last
        bad = bytearray(data)
        bad[at] ^= 0x01
        path.write_bytes(bytes(bad))
        fd = os.open(path, os.O_RDONLY)
        try:
            with pytest.raises(fast_read.HashMismatch, match=f"does not match its {kind} at bytes"):
                fast_read.read_to(fd, torch.device("cpu"), hashes, kind)
        finally:
            os.close(fd)
    with pytest.raises(ArtifactError, match="checksums for a file of"):
        path.write_bytes(data)
        fd = os.open(path, os.O_RDONLY)
        try:
            fast_read.read_to(fd, torch.device("cpu"), hashes[:-1] or ["0" * 64] * 2)
        finally:
            os.close(fd)


def test_more_tensors_in_a_chunk_than_one_preadv_takes(tmp_path, monkeypatch):
    """Each tensor is its own buffer on a CPU: a chunk of 3000 tiny tensors is read in several calls."""
    tensors = {f"t{i:04d}": torch.full((1,), float(i)) for i in range(3000)}
    path = tmp_path / "many.safetensors"
    save_file(tensors, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = fast_read.read_to(fd, torch.device("cpu"), _hashes(path, fast_read.CHUNK))
    finally:
        os.close(fd)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


def test_the_header_returned_is_the_header_checked(tmp_path, monkeypatch):
    """The names, shapes and metadata come from the header parsed before the read; the bytes read
    (and hashed) with the first chunk must be that header, or the file changed in between."""
    path = tmp_path / "t.safetensors"
    save_file(_tensors(), path, metadata={"k": "v"})
    fd = os.open(path, os.O_RDONLY)
    try:
        tensors, metadata = fast_read.read_file(fd, torch.device("cpu"), _hashes(path, fast_read.CHUNK))
        assert metadata == {"k": "v"} and tensors.keys() == _tensors().keys()
        parsed = fast_read.layout(fd)
        forged = parsed._replace(head=parsed.head.replace(b'"v"', b'"w"'))  # as if parsed before a change
        monkeypatch.setattr(fast_read, "layout", lambda fd: forged)
        with pytest.raises(fast_read.HashMismatch, match="changed while it was read"):
            fast_read.read_file(fd, torch.device("cpu"))
    finally:
        os.close(fd)


def test_metadata_that_is_not_strings_is_refused(tmp_path):
    path = _file(tmp_path, {"__metadata__": {"k": 1}, "x": _WHOLE})
    with pytest.raises(ArtifactError, match="__metadata__ is not strings"):
        _read(path)


@pytest.mark.parametrize("kind", fast_read.SUMS)
def test_a_group_of_chunks_read_into_one_buffer_is_hashed_chunk_by_chunk(tmp_path, monkeypatch, kind):
    """The GPU path's read (``_fill`` into a host buffer, several chunks at once; its copies are in
    the GPU tests): each chunk's checksum is the one listed for it, the header's bytes come back, and
    the buffer holds the file's bytes in order."""
    monkeypatch.setattr(fast_read, "CHUNK", 64)
    path = tmp_path / "t.safetensors"
    save_file(_tensors(), path, metadata={"k": "v"})
    data, hashes = path.read_bytes(), _hashes(path, 64, kind)
    fd = os.open(path, os.O_RDONLY)
    try:
        found = fast_read.layout(fd)
        segments = [(0, found.start, None)] + sorted(
            (found.start + b, found.start + e, torch.empty(e - b, dtype=torch.uint8))
            for _, _, b, e in found.entries.values()
            if e > b
        )
        chunks = fast_read._chunks(segments, found.size)
        for first in (0, len(chunks) - 4):  # the group holding the header, and the last
            buf = torch.zeros(64 * 4, dtype=torch.uint8)
            got = fast_read._fill(fd, chunks[first : first + 4], buf.numpy(), kind)
            assert [digest for digest, _ in got] == hashes[first : first + 4]
            want = data[64 * first : 64 * (first + 4)]
            assert bytes(buf.numpy()[: len(want)]) == want
            assert b"".join(head for _, head in got) == found.head[64 * first :][: 64 * 4]
    finally:
        os.close(fd)


class _HostStream:
    """A CUDA stream's part in ``_copy_through`` played on the host, where copies run as issued."""

    def __init__(self, device=None):
        pass

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _counted(calls: list):
    """``fast_read._pread_into`` that records each call."""
    read = fast_read._pread_into

    def pread_into(fd, views, offset):
        calls.append(offset)
        read(fd, views, offset)

    return pread_into


@pytest.mark.parametrize("group, workers", [(1, 1), (2, 3), (4, 8)])
def test_the_gpu_paths_threads_each_take_every_kth_group_and_stop_at_a_mismatch(
    tmp_path, monkeypatch, group, workers
):
    """``_copy_through``'s threads, with host buffers and host destinations (its streams stand in
    for CUDA's: copies run as issued): the destinations get the file's bytes, the header's bytes
    come back in file order, and a flipped byte is a HashMismatch naming its chunk."""
    monkeypatch.setattr(fast_read, "CHUNK", 64)
    monkeypatch.setattr(torch.cuda, "Stream", _HostStream)
    monkeypatch.setattr(torch.cuda, "current_stream", _HostStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    path = tmp_path / "t.safetensors"
    save_file(_tensors(), path, metadata={"k": "v"})
    data, hashes = path.read_bytes(), _hashes(path, 64)
    for flip in (None, len(data) - 1):
        if flip is not None:
            bad = bytearray(data)
            bad[flip] ^= 1
            path.write_bytes(bytes(bad))
        fd = os.open(path, os.O_RDONLY)
        try:
            found = fast_read.layout(fd)
            spans = {n: (found.start + b, found.start + e) for n, (_, _, b, e) in found.entries.items()}
            out = {n: torch.zeros(e - b, dtype=torch.uint8) for n, (b, e) in spans.items()}
            segments = [(0, found.start, None)] + sorted(
                (b, e, out[n]) for n, (b, e) in spans.items() if e > b
            )
            chunks = fast_read._chunks(segments, found.size)
            groups = [chunks[j : j + group] for j in range(0, len(chunks), group)]
            bufs = [torch.empty(64 * group, dtype=torch.uint8) for _ in range(min(workers, len(groups)))]
            reads, at_ready = [], []
            monkeypatch.setattr(fast_read, "_pread_into", _counted(reads))
            args = (
                fd,
                groups,
                bufs,
                torch.device("cpu"),
                hashes,
                "sha256",
                lambda r=reads, a=at_ready: a.append(len(r)),
            )
            if flip is None:
                assert b"".join(fast_read._copy_through(*args)) == found.head
                assert at_ready == [0] and len(reads) == len(groups)  # ready once, before any read
                assert all(bytes(out[n].numpy()) == data[b:e] for n, (b, e) in spans.items())
            else:
                last = (len(data) - 1) // 64 * 64
                with pytest.raises(fast_read.HashMismatch, match=f"at bytes {last}-{len(data)}"):
                    fast_read._copy_through(*args)
        finally:
            os.close(fd)


class _Interrupted(Exception):
    """What the test's alarm raises in the calling thread (KeyboardInterrupt would stop pytest)."""


def test_an_interrupt_of_the_gpu_path_stops_its_threads(tmp_path, monkeypatch):
    """An exception in the calling thread while the threads read (Ctrl-C) stops them after their
    group in flight, instead of waiting for the whole file (the first version read all 64 groups)."""
    import signal
    import time

    monkeypatch.setattr(fast_read, "CHUNK", 64)
    monkeypatch.setattr(torch.cuda, "Stream", _HostStream)
    monkeypatch.setattr(torch.cuda, "current_stream", _HostStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    reads = []
    slow = _counted(reads)
    monkeypatch.setattr(fast_read, "_pread_into", lambda *a: (time.sleep(0.05), slow(*a)))
    path = tmp_path / "t.safetensors"
    save_file({"x": torch.arange(64 * 63, dtype=torch.uint8)}, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        found = fast_read.layout(fd)
        (_, _, b, e) = found.entries["x"]
        out = torch.zeros(e - b, dtype=torch.uint8)
        chunks = fast_read._chunks(
            [(0, found.start, None), (found.start + b, found.start + e, out)], found.size
        )
        bufs = [torch.empty(64, dtype=torch.uint8) for _ in range(2)]

        def alarm(signum, frame):
            raise _Interrupted

        old = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        try:
            with pytest.raises(_Interrupted):
                fast_read._copy_through(
                    fd, [[c] for c in chunks], bufs, torch.device("cpu"), None, None, None
                )
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        assert len(chunks) >= 64 and len(reads) < 20  # each thread stopped after its group in flight
    finally:
        os.close(fd)
