"""The engine cache: built engine sets reused across processes.

An entry is an artifact of kind "cache-entry" (``artifact.py``) holding one backend's state under
``<engine_cache_dir>/<key>``. The key covers what engines depend on: the model's architecture
(its config, and module by module its class, its plain settings and its attention processor's
class: what an export bakes in; a model with forward hooks or forwards of its own, functions no key
can name, builds without the cache), the engine set's shapes, the engine-affecting settings
(``config.ENGINE_KEYS``, and whether this set's linears run in PyTorch: ``range_linears`` for range
sets), the library versions and the GPU, and, only with ``weights: engine`` (weights baked into engines), the
weights themselves. With ``weights: inputs`` a fine-tuned model or a LoRA is a cache hit.

One lock file per key: of several processes asking for the same engines, one builds them and the
others wait, then load what it stored. An entry that cannot be used is rebuilt, with a warning.

The cache trusts only its owner, as ssh treats ``~/.ssh``: the cache directory, every entry and
every file in it must belong to this user (``os.geteuid()``) and be writable by no one else, and an
entry is never followed through a symbolic link. Anything else is refused with an ArtifactError
naming the path and what to fix, before a byte of it is read: an entry planted by another user
would hand TensorRT engines (code, in effect) of their choosing. A cache shared between users on
purpose is ``PRX_COMPILE_CACHE_SHARED=1``: every user who can write there is then trusted (entries
of other owners and group-writable ones are read; links and world-writable entries still are not).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import time
from pathlib import Path
from typing import Any

import torch

from .. import schema
from ..backends import Backend, backend_class
from ..errors import ArtifactError
from ..export import settings
from ..runtime.watch import hooked
from ..shapes import ShapeRange
from . import artifact

logger = logging.getLogger(__name__)
KIND = "cache-entry"
#: ``PRX_COMPILE_CACHE_SHARED=1``: an engine cache shared between users on purpose (module docstring).
SHARED_ENV = "PRX_COMPILE_CACHE_SHARED"


class UntrustedCacheError(ArtifactError):
    """A cache directory, entry or file that is not this user's own (``check_trusted``): refused,
    never rebuilt over silently."""


def shared() -> bool:
    """Whether ``$PRX_COMPILE_CACHE_SHARED`` is 1: entries of other users are trusted."""
    return os.environ.get(SHARED_ENV, "").strip() == "1"


def check_trusted(path: Path, *, follow: bool = False) -> None:
    """ArtifactError unless ``path`` (a cache directory, entry or file) is this user's and writable
    by no one else; ``follow``: ``path`` may be a symbolic link to such a directory (the cache
    directory itself), else a link is refused. With ``shared()``, only links and world-writable
    paths are refused."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except OSError as e:
        raise ArtifactError(f"engine cache: {path} cannot be examined ({e.strerror}).") from e  # damaged
    other = "use an engine cache directory of your own (engine_cache_dir; the CLI's $PRX_COMPILE_CACHE)"
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedCacheError(
            f"engine cache: {path} is a symbolic link, and cache entries are never followed.",
            f"remove it (the entry is built again), or {other}.",
        )
    mode = stat.S_IMODE(st.st_mode)
    if shared():
        if mode & stat.S_IWOTH:
            raise UntrustedCacheError(
                f"engine cache: {path} is writable by every user (mode {mode:o}), even for a shared cache.",
                f"`chmod o-w {path}`, or {other}.",
            )
        return
    uid = os.geteuid()
    if st.st_uid != uid:
        raise UntrustedCacheError(
            f"engine cache: {path} belongs to uid {st.st_uid}, not to you (uid {uid}): not trusted.",
            f"remove it or `chown` it to yourself, or {other}; a cache shared between users on purpose "
            f"needs {SHARED_ENV}=1 (README, Security model).",
        )
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedCacheError(
            f"engine cache: {path} is writable by group or others (mode {mode:o}): not trusted.",
            f"`chmod go-w {path}`, or {other}; a cache shared between users on purpose needs "
            f"{SHARED_ENV}=1 (README, Security model).",
        )


def check_entry(entry: Path) -> None:
    """``check_trusted`` for an entry directory and its manifest (the files it lists are checked by
    ``load_entry``, once the manifest is parsed)."""
    check_trusted(entry)
    if not stat.S_ISDIR(os.lstat(entry).st_mode):
        raise UntrustedCacheError(
            f"engine cache: {entry} is not a directory.", "remove it (it is built again)."
        )
    if os.path.lexists(entry / artifact.MANIFEST):
        check_trusted(entry / artifact.MANIFEST)


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer (names, dtypes, shapes and bytes), in name order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def model_config(model: torch.nn.Module) -> dict[str, Any]:
    return {k: v for k, v in dict(model.config).items() if not k.startswith("_")}


def modules(model: torch.nn.Module) -> list[list[Any]]:
    """What an export of ``model`` bakes in besides its config and weights, module by module: its
    class, its plain settings (an eps: ``export.settings``) and its attention processor's class."""

    def name(cls: type) -> str:
        return f"{cls.__module__}.{cls.__qualname__}"

    out = []
    for n, m in model.named_modules():
        proc = m.__dict__.get("processor")
        out.append(
            [n, name(type(m)), sorted(settings(m).items()), None if proc is None else name(type(proc))]
        )
    return out


def cache_key(backend: Backend, example: dict[str, torch.Tensor]) -> str:
    """What the engines of ``backend`` depend on, hashed."""
    cfg = backend.config
    material = {
        "model": model_config(backend.model),
        "class": type(backend.model).__name__,
        "shapes": backend.shapes.to_dict(),
        "settings": {
            **backend.plan.engine_key(backend.shapes),
            "dtype": str(next(backend.model.parameters()).dtype),
        },
        "versions": artifact.versions(cfg.backend == "tensorrt"),
        "gpu": artifact.gpu() if cfg.backend == "tensorrt" else None,
        "inputs": {k: str(v.dtype) for k, v in sorted(example.items())},
        "format": artifact.FORMAT_VERSION,
        "modules": modules(backend.model),
    }
    if cfg.weights == "engine" and cfg.backend == "tensorrt":
        material["weights"] = weights_sha256(backend.model)
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:32]


def build_through_cache(backend: Backend, example: dict[str, torch.Tensor]) -> tuple[Backend, dict[str, Any]]:
    """A built backend for ``backend``'s model, config and shapes: from the cache, or built here and
    stored. Returns (backend, {"key", "load_s"}), ``load_s`` None when it was built."""
    cfg = backend.config
    root = Path(cfg.engine_cache_dir).expanduser()
    try:
        root.mkdir(mode=0o777 if shared() else 0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise ArtifactError(f"engine cache: cannot create {root} ({e.strerror}).") from e
    check_trusted(root, follow=True)
    traced = hooked(backend.model)
    if traced:  # functions: nothing a key could hold
        logger.warning(
            "engine cache not used for %s: %s hold forward hooks or forwards of their own, which an "
            "entry's key cannot name; built here.",
            backend.shapes.describe(),
            ", ".join(traced[:3]),
        )
        backend.build(example)
        return backend, {"key": None, "load_s": None}
    key = cache_key(backend, example)
    entry = root / key
    with artifact.locked(root / f".{key}.build.lock"):
        if os.path.lexists(entry):
            check_entry(entry)  # refused, not rebuilt: someone else's or a link is a question to answer
            t0 = time.perf_counter()
            try:
                loaded = load_entry(entry, backend)
                if not loaded.is_built:  # PyTorch backends keep no graph: they lower again (seconds)
                    loaded.build(example)
                loaded.load()  # deserialise now: an entry TensorRT refuses is rebuilt below
                load_s = time.perf_counter() - t0
                logger.info("engine cache hit %s (%.1f s)", key, load_s)
                return loaded, {"key": key, "load_s": load_s}
            except UntrustedCacheError:
                raise
            except Exception as e:  # a damaged or foreign entry, whatever it raises: build instead
                logger.warning("engine cache entry %s cannot be used (%s): building again", key, e)
        backend.build(example)
        try:
            store(entry, backend)
        except (OSError, ArtifactError) as e:  # the engines are built: keep them, say the cache failed
            logger.warning(
                "engine cache entry %s could not be written (%s); the engines are used anyway", key, e
            )
        return backend, {"key": key, "load_s": None}


#: a cache entry's manifest (``store``)
_MANIFEST = schema.Dict(
    {**artifact.COMMON, "shapes": schema.Later("ShapeRange.from_dict"), "set": artifact.STATE_RECORD}
)


def store(entry: Path, backend: Backend) -> None:
    """Write ``backend``'s state as the cache entry ``entry`` (atomically), in place of a damaged one
    (``build_through_cache`` checked it is this user's, and ``load_entry`` refused it: kept, every
    process would build it again)."""
    # 0700/0600: only its owner is trusted
    with artifact.writing(entry, KIND, private=True, damaged_ok=True) as w:
        record = artifact.write_state(w, "set", backend.state())
        w.finish(
            {
                "format": artifact.FORMAT,
                "format_version": artifact.FORMAT_VERSION,
                "kind": KIND,
                "created": artifact.now(),
                "shapes": backend.shapes.to_dict(),
                "set": record,
            }
        )


def load_entry(path: Path, like: Backend) -> Backend:
    """The backend stored at ``path``, over ``like``'s model and config (ArtifactError if unusable)."""
    check_entry(path)
    reader = artifact.open_artifact(path, kind=KIND, verify=False)
    for rel in reader.files:  # before any is read
        check_trusted(path.joinpath(*artifact.check_name(rel)))
    reader.verify_when_read(strong=False)  # the cache is trusted: corruption, not tampering
    m = reader.manifest
    artifact.check_fields(_MANIFEST, m, f"{path}: manifest")
    try:
        shapes = ShapeRange.from_dict(m.get("shapes"))
    except ValueError as e:
        raise ArtifactError(f"{path}: {e}") from e
    if shapes != like.shapes:
        raise ArtifactError(f"{path}: holds engines for {shapes.describe()}, not {like.shapes.describe()}.")
    state = artifact.read_state(reader, "set", m.get("set"), "manifest.set", like.config.device)
    try:
        return backend_class(like.plan).from_state(like.model, like.plan, shapes, state)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ArtifactError(f"{path}: {e}") from e
