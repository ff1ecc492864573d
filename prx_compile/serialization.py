"""Save and load compiled transformers without pickle: engines as bytes, weights as safetensors,
everything else as JSON.

Artifact (a directory)::

    manifest.json          format version, versions, GPU, config, model config, shape range,
                           lowering rules, the compiled graph (JSON), engine records, sha256 of files
    weights.safetensors    the transformer's current weights (LoRA refits included)
    engines/<name>.engine  serialized TensorRT engines (backend "tensorrt" only)

Loading checks the format version, sizes and sha256 of every file, the TensorRT and GPU it was built
for, and never unpickles anything: graph targets are resolved from a whitelist (``torch.ops.aten``,
``torch.ops.prx_compile``, ``operator``). Every file is written to a temporary name and renamed;
the manifest is written last, so a reader sees either a complete artifact or none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import operator
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from .config import REBUILD_KEYS, CompileConfig
from .errors import ArtifactError
from .export import ShapeRange

logger = logging.getLogger(__name__)

FORMAT = "prx_compile-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
CONSTANTS = "constants.safetensors"
_OPERATORS = {
    "getitem": operator.getitem,
    "mul": operator.mul,
    "add": operator.add,
    "sub": operator.sub,
    "floordiv": operator.floordiv,
    "truediv": operator.truediv,
    "neg": operator.neg,
}
_OP_NAMESPACES = ("aten", "prx_compile", "prims")


# -- files -------------------------------------------------------------------------------------
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; once written, fsync it and rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))


def _file_entry(root: Path, rel: str) -> dict[str, Any]:
    p = root / rel
    return {"bytes": p.stat().st_size, "sha256": sha256_file(p)}


# -- graph <-> JSON ----------------------------------------------------------------------------
def _encode(arg: Any) -> Any:
    if isinstance(arg, fx.Node):
        return {"node": arg.name}
    if isinstance(arg, (list, tuple)):
        return {"list" if isinstance(arg, list) else "tuple": [_encode(a) for a in arg]}
    if isinstance(arg, dict):
        return {"dict": {k: _encode(v) for k, v in arg.items()}}
    if isinstance(arg, torch.dtype):
        return {"dtype": str(arg).split(".")[-1]}
    if isinstance(arg, torch.device):
        return {"device": str(arg)}
    if isinstance(arg, torch.memory_format):
        return {"memory_format": str(arg).split(".")[-1]}
    if isinstance(arg, torch.layout):
        return {"layout": str(arg).split(".")[-1]}
    if isinstance(arg, float) and (arg != arg or arg in (float("inf"), float("-inf"))):
        return {"float": str(arg)}
    if arg is None or isinstance(arg, (bool, int, float, str)):
        return arg
    raise ArtifactError(f"cannot save a graph argument of type {type(arg).__name__} ({arg!r}).")


def _decode(arg: Any, nodes: dict[str, fx.Node]) -> Any:
    if isinstance(arg, dict):
        ((kind, v),) = arg.items()
        if kind == "node":
            return nodes[v]
        if kind in ("list", "tuple"):
            seq = [_decode(a, nodes) for a in v]
            return seq if kind == "list" else tuple(seq)
        if kind == "dict":
            return {k: _decode(x, nodes) for k, x in v.items()}
        if kind == "dtype":
            return _torch_attr(v, torch.dtype)
        if kind == "device":
            return torch.device(v)
        if kind == "memory_format":
            return _torch_attr(v, torch.memory_format)
        if kind == "layout":
            return _torch_attr(v, torch.layout)
        if kind == "float":
            return float(v)
        raise ArtifactError(f"unknown graph argument kind {kind!r} in the manifest.")
    return arg


def _torch_attr(name: str, kind: type) -> Any:
    value = getattr(torch, name, None)
    if not isinstance(value, kind):
        raise ArtifactError(f"manifest names {name!r}, which is not a torch {kind.__name__}.")
    return value


def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.{target.namespace}.{target._opname}.{target._overloadname}"
    if getattr(target, "__module__", None) == "_operator" and target.__name__ in _OPERATORS:
        return f"operator.{target.__name__}"
    raise ArtifactError(f"cannot save graph target {target!r}: only torch ops and operator.* are supported.")


def _resolve_target(name: str) -> Any:
    """A whitelisted callable for a saved target name (never an arbitrary import)."""
    parts = name.split(".")
    if parts[0] == "operator" and len(parts) == 2 and parts[1] in _OPERATORS:
        return _OPERATORS[parts[1]]
    if len(parts) == 5 and parts[:2] == ["torch", "ops"] and parts[2] in _OP_NAMESPACES:
        try:
            return getattr(getattr(getattr(torch.ops, parts[2]), parts[3]), parts[4])
        except AttributeError:
            pass
    raise ArtifactError(f"the manifest names graph target {name!r}, which is not an allowed operator.")


def graph_to_json(gm: fx.GraphModule) -> list[dict[str, Any]]:
    out = []
    for n in gm.graph.nodes:
        rec: dict[str, Any] = {"op": n.op, "name": n.name}
        if n.op == "call_function":
            rec["target"] = _target_name(n.target)
        elif n.op in ("call_module", "get_attr", "placeholder"):
            rec["target"] = str(n.target)
        elif n.op != "output":
            raise ArtifactError(f"cannot save graph node {n.op} {n.target}.")
        rec["args"] = _encode(list(n.args))
        rec["kwargs"] = _encode(dict(n.kwargs))
        out.append(rec)
    return out


def graph_from_json(records: list[dict[str, Any]], root: dict[str, Any]) -> fx.GraphModule:
    """Rebuild a GraphModule; ``root`` maps qualified attribute names to modules and tensors."""
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    for r in records:
        args = tuple(_decode(r["args"], nodes))
        kwargs = _decode(r["kwargs"], nodes)
        if r["op"] == "placeholder":
            node = graph.placeholder(r["target"])
        elif r["op"] == "call_function":
            node = graph.call_function(_resolve_target(r["target"]), args, kwargs)
        elif r["op"] == "call_module":
            node = graph.call_module(r["target"], args, kwargs)
        elif r["op"] == "get_attr":
            node = graph.get_attr(r["target"])
        elif r["op"] == "output":
            node = graph.output(args[0])
        else:
            raise ArtifactError(f"unknown graph node kind {r['op']!r} in the manifest.")
        node.name = r["name"]
        nodes[r["name"]] = node
    return fx.GraphModule(root, graph)


# -- save --------------------------------------------------------------------------------------
def _versions() -> dict[str, str]:
    import diffusers

    from . import __version__

    v = {"torch": torch.__version__, "diffusers": diffusers.__version__, "prx_compile": __version__}
    try:
        from .backends import trt_shim

        v.update(trt_shim.versions())
    except Exception:
        pass
    return v


def _gpu() -> dict[str, Any] | None:
    if not torch.cuda.is_available():
        return None
    return {"name": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability())}


def save_compiled(module, path: str | os.PathLike) -> Path:
    """Write ``module`` (a CompiledTransformer) to the artifact directory ``path``.

    Returns the path. The weights written are the transformer's current ones, so an artifact saved
    after a LoRA refit holds the refitted weights.
    """
    from filelock import FileLock

    from . import lora
    from .lowering import RULES

    if not module.is_built:
        module.build()
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        (root / MANIFEST).unlink(missing_ok=True)  # invalid until the new manifest lands
        transformer = module.transformer
        cfg = module.compile_config
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": _versions(),
            "gpu": _gpu(),
            "backend": cfg.backend,
            "config": cfg.to_dict(),
            "model_class": type(transformer).__name__,
            "model_config": {k: v for k, v in dict(transformer.config).items() if not k.startswith("_")},
            "shapes": dataclasses.asdict(module.shapes),
            "lowering": {"rules": list(RULES), "settings": dataclasses.asdict(cfg.lowering())},
            "lora": lora.summary(transformer),
            "files": {},
        }
        _save_tensors(dict(transformer.state_dict()), root / WEIGHTS)
        manifest["files"][WEIGHTS] = _file_entry(root, WEIGHTS)
        if cfg.backend == "tensorrt":
            manifest.update(_save_engines(module, root, manifest["files"]))
        atomic_write_bytes(root / MANIFEST, json.dumps(manifest, indent=1, default=str).encode())
    return root


def _attr(module: torch.nn.Module, qualname: str) -> Any:
    for part in qualname.split("."):
        module = getattr(module, part)
    return module


def _save_engines(module, root: Path, files: dict[str, Any]) -> dict[str, Any]:
    from .backends import trt_shim

    backend = module.backend
    gm = backend.gm
    engines, segments, constants = {}, {}, {}
    used = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    for name, sub in gm.named_children():
        if name not in used:
            continue
        if isinstance(sub, trt_shim.engine_classes()):
            rel = f"engines/{name}.engine"
            atomic_write_bytes(root / rel, trt_shim.engine_bytes(sub))
            files[rel] = _file_entry(root, rel)
            engines[name] = {"file": rel, **trt_shim.engine_record(sub)}
        elif isinstance(sub, fx.GraphModule):
            segments[name] = graph_to_json(sub)
            constants.update(
                {f"{name}/{n.target}": _attr(sub, n.target) for n in sub.graph.nodes if n.op == "get_attr"}
            )
        else:
            raise ArtifactError(f"cannot save child {name!r} of type {type(sub).__name__}.")
    constants.update({n.target: _attr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"})
    if constants:
        _save_tensors(constants, root / CONSTANTS)
        files[CONSTANTS] = _file_entry(root, CONSTANTS)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    known = {"hidden_states", "timestep", "encoder_hidden_states", "attention_mask", "return_dict"}
    if not set(placeholders) <= known:
        raise ArtifactError(
            f"cannot save: the compiled graph takes inputs {placeholders}, expected {sorted(known)}."
        )
    return {
        "graph": graph_to_json(gm),
        "segments": segments,
        "engines": engines,
        "inputs": placeholders,
        "provenance": {k: list(v) for k, v in backend.provenance.items()},
    }


# -- load --------------------------------------------------------------------------------------
def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of an artifact, validated as JSON of this format (files are not hashed)."""
    root = Path(path)
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(
            f"{root} is not a prx_compile artifact: {MANIFEST} is missing.",
            "save one with prx_compile.save_compiled or `prx-compile build`.",
        )
    try:
        manifest = json.loads(mpath.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{mpath} is not valid JSON (corrupted or replaced): {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{mpath} is not a {FORMAT} manifest.")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{root} has format version {manifest.get('format_version')}, this prx_compile "
            f"reads {FORMAT_VERSION}.",
            "rebuild the artifact with this version.",
        )
    return manifest


def verify_files(root: Path, manifest: dict[str, Any]) -> None:
    """Every listed file exists with its recorded size and sha256 (truncation, corruption, tampering)."""
    for rel, entry in manifest["files"].items():
        p = root / rel
        if ".." in Path(rel).parts or not p.is_file():
            raise ArtifactError(f"{root}: file {rel} is missing.")
        if p.stat().st_size != entry["bytes"]:
            raise ArtifactError(
                f"{root}: {rel} has {p.stat().st_size} bytes, the manifest says {entry['bytes']} "
                "(truncated or replaced)."
            )
        if sha256_file(p) != entry["sha256"]:
            raise ArtifactError(f"{root}: {rel} does not match its sha256 (corrupted or tampered with).")


def check_compatible(manifest: dict[str, Any]) -> None:
    """Raise ArtifactError if the artifact's engines cannot run here (TensorRT version, GPU)."""
    if manifest["backend"] != "tensorrt":
        return
    here = _versions()
    built = manifest["versions"]
    for key in ("tensorrt", "tensorrt_package"):
        if built.get(key) != here.get(key):
            raise ArtifactError(
                f"artifact engines were built with {key} {built.get(key)}, this machine has {here.get(key)}.",
                "load with rebuild=True to rebuild from the saved weights.",
            )
    gpu = _gpu()
    if gpu is None:
        raise ArtifactError(
            "artifact holds TensorRT engines but this machine has no CUDA GPU.",
            "load it on a GPU, or with rebuild=True and backend='eager'.",
        )
    saved = manifest.get("gpu") or {}
    if saved.get("capability") != gpu["capability"]:
        raise ArtifactError(
            f"artifact engines were built for compute capability {saved.get('capability')} "
            f"({saved.get('name')}), this GPU is {gpu['capability']} ({gpu['name']}).",
            "load with rebuild=True to rebuild from the saved weights.",
        )


def _model_class(name: str):
    if name == "PRXTransformer2DModel":
        from diffusers import PRXTransformer2DModel

        return PRXTransformer2DModel
    if name == "PRXTransformer2DModelFold":
        from .testing import _fold_class

        return _fold_class()
    raise ArtifactError(f"artifact holds a {name!r}, not a PRX transformer this prx_compile can load.")


def _load_transformer(root: Path, manifest: dict[str, Any], device: torch.device):
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cls = _model_class(manifest["model_class"])
    with torch.device("meta"):
        model = cls.from_config(manifest["model_config"])
    try:
        state = load_file(str(root / WEIGHTS), device=str(device))
    except (SafetensorError, OSError) as e:
        raise ArtifactError(f"{root}/{WEIGHTS} is not a readable safetensors file ({e}).") from e
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ArtifactError(f"{root}/{WEIGHTS} does not fit the saved model config: {e}") from e
    return model.eval()


def load_compiled(
    path: str | os.PathLike,
    *,
    device: str | torch.device | None = None,
    rebuild: bool = False,
    verify: bool = True,
):
    """Load an artifact written by ``save_compiled``; no engine is built, nothing is unpickled.

    Args:
        path: the artifact directory.
        device: where to run (default: the saved config's device).
        rebuild: compile again from the saved weights instead of loading engines (another GPU,
            another TensorRT, or a backend without engines).
        verify: check sizes and sha256 of every file first (recommended; a few seconds for PRX).

    Raises:
        ArtifactError: missing, truncated, corrupted or tampered files; format, TensorRT or GPU
            mismatch (the message says to use ``rebuild=True`` where that helps).
    """
    from .module import CompiledTransformer

    t0 = time.perf_counter()
    root = Path(path)
    manifest = read_manifest(root)
    if verify:
        verify_files(root, manifest)
    config = CompileConfig.from_dict(manifest["config"], source=f"{root}/{MANIFEST}")
    if device is not None:
        config = CompileConfig.resolve(config, device=str(device))
    if not rebuild:
        check_compatible(manifest)
    model = _load_transformer(root, manifest, torch.device(config.device))
    shapes = ShapeRange(**{k: tuple(v) if isinstance(v, list) else v for k, v in manifest["shapes"].items()})
    if rebuild or config.backend != "tensorrt":
        compiled = CompiledTransformer(model, config)  # builds at the first call
        compiled.shapes = compiled.backend.shapes = shapes
    else:
        compiled = CompiledTransformer(
            model, config, backend=_load_engines(root, manifest, model, config, shapes)
        )
        compiled.shapes = shapes
    compiled.load_s = time.perf_counter() - t0
    logger.info("loaded %s in %.2f s", root, compiled.load_s)
    return compiled


def _load_engines(root: Path, manifest: dict[str, Any], model, config, shapes: ShapeRange):
    from safetensors.torch import load_file

    from .backends import trt_shim
    from .backends.tensorrt import TensorRTBackend

    device = torch.device(config.device)
    constants = load_file(str(root / CONSTANTS), device=str(device)) if CONSTANTS in manifest["files"] else {}
    top: dict[str, Any] = {k: v for k, v in constants.items() if "/" not in k}
    for name, rec in manifest["engines"].items():
        top[name] = trt_shim.make_engine_module((root / rec["file"]).read_bytes(), rec, name, device)
    for name, records in manifest["segments"].items():
        seg = {k.split("/", 1)[1]: v for k, v in constants.items() if k.startswith(name + "/")}
        top[name] = graph_from_json(records, seg)
    gm = graph_from_json(manifest["graph"], top)
    return TensorRTBackend.from_graph(model, config, shapes, gm, manifest["inputs"], manifest["provenance"])


def inspect_artifact(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest without the graph (for ``prx-compile inspect``)."""
    m = read_manifest(path)
    return {k: v for k, v in m.items() if k not in ("graph", "segments", "provenance")} | {
        "engines": {
            k: {kk: vv for kk, vv in v.items() if kk != "weight_name_map"}
            for k, v in m.get("engines", {}).items()
        }
    }


# -- engine cache ------------------------------------------------------------------------------
def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer (names, dtypes, shapes and bytes), in name order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def cache_key(module, example: dict[str, torch.Tensor]) -> str:
    """What an engine depends on: model config and weights, shapes, settings, versions, GPU."""
    full = module.compile_config.to_dict()
    cfg = {k: full[k] for k in REBUILD_KEYS}  # the settings engines depend on
    material = {
        "model": {k: v for k, v in dict(module.transformer.config).items() if not k.startswith("_")},
        "class": type(module.transformer).__name__,
        "weights": weights_sha256(module.transformer),
        "shapes": dataclasses.asdict(module.shapes),
        "config": cfg,
        "versions": _versions(),
        "gpu": _gpu(),
        "inputs": {k: [str(v.dtype)] for k, v in example.items()},
        "format": FORMAT_VERSION,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:32]


def build_through_cache(module, example: dict[str, torch.Tensor]):
    """Return a built backend for ``module``: loaded from the cache, or built and stored there.

    Entries are artifacts (``save_compiled``) under ``<engine_cache_dir>/<cache_key>``. Backends
    without engines store their weights and config the same way and re-lower on a hit.

    One file lock per key: two processes asking for the same engines build them once; the second
    waits, then loads what the first stored.
    """
    from filelock import FileLock

    root = Path(module.compile_config.engine_cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    key = cache_key(module, example)
    entry = root / key
    with FileLock(str(entry) + ".build.lock"):
        if (entry / MANIFEST).is_file():
            try:
                t0 = time.perf_counter()
                loaded = load_compiled(entry, device=module.compile_config.device)
                if not loaded.is_built:  # backends without engines re-lower (seconds)
                    loaded.backend.build(example)
                module.cache_hit = {"key": key, "load_s": time.perf_counter() - t0}
                logger.info("engine cache hit %s (%.1f s)", key, module.cache_hit["load_s"])
                loaded.backend.model = module.transformer
                return loaded.backend
            except ArtifactError as e:
                logger.warning("engine cache entry %s unusable (%s): rebuilding", key, e)
        module.backend.build(example)
        module.cache_hit = {"key": key, "load_s": None}
        save_compiled(module, entry)
        return module.backend
