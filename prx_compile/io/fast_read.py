"""A safetensors file read straight onto a GPU and checked against its checksums in the same pass:
parallel ``pread``s into pinned buffers, each hashed by the thread that read it and copied to its
tensors on a side stream while the next is read.

    tensors, metadata = read_file(fd, torch.device("cuda"), crc32s, "crc32")  # None: not read here

safetensors' ``load_file(device="cuda")`` copies tensor by tensor from a memory map through pageable
memory, on one thread (and 0.25 hashed the artifact's files in a pass of their own before it). Here
``WORKERS`` threads each read ``GROUP`` chunks of ``CHUNK`` bytes of the file at a time (``os.preadv``
and hashlib release the GIL), hash each chunk and copy the group to its tensors on their own stream,
while the others read. ``CHUNK`` is the artifact format's hash unit (the manifest lists a sha256 and
a crc32 per 64 MiB), so no byte is read twice. The read makes few calls per byte, because a loader
imports beside it (``_copy_through``). On a CPU the tensors are the buffers: private memory, not a
map of the file.

The header is checked before anything is allocated, as safetensors checks it: every dimension and
offset an int, every tensor's bytes matching its dtype and shape, the tensors tiling the data with no
overlap and no gap, so what is allocated is the file's size. The caller has the header parsed by
safetensors first (``safe_open``); a chunk that does not match its checksum is an ArtifactError
before any tensor is returned.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from ..errors import ArtifactError

#: the artifact format's hash unit; a GPU read takes GROUP of them at once (a thread per pinned buffer
#: of GROUP * CHUNK bytes, WORKERS of them in flight: 1 GiB of pinned host memory, which PyTorch's
#: pinned-memory cache keeps for the process after the read; GROUP 2 is what was measured,
#: flux_v29_load_gil_h200.json)
CHUNK = 64 << 20
GROUP = 2
WORKERS = 8
#: safetensors' own bound on a header; the most dimensions a tensor may have
MAX_DIMS = 64
MAX_HEADER = 100_000_000
#: the most buffers one ``preadv`` takes (Linux's IOV_MAX)
IOV_MAX = 1024


class HashMismatch(ArtifactError):
    """Bytes read that do not match the checksum listed for them."""


#: the checksums a manifest lists per CHUNK: sha256 (what a published digest pins) and crc32
#: (corruption and truncation only; 1.93 against 1.14 GB/s a thread on the H200's host)
SUMS = ("sha256", "crc32")


class _Crc32:
    """zlib's crc32 with hashlib's ``update`` / ``hexdigest`` (8 hex digits)."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)  # zlib leaves the GIL to the others too

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def new_sum(kind: str):
    """A running checksum of ``kind`` (one of ``SUMS``)."""
    return hashlib.sha256() if kind == "sha256" else _Crc32()


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class Layout(NamedTuple):
    """A safetensors file as its header describes it."""

    entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]  # name -> (dtype, shape, begin, end)
    start: int  # where the data starts: each tensor's bytes are [start + begin, start + end)
    size: int  # the file's bytes, as the header accounts for them
    head: bytes  # the file's first ``start`` bytes, as they were parsed
    metadata: dict[str, str]  # the header's ``__metadata__``


def layout(fd: int) -> Layout | None:
    """The layout of the safetensors file ``fd``; None when a dtype is not in ``_DTYPES``. An
    ArtifactError when the header does not describe the file."""
    size = os.fstat(fd).st_size
    n = int.from_bytes(os.pread(fd, 8, 0), "little") if size >= 8 else -1
    if not 0 < n <= min(MAX_HEADER, size - 8):
        raise ArtifactError(f"a safetensors header of {n} bytes in a file of {size}.")
    raw = os.pread(fd, n, 8)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ArtifactError(f"a safetensors header that is not JSON ({str(e)[:80]}).") from e
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise ArtifactError("a safetensors header whose __metadata__ is not strings.")
    start, out = 8 + n, {}
    for name, e in header.items() if isinstance(header, dict) else ():
        if name == "__metadata__":
            continue
        if not isinstance(e, dict) or not isinstance(e.get("dtype"), str):
            raise ArtifactError(f"safetensors entry {name[:80]!r} is malformed.")
        dtype = _DTYPES.get(e["dtype"])
        if dtype is None:
            return None  # safetensors' own reader takes it
        shape, offsets = e.get("shape"), e.get("data_offsets")
        if not (_ints(shape, MAX_DIMS) and _ints(offsets, 2) and len(offsets) == 2):
            raise ArtifactError(f"safetensors entry {name[:80]!r} is malformed.")
        begin, end = offsets
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ArtifactError(f"safetensors entry {name[:80]!r}: its bytes do not match its shape.")
        out[name] = (dtype, tuple(shape), begin, end)
    # as safetensors: the tensors tile the data exactly (no overlap, no gap), so what is allocated
    # is the file's size
    pos = 0
    for begin, end in sorted((b, e) for _, _, b, e in out.values()):
        if begin != pos:
            raise ArtifactError("safetensors tensors that overlap or leave gaps in the file.")
        pos = end
    if pos != size - start:
        raise ArtifactError(f"safetensors tensors that cover {pos} of the file's {size - start} data bytes.")
    return Layout(out, start, size, n.to_bytes(8, "little") + raw, metadata or {})


def _ints(v, most: int) -> bool:
    """A list of at most ``most`` ints in [0, 2**62)."""
    return isinstance(v, list) and len(v) <= most and all(type(x) is int and 0 <= x < 1 << 62 for x in v)


def read_to(
    fd: int, device: torch.device, hashes: list[str] | None = None, kind: str | None = "sha256"
) -> dict[str, torch.Tensor] | None:
    """``read_file``'s tensors."""
    found = read_file(fd, device, hashes, kind)
    return None if found is None else found[0]


def read_file(
    fd: int,
    device: torch.device,
    hashes: list[str] | None = None,
    kind: str | None = "sha256",
    ready: Callable[[], None] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """(every tensor of the safetensors file ``fd`` on ``device``, its header's metadata); None when
    ``layout`` is None or no host memory could be pinned (the caller reads the file its own way).

    The file is read in ``CHUNK``-byte pieces from its first byte. With ``hashes`` (the ``kind``
    checksum of each piece, as the artifact's manifest lists them) each piece is hashed by the
    thread that read it, and a piece that does not match is a HashMismatch before any tensor is
    returned: the file is read and checked in one pass. The header bytes read with the first
    pieces must be those ``layout`` parsed, so the names, shapes and metadata returned are the
    checked ones. ``ready()`` runs once every tensor is allocated and every copy planned, before
    the first byte of the tensors is read (the header was read to plan them; what a loader
    overlaps with the read starts there: see ``_copy_through``)."""
    found = layout(fd) if device.type in ("cpu", "cuda") else None
    if found is None:
        return None
    entries, start, size = found.entries, found.start, found.size
    if hashes is not None and len(hashes) != max(1, -(-size // CHUNK)):
        raise ArtifactError(f"{len(hashes)} checksums for a file of {size} bytes.")
    out = {
        name: torch.empty(shape, dtype=dtype, device=device) for name, (dtype, shape, _, _) in entries.items()
    }
    # the file in order: the header (read to be hashed and compared), then each tensor's bytes
    segments = [(0, start, None)] + sorted(
        (start + b, start + e, out[name].view(-1).view(torch.uint8))
        for name, (_, _, b, e) in entries.items()
        if e > b
    )
    chunks = _chunks(segments, size)
    kind = kind if hashes is not None else None  # nothing to check: nothing hashed
    head: list[bytes] = []
    if device.type == "cpu":  # the tensors are the buffers: each piece is read into its tensor
        if ready is not None:
            ready()
        with ThreadPoolExecutor(max_workers=min(WORKERS, len(chunks))) as pool:
            for j, [(digest, part)] in enumerate(pool.map(lambda c: _fill(fd, [c], None, kind), chunks)):
                _check(hashes, j, digest, chunks[j], kind)
                head.append(part)
    else:
        groups = [chunks[j : j + GROUP] for j in range(0, len(chunks), GROUP)]
        try:
            bufs = [
                torch.empty(CHUNK * GROUP, dtype=torch.uint8, pin_memory=True)
                for _ in range(min(WORKERS, len(groups)))
            ]
        except RuntimeError:
            return None
        head = _copy_through(fd, groups, bufs, device, hashes, kind, ready)
    if b"".join(head) != found.head:
        raise HashMismatch("changed while it was read (its header).")
    return out, found.metadata


def _chunks(segments: list, size: int) -> list[list[tuple[int, int, torch.Tensor | None]]]:
    """The file's CHUNKs, each as its pieces in order: (file offset, bytes, destination bytes or
    None), from ``segments`` (start, end, destination) sorted by offset and tiling the file."""
    chunks: list[list] = [[] for _ in range(-(-size // CHUNK))]
    for s, e, dst in segments:
        a = s
        while a < e:
            b = min(e, (a // CHUNK + 1) * CHUNK)
            chunks[a // CHUNK].append((a, b - a, None if dst is None else dst[a - s : b - s]))
            a = b
    return chunks


def _fill(fd: int, chunks: list, buf: np.ndarray | None, kind: str | None) -> list[tuple[str, bytes]]:
    """Read consecutive ``chunks`` (each its pieces) with one ``preadv``: into ``buf`` (a pinned
    buffer's bytes) if given, else each piece into its destination (the header into scratch
    memory). Returns, per chunk, the ``kind`` checksum of its bytes ("" for None; hashlib and zlib
    leave the GIL to the other threads) and the header's bytes among them."""
    pieces = [p for c in chunks for p in c]
    if buf is None:
        views = [bytearray(length) if dst is None else dst.numpy() for _, length, dst in pieces]
        _pread_into(fd, views, pieces[0][0])
    else:
        whole = buf[: sum(length for _, length, _ in pieces)]
        _pread_into(fd, [whole], pieces[0][0])
        ends = itertools.accumulate(length for _, length, _ in pieces)
        views = [whole[end - length : end] for (_, length, _), end in zip(pieces, ends, strict=True)]
    out, i, pos = [], 0, 0
    for c in chunks:
        mine, i = views[i : i + len(c)], i + len(c)
        n = sum(len(v) for v in mine)
        # the header's bytes (it comes first in the file, so first in its chunks)
        head = b"".join(bytes(v) for v, (_, _, dst) in zip(mine, c, strict=True) if dst is None)
        if kind is None:
            out.append(("", head))
        else:  # a chunk is one run of the buffer: one call
            h = new_sum(kind)
            for v in mine if buf is None else [whole[pos : pos + n]]:
                h.update(v)
            out.append((h.hexdigest(), head))
        pos += n
    return out


def _check(hashes: list[str] | None, j: int, digest: str, pieces: list, kind: str | None) -> None:
    """HashMismatch unless chunk ``j`` (its ``pieces``) hashed to ``hashes[j]``."""
    if hashes is not None and hashes[j] != digest:
        begin, end = pieces[0][0], pieces[-1][0] + pieces[-1][1]
        raise HashMismatch(f"does not match its {kind} at bytes {begin}-{end} (corrupted or replaced).")


def _copy_through(
    fd: int,
    groups: list,
    bufs: list[torch.Tensor],
    device: torch.device,
    hashes: list[str] | None,
    kind: str | None,
    ready: Callable[[], None] | None,
) -> list[bytes]:
    """Thread ``w`` of ``len(bufs)`` takes every ``len(bufs)``-th group of chunks: reads it into
    pinned buffer ``w``, checks each chunk against ``hashes``, copies the pieces to their device
    bytes on its own stream in one call, and reads its next group once those copies have run.
    Returns the header's bytes found in each chunk, in file order. A chunk that does not match
    stops every thread, and the HashMismatch of the lowest-numbered thread that found one is
    raised, after the copies issued have run; so is an exception in the calling thread (an
    interrupt), after each thread's group in flight.

    Few calls per byte, because a loader imports beside the read (``ready``): while another thread
    runs Python for seconds (FlashAttention-4's import), every call that lets go of the GIL (any
    tensor operation, a read, a hash) may wait a switch interval to get it back. 0.26 made about
    seven such calls per 64 MiB and one copy per tensor, and its read of FLUX.1's 23.8 GB took
    7.4-8.6 s beside the import against 3.1-4.1 s alone (``flux_v29_load_probes_h200.json``). Here
    every slice and stream is made before ``ready``, and a group costs one wait, one ``preadv``, a
    hash per chunk and one ``torch._foreach_copy_`` (private, and PyTorch's only call that copies
    a list of tensors: between devices it issues one asynchronous copy per piece, in C++, having
    let go of the GIL once)."""
    k, main = len(bufs), torch.cuda.current_stream(device)
    streams = [torch.cuda.Stream(device) for _ in range(k)]
    for stream in streams:
        stream.wait_stream(main)  # the tensors' memory is free there first
    hosts = [b.numpy() for b in bufs]
    plans = []  # per group: its destinations and the slices of its buffer they copy
    for g, group in enumerate(groups):
        dsts, srcs, at = [], [], 0
        for _, length, dst in (p for pieces in group for p in pieces):
            if dst is not None:
                dsts.append(dst)
                srcs.append(bufs[g % k][at : at + length])
            at += length
        plans.append((dsts, srcs))
    stop = threading.Event()
    if ready is not None:
        ready()

    def work(w: int) -> list[list[bytes]]:
        stream, heads = streams[w], []
        try:
            with torch.cuda.stream(stream):  # this thread's current stream, for every copy below
                for g in range(w, len(groups), k):
                    if stop.is_set():
                        break
                    stream.synchronize()  # buffer w's last copies have run
                    sums = _fill(fd, groups[g], hosts[w], kind)
                    for i, (pieces, (digest, _)) in enumerate(zip(groups[g], sums, strict=True)):
                        _check(hashes, g * len(groups[0]) + i, digest, pieces, kind)  # full groups first
                    dsts, srcs = plans[g]
                    if dsts:
                        torch._foreach_copy_(dsts, srcs, non_blocking=True)
                    heads.append([head for _, head in sums])
        except BaseException:
            stop.set()
            raise
        finally:
            stream.synchronize()
        return heads

    with ThreadPoolExecutor(max_workers=k) as pool:
        futures = [pool.submit(work, w) for w in range(k)]
        try:
            done = [f.result() for f in futures]
        except BaseException:  # a thread's HashMismatch, or an interrupt here: the others stop too
            stop.set()
            raise
    return [head for g in range(len(groups)) for head in done[g % k][g // k]]


def _pread_into(fd: int, views: list, offset: int) -> None:
    """Fill the writable buffers ``views``, one after another, with the file's bytes from ``offset``."""
    rest = [memoryview(v).cast("B") for v in views]
    while rest:
        n = os.preadv(fd, rest[:IOV_MAX], offset)
        if n <= 0:
            raise ArtifactError("a safetensors file ended before its tensors (changed while read?).")
        offset += n
        while rest and n >= len(rest[0]):
            n -= len(rest[0])
            rest.pop(0)
        if rest:
            rest[0] = rest[0][n:]
