"""The on-disk format: a directory of files listed, with their sizes and checksums, in ``manifest.json``.

It knows files, hashes, JSON and ``BackendState``s (JSON, bytes and tensors), nothing about what a
backend does with them. ``saving.py`` stores compiled transformers in it, ``cache.py`` engine sets.

Writing: every file goes into a fresh private sibling directory (``tempfile.mkdtemp``, created
exclusively), then the directory is swapped in. An artifact already at the path stays complete and
loadable until the new one is; a save that fails removes its directory, and leftovers of a killed
save are removed by the next save to that path (under a ``flock`` of the folder it is saved in).

Reading: only files the manifest lists are read, each by a name of ``[A-Za-z0-9_.-]`` parts opened
relative to the artifact directory with ``O_NOFOLLOW`` (no symbolic link, no ``..``, no absolute
path, never outside the directory), and checked against its size and checksums: a sha256 and a
crc32 per 64 MiB chunk. ``inspect`` checks both; a load pinned to a published digest checks the
sha256 (the digest is the manifest's sha256, so it pins them); a plain load checks the crc32 as it
reads (it finds corruption and truncation as the sha256 does, for less CPU time: 1.93 against 1.14
GB/s a thread on the H200's host, ``flux_v26_load_h200.json``). Every field read is validated;
anything unexpected is an ``ArtifactError`` naming it. Without a digest the checksums catch
corruption, not tampering: safety does not rest on them (see README, Security model).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import glob
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from .. import schema
from ..errors import ArtifactError, excerpt
from . import fast_read

logger = logging.getLogger(__name__)

FORMAT = "prx_compile-artifact"
FORMAT_VERSION = 3  # 3: a crc32 per chunk beside each sha256 (0.26)
READS = (2, 3)  # the versions this release loads
MANIFEST = "manifest.json"
CHUNK = fast_read.CHUNK  # the bytes each listed sha256 covers (64 MiB): also fast_read's read unit
MAX_MANIFEST_BYTES = 64 << 20
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,120}")
_HEX = re.compile(r"[0-9a-f]{64}")


def check_name(rel: Any) -> list[str]:
    """The parts of a file name inside an artifact; ArtifactError for anything but a/b/c of
    ``[A-Za-z0-9_.-]`` parts (no ``..``, no absolute path, at most 3 deep)."""
    parts = rel.split("/") if isinstance(rel, str) else []
    if not 1 <= len(parts) <= 3 or not all(_PART.fullmatch(p) and ".." not in p for p in parts):
        raise ArtifactError(f"file name {str(rel)[:100]!r} is not allowed in an artifact.")
    return parts


# -- locking -----------------------------------------------------------------------------------
@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``: a directory, the user's own folder, which may be reached
    through a symbolic link (it is opened read-only, nothing is created), or a lock file (created
    0600, never through a symbolic link)."""
    if path.is_dir():
        flags = os.O_RDONLY | os.O_DIRECTORY
    else:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise ArtifactError(
            f"cannot open the lock file {path} ({e.strerror}).", "remove it if it is a link."
        ) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# -- writing -----------------------------------------------------------------------------------
def umask() -> int:
    """The process's umask (read without changing it where Linux says it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: the usual set-and-restore
    os.umask(mask)
    return mask


#: the temporary file ``write_atomic`` fills for ``<name>`` (group 1), which a killed process leaves
ATOMIC_TEMPORARY = re.compile(r"\.(.+)\.[0-9a-f]{12}\.tmp")


def write_atomic(path: Path, write: Callable[[Any], None]) -> None:
    """Write ``path`` atomically: ``write(f)`` fills a new file beside it (created as ``open()`` would,
    the umask applied; never through a link; named as ``ATOMIC_TEMPORARY`` matches), which then
    replaces ``path``. A PNG or JSON file that exists is complete."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
            break
        except FileExistsError:
            continue
    else:
        raise ArtifactError(f"cannot create a temporary file beside {path}.")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class Writer:
    """Writes the files of one artifact into a private directory; ``finish`` adds the manifest.
    ``private``: files 0600 whatever the umask (an engine-cache entry); else as ``open()`` makes them."""

    def __init__(self, root: Path, private: bool = False):
        self.root = root
        self.private = private
        self.files: dict[str, dict[str, Any]] = {}

    def _path(self, rel: str) -> Path:
        parts = check_name(rel)
        if rel in self.files:
            raise ArtifactError(f"{rel} written twice.")
        (self.root.joinpath(*parts[:-1])).mkdir(parents=True, exist_ok=True)
        return self.root.joinpath(*parts)

    def write_bytes(self, rel: str, data: bytes) -> None:
        path = self._path(rel)
        mode = 0o600 if self.private else 0o644
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.files[rel] = _entry(path)

    def write_tensors(
        self, rel: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
    ) -> None:
        """A safetensors file; ``metadata`` goes into its (hashed) header."""
        from safetensors.torch import save_file

        path = self._path(rel)  # inside our fresh private directory: nothing else can be there
        tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        save_file(tensors, str(path), metadata=metadata)
        if not self.private:
            os.chmod(path, 0o666 & ~umask())  # safetensors creates its files 0600
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        self.files[rel] = _entry(path)

    def finish(self, manifest: dict[str, Any]) -> None:
        manifest = {**manifest, "files": self.files}
        self.write_bytes(MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        del self.files[MANIFEST]


def _entry(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return {"bytes": os.fstat(f.fileno()).st_size, **_chunk_sums(f.fileno(), fast_read.SUMS)}


def _chunk_sums(fd: int, kinds: tuple[str, ...]) -> dict[str, list[str]]:
    """{kind: the checksum of every CHUNK bytes of the file}, computed in parallel threads."""
    size = os.fstat(fd).st_size

    def one(offset: int) -> list[str]:
        sums = [fast_read.new_sum(k) for k in kinds]
        for block in _blocks(fd, offset, min(offset + CHUNK, size)):
            for h in sums:
                h.update(block)
        return [h.hexdigest() for h in sums]

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 2)) as pool:
        per_chunk = list(pool.map(one, range(0, max(size, 1), CHUNK)))
    return {k: [c[i] for c in per_chunk] for i, k in enumerate(kinds)}


def _chunk_hashes(fd: int) -> list[str]:
    """sha256 of every CHUNK bytes of the file."""
    return _chunk_sums(fd, ("sha256",))["sha256"]


def _data_sums(data: bytes, kind: str) -> list[str]:
    """The ``kind`` checksum of every CHUNK bytes of ``data``, as ``_chunk_sums`` computes them."""
    view = memoryview(data)

    def one(offset: int) -> str:
        h = fast_read.new_sum(kind)
        h.update(view[offset : offset + CHUNK])
        return h.hexdigest()

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 2)) as pool:
        return list(pool.map(one, range(0, max(len(data), 1), CHUNK)))


def _blocks(fd: int, start: int, end: int) -> Iterator[bytes]:
    """The bytes [start, end) of a file, 16 MiB at a time (pread: no shared file position)."""
    pos = start
    while pos < end:
        block = os.pread(fd, min(1 << 24, end - pos), pos)
        if not block:
            return
        yield block
        pos += len(block)


@contextlib.contextmanager
def writing(
    path: str | os.PathLike, kind: str, *, private: bool = False, damaged_ok: bool = False
) -> Iterator[Writer]:
    """Write an artifact of ``kind`` at ``path``: yields a ``Writer`` on a private sibling directory,
    which replaces ``path`` when the block ends without an error (or is removed, if it raises).

    ``path`` may not exist, be an empty directory, or be an artifact of the same kind; anything else
    is an ArtifactError (nothing is overwritten), but with ``damaged_ok`` any directory is replaced
    (an engine-cache entry its reader refused, which the cache checked is its owner's). ``private``: the
    directory stays 0700 and its files 0600 (engine-cache entries, which trust only their owner);
    else they take the umask. The swap is one atomic ``renameat2(RENAME_EXCHANGE)`` where Linux
    offers it; otherwise two renames, undone if the second fails, and a previous artifact left aside
    by a killed save is put back by the next one.
    """
    path = Path(path)
    parent = path.parent
    parent.mkdir(parents=True, exist_ok=True)
    with locked(parent):  # saves into one folder take turns; no lock file is left beside the artifact
        _recover(path)
        _check_replaceable(path, kind, damaged_ok)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=parent))
        if not private:  # the artifact directory as mkdir would make it (mkdtemp's is 0700)
            os.chmod(tmp, 0o777 & ~umask())
        try:
            yield Writer(tmp, private)
            if not (tmp / MANIFEST).is_file():
                raise ArtifactError("internal error: an artifact was written without a manifest.")
            if os.path.lexists(path) and _exchange(tmp, path):
                shutil.rmtree(tmp, ignore_errors=True)  # now holds the previous artifact
            else:
                _swap(tmp, path)
            _fsync_dir(parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _recover(path: Path) -> None:
    """Leftovers of killed saves to ``path``: temporary directories go; a previous artifact set aside
    while ``path`` is missing comes back."""
    for stale in sorted(path.parent.glob(f".{glob.escape(path.name)}.old-*")):
        previous = stale / "previous"
        if not os.path.lexists(path) and previous.is_dir() and not previous.is_symlink():
            os.rename(previous, path)
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
    for stale in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where that is unavailable."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _swap(tmp: Path, path: Path) -> None:
    """``tmp`` replaces ``path`` with two renames; the previous artifact is restored if the second fails."""
    old = None
    if os.path.lexists(path):
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        os.rename(path, old / "previous")
    try:
        os.rename(tmp, path)
    except BaseException:
        if old is not None and not os.path.lexists(path):
            os.rename(old / "previous", path)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_target(path: Path, kind: str) -> None:
    """ArtifactError unless ``path`` is free, an empty directory or an artifact of ``kind``."""
    _check_replaceable(path, kind)


def _check_replaceable(path: Path, kind: str, damaged_ok: bool = False) -> None:
    if not os.path.lexists(path):
        return
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ArtifactError(f"{path} is a symbolic link.", "save to a real directory path.")
    if not stat.S_ISDIR(st.st_mode):
        raise ArtifactError(f"{path} exists and is not a directory.", "choose another path.")
    if damaged_ok or not any(path.iterdir()):
        return
    try:
        parse_manifest(_read_manifest_bytes(path), str(path), kind)
    except ArtifactError as e:
        raise ArtifactError(
            f"{path} exists and is not a prx_compile {kind} of this version ({e}): "
            "it will not be overwritten.",
            "choose another path, or remove that directory.",
        ) from e


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading -----------------------------------------------------------------------------------
class Reader:
    """Read-only access to the files an artifact's manifest lists, confined to its directory."""

    def __init__(self, root: Path, manifest: dict[str, Any]):
        self.root = root
        self.manifest = manifest
        self.files: dict[str, dict[str, Any]] = manifest["files"]
        self.digest: str | None = None  # set by open_artifact
        #: files to check before their bytes are returned (``verify_when_read``), and against what
        self.unverified: set[str] = set()
        self.strong = True
        self._matched: dict[str, str] = {}  # file -> the checksum it matched ("sha256": both)

    @contextlib.contextmanager
    def open(self, rel: str) -> Iterator[int]:
        """A read-only file descriptor of a listed regular file (no link anywhere on the way)."""
        parts = check_name(rel)
        entry = self.files.get(rel)
        if entry is None:
            raise ArtifactError(f"{self.root}: {rel} is not listed in the manifest.")
        fds = []
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            fds.append(fd)
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                flags = (
                    os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_NONBLOCK if last else os.O_DIRECTORY)
                )
                fd = os.open(part, flags, dir_fd=fd)
                fds.append(fd)
            st = os.fstat(fd)
        except OSError as e:
            for f in fds:
                os.close(f)
            why = "is a symbolic link" if e.errno in (40, 20) else "is missing or unreadable"
            raise ArtifactError(f"{self.root}: {rel} {why} ({e.strerror}).") from e
        try:
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                raise ArtifactError(
                    f"{self.root}: {rel} is not a regular file of its own (a device, pipe or hard link)."
                )
            if st.st_size != entry["bytes"]:
                raise ArtifactError(
                    f"{self.root}: {rel} has {st.st_size} bytes, the manifest says {entry['bytes']} "
                    "(truncated or replaced)."
                )
            if schema.mostly_holes(st):
                raise ArtifactError(
                    f"{self.root}: {rel} is a sparse file ({st.st_size} bytes, {st.st_blocks * 512} on "
                    "disk), which no save writes.",
                    "copy the artifact again without --sparse, or save it anew.",
                )
            yield fd
        finally:
            for f in fds:
                os.close(f)

    def verify(self) -> None:
        """Every listed file not yet checked against its sha256 exists with its size and checksums
        (the sha256, and the crc32 where listed: corruption, truncation, replacement)."""
        for rel in sorted(r for r in self.files if self._matched.get(r) != "sha256"):
            kinds = tuple(k for k in fast_read.SUMS if k in self.files[rel])
            with self.open(rel) as fd:
                sums = _chunk_sums(fd, kinds)
            for kind in kinds:  # the sha256 first; then a wrong crc32 list is found here too
                self._match(rel, kind, sums[kind])

    def verify_when_read(self, strong: bool = True) -> None:
        """Check each file against its size and checksums as it is read instead: ``read_bytes`` hashes
        the bytes it read, ``read_tensors`` each 64 MiB as it arrives. Nothing of a file is returned
        before all of it has matched; a file never read is never hashed. ``strong``: against the
        sha256 (what a published digest pins); else against the crc32 where the manifest lists them,
        which finds corruption and truncation as well for less CPU time."""
        self.strong = strong
        self.unverified = {
            r for r in self.files if r not in self._matched or (strong and self._matched[r] != "sha256")
        }

    def _kind(self, rel: str) -> str:
        return "sha256" if self.strong or "crc32" not in self.files[rel] else "crc32"

    def _match(self, rel: str, kind: str, sums: list[str]) -> None:
        if sums != self.files[rel][kind]:
            raise fast_read.HashMismatch(
                f"{self.root}: {rel} does not match its {kind} (corrupted or replaced)."
            )
        self._mark(rel, kind)

    def _mark(self, rel: str, kind: str) -> None:
        """``rel`` matched its ``kind`` checksums."""
        if self._matched.get(rel) != "sha256":
            self._matched[rel] = kind
        self.unverified.discard(rel)

    def read_bytes(self, rel: str) -> bytes:
        with self.open(rel) as fd:
            data = b"".join(_blocks(fd, 0, os.fstat(fd).st_size))
        if rel in self.unverified:
            kind = self._kind(rel)
            self._match(rel, kind, _data_sums(data, kind))
        return data

    def read_tensors(
        self, rel: str, device: torch.device | str = "cpu", ready: Callable[[], None] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """(tensors, header metadata) of a safetensors file of the artifact (safetensors holds no
        code; parse errors are named). The file is read through the descriptor opened above.
        ``ready()`` runs once, when the bulk of the reading starts (``fast_read.read_file``)."""
        from safetensors import SafetensorError, safe_open
        from safetensors.torch import load, load_file

        kind = self._kind(rel) if rel in self.unverified else None  # None: nothing to check
        sums = self.files[rel][kind] if kind else None
        called: list[bool] = []
        need = self.files.get(rel, {}).get("bytes", 0)  # a file not listed: ``open`` names it
        free = available_bytes(torch.device(device))
        if free is not None and need > free:  # the file's tensors are made before a byte is checked
            raise ArtifactError(
                f"{self.root}: {rel} holds {need / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB "
                f"free on {device}.",
                "free memory, or load it where there is more.",
            )

        def start() -> None:
            if ready is not None and not called:
                called.append(True)
                ready()

        try:
            found = None
            with self.open(rel) as fd:
                proc = f"/proc/self/fd/{fd}"  # the very file opened above, memory-mapped
                if os.path.exists(proc):
                    with safe_open(proc, framework="pt") as f:  # safetensors' own checks of the header
                        unchecked = f.metadata() or {}
                    found = fast_read.read_file(fd, torch.device(device), sums, kind, start)
                    if found is None and kind is None:  # nothing to check: safetensors reads it
                        start()
                        tensors = load_file(proc, device=str(device))
                        if torch.device(device).type == "cpu":  # private memory, not a map of the file
                            tensors = {k: v.clone() for k, v in tensors.items()}
                        found = tensors, unchecked
                    elif found is not None and kind:
                        self._mark(rel, kind)  # read_file checked every chunk
            if found is None:  # no /proc, or a file fast_read does not read: one read, checked
                start()
                data = self.read_bytes(rel)
                found = {k: v.to(device) for k, v in load(data).items()}, _header_metadata(data)
        except fast_read.HashMismatch as e:
            if str(e).startswith(str(self.root)):  # named already (``_match``)
                raise
            raise fast_read.HashMismatch(f"{self.root}: {rel} {e}") from e
        except (SafetensorError, ValueError, OSError, RuntimeError, KeyError, TypeError, MemoryError) as e:
            # KeyError: a dtype the format allows and torch's reader does not know (F4, F8_E8M0)
            if kind and rel in self.unverified:  # a damaged header: checked, it is named as damaged
                with self.open(rel) as fd:
                    self._match(rel, kind, _chunk_sums(fd, (kind,))[kind])
            raise ArtifactError(
                f"{self.root}: {rel} is not a readable safetensors file ({type(e).__name__}: {str(e)[:200]})."
            ) from e
        return found


def available_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on ``device``: a GPU's free memory and what PyTorch's allocator holds
    unused, or the host's ``MemAvailable`` (Linux); None where it cannot be read."""
    try:
        if device.type == "cuda":  # what PyTorch holds unused is free for it too
            unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            return torch.cuda.mem_get_info(device)[0] + unused
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError, RuntimeError, AssertionError):  # a device index it lacks
        pass
    return None


def _header_metadata(data: bytes) -> dict[str, str]:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    return header.get("__metadata__") or {}


_DIGEST = re.compile(r"sha256:[0-9a-fA-F]{64}")


def open_artifact(
    path: str | os.PathLike,
    *,
    kind: str,
    verify: bool = True,
    when_read: bool = False,
    digest: str | None = None,
    reads: Callable[[dict[str, Any]], set[str]] | None = None,
) -> Reader:
    """A Reader over the artifact at ``path`` (of this ``kind``), its manifest parsed and, with
    ``verify``, every listed file checked against its size and checksums: here (the sha256 and the
    crc32), or with ``when_read`` as each is read (``Reader.verify_when_read``: a loader's one pass
    over the bytes; the crc32 unless a ``digest`` is given).

    ``reader.digest`` is ``"sha256:<hex>"`` of the manifest's bytes; the manifest lists every file's
    size and sha256, so with ``verify`` it pins the whole artifact. With ``digest`` (what the
    publisher printed), anything else is an ArtifactError before a field is parsed. ``reads(manifest)``:
    the files a loader of this kind reads; a manifest that lists any other is refused before a byte of
    them is hashed."""
    if digest is not None and (not isinstance(digest, str) or not _DIGEST.fullmatch(digest)):
        raise ArtifactError(
            "digest must be 'sha256:' and 64 hex digits, as save_compiled and `prx-compile inspect` print it."
        )
    if digest is not None and not verify:
        raise ArtifactError("a digest pins the files only when they are verified: leave verify on.")
    root = Path(path)
    try:
        is_dir = root.is_dir()
    except OSError as e:  # a name too long, a folder above it this user may not search
        raise ArtifactError(f"{excerpt(str(root))} cannot be examined ({e.strerror}).") from e
    if not is_dir:
        what = "a file, not a directory" if os.path.lexists(root) else "no such directory"
        raise ArtifactError(
            f"{root} is not a prx_compile artifact: {what}.",
            "an artifact is the directory prx_compile.save_compiled or `prx-compile build` writes.",
        )
    data = _read_manifest_bytes(root)
    found = "sha256:" + hashlib.sha256(data).hexdigest()
    if digest is not None and found != digest.lower():
        raise ArtifactError(
            f"{root} is not the artifact that was published: its digest is {found}, expected {digest}.",
            "get the artifact again from its publisher (or load it with rebuild=True only if you trust it).",
        )
    manifest = parse_manifest(data, str(root / MANIFEST), kind)
    if reads is not None:
        unused = sorted(set(manifest["files"]) - reads(manifest))
        if unused:
            raise ArtifactError(
                f"{root}: the manifest lists files no load reads ({', '.join(unused[:3])}"
                f"{', ...' if len(unused) > 3 else ''}).",
                "an artifact lists only what save_compiled writes: save it anew.",
            )
    reader = Reader(root, manifest)
    reader.digest = found
    if verify and when_read:
        reader.verify_when_read(strong=digest is not None)
    elif verify:
        reader.verify()
    return reader


def _read_manifest_bytes(root: Path) -> bytes:
    try:
        dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:  # a directory this user may not read
        raise ArtifactError(f"{root} cannot be opened ({e.strerror}).") from e
    try:
        try:
            fd = os.open(MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
        except FileNotFoundError as e:
            raise ArtifactError(
                f"{root} is not a prx_compile artifact: {MANIFEST} is missing.",
                "save one with prx_compile.save_compiled or `prx-compile build`.",
            ) from e
        except OSError as e:
            raise ArtifactError(f"{root}/{MANIFEST} cannot be opened ({e.strerror}; is it a link?).") from e
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise ArtifactError(f"{root}/{MANIFEST} is not a regular file of its own.")
        if st.st_size > MAX_MANIFEST_BYTES:
            raise ArtifactError(f"{root}/{MANIFEST} is {st.st_size} bytes: too large for a manifest.")
        return os.pread(fd, st.st_size, 0)
    except OSError as e:
        raise ArtifactError(f"{root}/{MANIFEST} cannot be read ({e.strerror}).") from e
    finally:
        os.close(fd)


#: the most bytes an artifact's files may hold together (weights of a 30 B-parameter model in fp32)
MAX_FILE_BYTES = 128 * 2**30


#: a manifest's ``files`` table: relative name -> {bytes, one sha256 (and crc32) per 64 MiB chunk}
_FILES = schema.Map(
    schema.Str(1000),  # check_name says which names a file may have
    schema.Dict(
        {
            "bytes": schema.Int(0, MAX_FILE_BYTES),
            "sha256": schema.List(
                schema.Str(64, pattern=_HEX.pattern, what="a sha256 in hex"),
                max_len=MAX_FILE_BYTES // CHUNK + 1,
            ),
            "crc32": schema.List(
                schema.Str(8, pattern="[0-9a-f]{8}", what="a crc32 in hex"),
                max_len=MAX_FILE_BYTES // CHUNK + 1,
            ),
        },
        optional=("crc32",),  # where absent (0.25 wrote none) a load checks the sha256
    ),
    max_len=10_000,
)


def parse_manifest(data: bytes, where: str, kind: str) -> dict[str, Any]:
    """JSON of this format and version, with a valid ``files`` table; other fields are checked by
    whoever reads them."""
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: also huge integers
        raise ArtifactError(f"{where} is not valid JSON (corrupted or replaced): {str(e)[:120]}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{where} is not a {FORMAT} manifest.")
    version = manifest.get("format_version")
    if type(version) is not int or version not in READS:
        raise ArtifactError(
            f"{where} has format version {repr(version)[:20]}, this prx_compile "
            f"reads {' and '.join(map(str, READS))}.",
            "build the artifact again with this version.",
        )
    if manifest.get("kind") != kind:
        raise ArtifactError(f"{where} is a {str(manifest.get('kind'))[:40]!r}, expected a {kind!r}.")
    files = field(manifest, "files", dict)
    try:
        schema.check(_FILES, files, f"{where}: files")
    except schema.SchemaError as e:
        raise ArtifactError(str(e)) from e
    for rel, entry in files.items():
        check_name(rel)
        if rel == MANIFEST:
            raise ArtifactError(f"{where}: files may not list the manifest itself.")
        chunks = max(1, -(-entry["bytes"] // CHUNK))
        if len(entry["sha256"]) != chunks or len(entry.get("crc32", [None] * chunks)) != chunks:
            raise ArtifactError(
                f"{where}: files[{rel!r}] must be {{bytes, sha256 and crc32 (one per 64 MiB)}}."
            )
    total = sum(e["bytes"] for e in files.values())
    if total > MAX_FILE_BYTES:
        raise ArtifactError(
            f"{where}: its files hold {total} bytes, more than an artifact may ({MAX_FILE_BYTES})."
        )
    return manifest


def field(d: Any, key: str, kind: type | tuple[type, ...], where: str = "manifest") -> Any:
    """``d[key]`` if it is a ``kind`` (a bool is no int), else an ArtifactError naming ``where.key``."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(d, dict) or key not in d:
        raise ArtifactError(f"{where}.{key} is missing.")
    v = d[key]
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise ArtifactError(f"{where}.{key} must be a {names}, got {type(v).__name__}.")
    return v


# -- backend states ----------------------------------------------------------------------------
_BLOB = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,100}")


def write_state(writer: Writer, prefix: str, state) -> dict[str, Any]:
    """Write a BackendState's blobs and tensors under ``prefix/``; returns its manifest record."""
    for name, data in state.blobs.items():
        if not _BLOB.fullmatch(name):
            raise ArtifactError(f"cannot save a file named {name!r}.")
        writer.write_bytes(f"{prefix}/{name}", data)
    if state.tensors:
        writer.write_tensors(f"{prefix}/tensors.safetensors", state.tensors)
    return {"meta": state.meta, "blobs": sorted(state.blobs), "tensors": bool(state.tensors)}


#: an engine set's record in a manifest (``write_state``); its ``meta`` is the backend's to check
STATE_RECORD = schema.Dict(
    {
        "meta": schema.Map(schema.Str(40), schema.Later("the backend's from_state"), max_len=64),
        "blobs": schema.List(schema.Str(101, pattern=_BLOB.pattern, what="a file name"), max_len=10_000),
        "tensors": schema.Bool(),
    }
)
#: what every manifest of this format holds besides its own fields (``parse_manifest`` checks these)
COMMON = {
    "format": schema.Str(64),
    "format_version": schema.Int(0, 10**6),
    "kind": schema.Str(64),
    "created": schema.Str(64),
    "files": schema.Later("parse_manifest"),
}


def check_fields(spec: schema.Spec, manifest: dict[str, Any], where: str) -> None:
    """ArtifactError naming the field when ``manifest`` does not have the shape ``spec`` describes."""
    try:
        schema.check(spec, manifest, where)
    except schema.SchemaError as e:
        raise ArtifactError(str(e)) from e


def read_state(reader: Reader, prefix: str, record: Any, where: str, device: torch.device | str):
    """The BackendState ``write_state`` recorded (blobs and tensors read from the artifact)."""
    from ..backends import BackendState

    check_fields(STATE_RECORD, record, where)
    state = BackendState(record["meta"], {b: reader.read_bytes(f"{prefix}/{b}") for b in record["blobs"]})
    if record["tensors"]:
        state.tensors = reader.read_tensors(f"{prefix}/tensors.safetensors", device)[0]
    return state


# -- facts for manifests -----------------------------------------------------------------------
def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def gpu() -> dict[str, Any] | None:
    if not torch.cuda.is_available():
        return None
    return {"name": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability())}


def versions(with_tensorrt: bool) -> dict[str, str]:
    import diffusers

    from .._version import __version__

    v = {"torch": torch.__version__, "diffusers": diffusers.__version__, "prx_compile": __version__}
    if with_tensorrt:
        from ..backends.tensorrt import shim

        v.update(shim.versions())
    return v
