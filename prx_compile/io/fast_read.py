"""A safetensors file read straight onto a GPU: parallel ``pread``s into pinned buffers, each copied
to its tensor on a side stream while the next is read.

    tensors = read_to(fd, torch.device("cuda"))   # None: a dtype this reader does not know

safetensors' ``load_file(device="cuda")`` copies tensor by tensor from a memory map through pageable
memory, on one thread. Here ``WORKERS`` threads read ``CHUNK`` bytes each (``os.preadv`` releases the
GIL) while the GPU copies the previous chunks: FLUX.1's 24 GB arrive in 1.6-2.0 s on the H200, and
its ``load_compiled`` takes 6.0-7.2 s instead of 8.6-10.0 (``flux_v25_load_h200.json``). On a CPU the
tensors are the buffers: private memory, not a map of the file.

The header is checked before anything is allocated, as safetensors checks it: every dimension and
offset an int, every tensor's bytes matching its dtype and shape, the tensors tiling the data with no
overlap and no gap, so what is allocated is the file's size. The caller has the file checked by
safetensors first (``safe_open``) and against its sha256 (``Reader.verify``).
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import ArtifactError

#: bytes per read and copy, and how many are in flight (pinned host memory: CHUNK * WORKERS)
CHUNK = 32 << 20
WORKERS = 8
#: safetensors' own bound on a header; the most dimensions a tensor may have
MAX_DIMS = 64
MAX_HEADER = 100_000_000

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


def layout(fd: int) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], int] | None:
    """({name: (dtype, shape, begin, end)}, where the data starts) of the safetensors file ``fd``,
    each tensor's bytes at [start + begin, start + end); None when a dtype is not in ``_DTYPES``. An
    ArtifactError when the header does not describe the file."""
    size = os.fstat(fd).st_size
    n = int.from_bytes(os.pread(fd, 8, 0), "little") if size >= 8 else -1
    if not 0 < n <= min(MAX_HEADER, size - 8):
        raise ArtifactError(f"a safetensors header of {n} bytes in a file of {size}.")
    try:
        header = json.loads(os.pread(fd, n, 8))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ArtifactError(f"a safetensors header that is not JSON ({str(e)[:80]}).") from e
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
    return out, start


def _ints(v, most: int) -> bool:
    """A list of at most ``most`` ints in [0, 2**62)."""
    return isinstance(v, list) and len(v) <= most and all(type(x) is int and 0 <= x < 1 << 62 for x in v)


def read_to(fd: int, device: torch.device) -> dict[str, torch.Tensor] | None:
    """Every tensor of the safetensors file ``fd``, on ``device``; None when ``layout`` is None or no
    host memory could be pinned (the caller reads the file its own way)."""
    found = layout(fd) if device.type in ("cpu", "cuda") else None
    if found is None:
        return None
    entries, start = found
    out, chunks = {}, []
    for name, (dtype, shape, begin, end) in entries.items():
        out[name] = t = torch.empty(shape, dtype=dtype, device=device)
        flat = t.view(-1).view(torch.uint8)
        chunks += [(flat[o : o + CHUNK], start + begin + o) for o in range(0, end - begin, CHUNK)]
    if not chunks:
        return out
    if device.type == "cpu":
        for dst, offset in chunks:  # a CPU tensor is the buffer itself
            _pread_into(fd, dst.numpy(), offset)
        return out
    try:
        bufs = [
            torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(min(WORKERS, len(chunks)))
        ]
    except RuntimeError:
        return None
    _copy_through(fd, chunks, bufs, device)
    return out


def _copy_through(fd: int, chunks: list, bufs: list[torch.Tensor], device: torch.device) -> None:
    """Read each chunk into a pinned buffer (a thread per buffer), copy it to its device bytes on a
    side stream, and read the next chunk into that buffer once its copy has run."""
    k, stream = len(bufs), torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the tensors' memory is free there first
    copied: list[torch.cuda.Event | None] = [None] * k  # buffer i may be refilled after this event

    def fill(j: int) -> int:
        i = j % k
        if copied[i] is not None:
            copied[i].synchronize()
        dst, offset = chunks[j]
        _pread_into(fd, bufs[i].numpy()[: dst.numel()], offset)
        return i

    try:
        with ThreadPoolExecutor(max_workers=k) as pool:
            pending = [pool.submit(fill, j) for j in range(k)]
            for j, (dst, _) in enumerate(chunks):
                i = pending[j].result()
                with torch.cuda.stream(stream):
                    dst.copy_(bufs[i][: dst.numel()], non_blocking=True)
                    copied[i] = stream.record_event()
                if j + k < len(chunks):
                    pending.append(pool.submit(fill, j + k))
    finally:
        stream.synchronize()


def _pread_into(fd: int, buf, offset: int) -> None:
    """Fill the writable buffer ``buf`` with the file's bytes from ``offset``."""
    view, got = memoryview(buf).cast("B"), 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise ArtifactError("a safetensors file ended before its tensors (changed while read?).")
        got += n
