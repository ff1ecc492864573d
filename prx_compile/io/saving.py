"""``save_compiled`` / ``load_compiled``: a CompiledTransformer to and from an artifact directory.

    manifest.json                  format, versions, GPU, config, model config, LoRA record, engine sets
    weights.safetensors            the transformer's weights, once (with a LoRA: the originals)
    lora.safetensors               the loaded LoRA adapters (if any); they are re-applied on load
    sets/<i>/<engine>.engine       TensorRT engines of engine set i (small with weights: inputs)
    sets/<i>/<engine>.rtcache      TensorRT-RTX runtime cache: its JIT-compiled kernels
    sets/<i>/tensors.safetensors   constants the engine set needs (if any)

Loading builds nothing: the model comes from its validated config and the weights file, the LoRA
adapters are applied again (the same arithmetic, so the weights are bit-identical to the saved
module's), and each engine set is recreated from its state (``Backend.from_state``). Nothing is
unpickled, no code is generated, no file outside the directory is read and nothing is written.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from .. import lora, schema
from ..backends import backend_class, make_backend
from ..config import DTYPES, CompileConfig
from ..errors import ArtifactError, BackendUnavailableError, ConfigError, LoRAError, excerpt
from ..models import ModelSpec, spec_of_class
from ..plan import Plan
from ..runtime.module import CompiledTransformer, assemble
from ..runtime.watch import differences
from ..shapes import ShapeRange
from . import artifact
from .artifact import field

logger = logging.getLogger(__name__)
KIND = "artifact"
WEIGHTS = "weights.safetensors"
LORA = "lora.safetensors"


def save_compiled(module: CompiledTransformer, path: str | os.PathLike) -> Path:
    """Write ``module`` to the artifact directory ``path`` (engine sets not built yet are built
    first). An artifact already at ``path`` is replaced only once the new one is complete; any other
    existing file or non-empty directory there is an ArtifactError. Returns the path."""
    if not isinstance(module, CompiledTransformer):
        raise ArtifactError(f"save_compiled takes a CompiledTransformer, got {type(module).__name__}.")
    transformer = module.transformer
    spec = module.spec
    if type(transformer) is not spec.model_class():  # a subclass of ours would not load as itself
        raise ArtifactError(
            f"only diffusers' {spec.class_name} itself can be saved, not a {type(transformer).__name__}.",
        )
    if next(transformer.parameters()).dtype not in DTYPES.values():
        raise ArtifactError(
            f"cannot save a {next(transformer.parameters()).dtype} model: use {sorted(DTYPES)}."
        )
    for sh in [b.shapes for b in module.backends] + module.plan.shape_sets():
        try:  # what a load accepts (``load_compiled``): refused here rather than there
            ShapeRange.from_dict(sh.to_dict())
        except ValueError as e:
            raise ArtifactError(
                f"this module plans an engine set beyond what an artifact may hold ({e}).",
                "compile with smaller shapes (batch, resolution, text_len) to save it.",
            ) from e
    edits = differences(transformer, spec.construct(_model_config(transformer)))
    if edits:  # load_compiled constructs the model from its config: these would be gone, silently
        raise ArtifactError(
            f"an artifact cannot hold what was changed on this transformer since it was constructed: "
            f"{', '.join(edits[:3])}{f' and {len(edits) - 3} more' if len(edits) > 3 else ''}.",
            "undo them before saving and set them again on the loaded module.",
        )
    module.build()
    cfg = module.compile_config
    originals, lora_tensors, lora_record = lora.export_state(transformer)
    weights = {k: originals.get(k, v) for k, v in transformer.state_dict().items()}
    model_record = {"class": spec.class_name, "config": _model_config(transformer)}
    with artifact.writing(path, KIND) as w:  # what decides the numbers goes into hashed files
        w.write_tensors(WEIGHTS, weights, {"prx_compile.model": json.dumps(model_record, sort_keys=True)})
        if lora_record is not None:
            w.write_tensors(LORA, lora_tensors, {"prx_compile.lora": json.dumps(lora_record, sort_keys=True)})
        sets = [
            {"shapes": b.shapes.to_dict(), "state": artifact.write_state(w, f"sets/{i}", b.state())}
            for i, b in enumerate(module.backends)
        ]
        w.finish(
            {
                "format": artifact.FORMAT,
                "format_version": artifact.FORMAT_VERSION,
                "kind": KIND,
                "created": artifact.now(),
                "versions": artifact.versions(cfg.backend == "tensorrt"),
                "gpu": artifact.gpu(),
                "config": {**cfg.to_dict(), "engine_cache_dir": None, "dtype": _dtype_name(transformer)},
                "model": model_record,
                "lora": lora_record,
                "sets": sets,
            }
        )
    return Path(path)


def _dtype_name(model: torch.nn.Module) -> str:
    dtype = next(model.parameters()).dtype
    return {v: k for k, v in DTYPES.items()}[dtype]


def _model_config(model: torch.nn.Module) -> dict[str, Any]:
    return {k: v for k, v in dict(model.config).items() if not k.startswith("_")}


def load_compiled(
    path: str | os.PathLike,
    *,
    device: str | torch.device | None = None,
    backend: str | None = None,
    rebuild: bool = False,
    verify: bool = True,
    digest: str | None = None,
) -> CompiledTransformer:
    """Load an artifact written by ``save_compiled``; no engine is built, nothing is unpickled.

    Args:
        path: the artifact directory.
        device: where to run (default: the saved config's device).
        backend: run with this backend instead of the saved one (then the engine sets are built
            again from the saved weights at first use, as with ``rebuild``).
        rebuild: ignore the saved engines and compile again from the saved weights at first use
            (another GPU or TensorRT; or to run nothing but safetensors and JSON from this artifact).
        verify: check every file read against its size and checksums before any of it is used:
            the crc32 per 64 MiB the manifest lists (corruption, truncation), or with ``digest`` the
            sha256. The weights are checked in the same pass as they are read (each 64 MiB by the
            thread that read it), engines and JSON before they are parsed. ``False`` skips the
            checksums only.
        digest: ``"sha256:..."`` as ``artifact_digest`` / ``prx-compile inspect`` printed it where the
            artifact was made: an artifact with another digest is refused before anything is parsed.

    Each engine set is deserialised by TensorRT at its first call (or by ``.build()`` on the result),
    so a process pays only for the sets it runs; every file is read and checked here.

    Raises:
        ArtifactError: a missing, truncated, corrupted or malformed file or field (the message names
            it); a TensorRT or GPU version mismatch (the message says to use ``rebuild=True``). Bytes
            that pass every check and that TensorRT still cannot deserialise raise ArtifactError at
            the set's first call or ``.build()``.
    """
    t0 = time.perf_counter()
    reader = artifact.open_artifact(
        path, kind=KIND, verify=verify, when_read=True, digest=digest, reads=_files_read
    )
    m = reader.manifest
    artifact.check_fields(_MANIFEST, m, "manifest")
    config = _config(m, device, backend)
    rebuild = rebuild or (backend is not None and backend != m["config"].get("backend"))
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ArtifactError(
            f"the artifact runs on {config.device}, and this machine has no CUDA GPU.",
            "load it with backend='eager', device='cpu' (its engine sets are then built again).",
        )
    # the imports run while the weights are read: started once the read's tensors are allocated
    ahead: list[threading.Thread] = []

    def start_imports() -> None:
        try:
            ahead.append(_import_ahead(m))
        except RuntimeError as e:  # no thread to be had: the load imports what it needs itself
            logger.debug("importing ahead not started: %s", e)

    weights = reader.read_tensors(WEIGHTS, config.device, ready=start_imports)
    for thread in ahead:  # two threads importing one package race: the load imports nothing before
        thread.join()
    if config.backend == "tensorrt" and not rebuild:
        check_compatible(m)  # before the model is made or an engine read
    model, spec = _load_model(reader, config, weights)
    records = m["sets"]  # at most 256, each {shapes, state}: _MANIFEST
    shapes = []
    for i, rec in enumerate(records):
        try:
            shapes.append(ShapeRange.from_dict(rec["shapes"]))
        except ValueError as e:
            raise ArtifactError(f"manifest.sets[{i}]: {e}") from e
    multiple = spec.multiple(model.config)
    for i, sh in enumerate(shapes):
        if sh.tokens != spec.tokens or sh.multiple != multiple:
            raise ArtifactError(
                f"manifest.sets[{i}]: a range of {'image tokens' if sh.tokens else 'latent sizes'} in "
                f"multiples of {sh.multiple}; this {spec.class_name} takes "
                f"{'image tokens' if spec.tokens else 'latent sizes'} in multiples of {multiple}."
            )

    def restore() -> None:  # the saved LoRA, after the FP8 copies exist (they follow it)
        if m["lora"] is None and LORA not in reader.files:
            return
        tensors, meta = reader.read_tensors(LORA, config.device)
        record = _recorded(meta, "prx_compile.lora", LORA)
        if record != m["lora"]:
            raise ArtifactError(f"manifest.lora does not match the record in {LORA}.")
        try:
            lora.restore_state(model, record, tensors)
        except LoRAError as e:
            raise ArtifactError(f"{path}: the saved LoRA cannot be restored: {e}") from e

    def backends(plan):
        if rebuild:
            return [make_backend(model, plan, s) for s in shapes] or None
        out = []
        for i, (rec, s) in enumerate(zip(records, shapes, strict=True)):
            state = artifact.read_state(
                reader, f"sets/{i}", rec["state"], f"manifest.sets[{i}].state", config.device
            )
            try:
                out.append(backend_class(plan).from_state(model, plan, s, state))
            except (ValueError, TypeError, KeyError, AttributeError) as e:  # a malformed state, named
                raise ArtifactError(f"manifest.sets[{i}]: {e}") from e
        return out or None

    try:
        plan = Plan.resolve(config, model, spec)
    except ConfigError as e:  # a config this model or machine cannot take, as the artifact asks
        raise ArtifactError(f"manifest.config: {e}") from e
    planned = plan.shape_sets()  # what the module builds without a saved set (none, or a new shape)
    for sh in planned:
        try:  # held to the limits of a set read from disk
            ShapeRange.from_dict(sh.to_dict())
        except ValueError as e:
            raise ArtifactError(f"manifest.config plans an engine set beyond the limits: {e}") from e
    if config.device.startswith("cuda"):  # before the first call allocates a step's activations
        free = torch.cuda.mem_get_info(torch.device(config.device))[0]
        check_memory(shapes + planned, model, spec, free)
    compiled = assemble(model, plan, restore=restore, backends=backends)
    compiled.load_s = time.perf_counter() - t0
    logger.info("loaded %s in %.2f s", path, compiled.load_s)
    return compiled


def _import_ahead(manifest: dict[str, Any]) -> threading.Thread:
    """Start importing, in a thread, what this artifact's load and first call will import: the
    model's diffusers class, TensorRT's bindings (engines) and the kernel packages its attention may run
    (cuDNN's frontend, FlashAttention-4: seconds each). The weights are read and verified meanwhile
    (``fast_read``: few calls that let go of the GIL, each of which may wait for this thread); the load
    joins the thread before it imports anything itself (diffusers' lazy modules raise AttributeError
    when two threads import one class at once). A failure here only means the load imports it
    itself, and says why."""
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    model = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}

    def run() -> None:
        from ..ops import cudnn_attention, flash4_attention

        try:
            spec_of_class(model.get("class")).model_class()
            if config.get("backend") == "tensorrt" and torch.cuda.is_available():
                from ..backends.tensorrt import engine

                engine.bindings()  # TensorRT's bindings: the engines run without Torch-TensorRT
                kernel = config.get("attention_kernel")
                if kernel in ("auto", "cudnn"):
                    cudnn_attention.frontend()
                if kernel in ("auto", "flash4"):
                    flash4_attention.kernel()
        except Exception as e:  # what it could not import, the load imports again and reports
            logger.debug("importing ahead stopped: %s", e)

    thread = threading.Thread(target=run, name="prx-import-ahead", daemon=True)
    thread.start()
    return thread


#: an artifact's manifest: every field's shape, checked whole before the load reads any of it (the
#: parts marked Later are checked by their own readers, named)
_MANIFEST = schema.Dict(
    {
        **artifact.COMMON,
        "versions": schema.Map(schema.Str(64), schema.Str(200), max_len=64),
        "gpu": schema.OneOf(
            schema.Null(),
            schema.Dict(
                {"name": schema.Str(200), "capability": schema.Tuple(schema.Int(0, 99), schema.Int(0, 99))}
            ),
        ),
        "config": schema.Map(schema.Str(64), schema.Later("CompileConfig.from_dict"), max_len=256),
        "model": schema.Later("the record in weights.safetensors, which it must equal"),
        "lora": schema.OneOf(schema.Null(), schema.Later("lora.restore_state")),
        "sets": schema.List(
            schema.Dict({"shapes": schema.Later("ShapeRange.from_dict"), "state": artifact.STATE_RECORD}),
            max_len=256,
        ),
    }
)


def _config(m: dict[str, Any], device: str | torch.device | None, backend: str | None) -> CompileConfig:
    data = dict(field(m, "config", dict))
    data["engine_cache_dir"] = None  # an artifact never chooses where anything is written
    if device is not None:
        data["device"] = str(device)
    if backend is not None:
        data["backend"] = backend
    try:
        return CompileConfig.from_dict(data, source="manifest.config")
    except ConfigError as e:
        raise ArtifactError(f"manifest.config: {e}") from e
    except TypeError as e:  # non-string keys
        raise ArtifactError(f"manifest.config is malformed ({e}).") from e


_SMALL_INT = schema.Int(1, 1 << 16)


def _value_spec(key: str, default: Any, spec: ModelSpec) -> schema.Spec:
    """The schema of a model setting: the type its constructor default has (None: an int, ints, None);
    a depth at most what the spec allows (``size_keys``)."""
    if isinstance(default, bool):
        return schema.Bool()
    if isinstance(default, int):
        return schema.Int(1, spec.size_keys[key]) if key in spec.size_keys else _SMALL_INT
    if isinstance(default, float):
        return schema.Float(math.ulp(0.0), 1e9)  # positive, and no OverflowError downstream
    return schema.OneOf(schema.Null(), _SMALL_INT, schema.List(_SMALL_INT, max_len=16, min_len=1))


def _check_value(key: str, v: Any, default: Any, spec: ModelSpec) -> None:
    try:
        schema.check(_value_spec(key, default, spec), v, f"manifest.model.config.{key}")
    except schema.SchemaError as e:
        raise ArtifactError(f"manifest.model.config.{key}={excerpt(v, 60)} is not an allowed value.") from e


def _recorded(metadata: dict[str, str], key: str, rel: str) -> Any:
    """The JSON record a safetensors header holds under ``key``."""
    try:
        return json.loads(metadata[key])
    except (KeyError, TypeError, ValueError, RecursionError) as e:
        raise ArtifactError(f"{rel} has no valid {key} record in its header.") from e


def _load_model(
    reader: artifact.Reader, config: CompileConfig, weights: tuple[dict[str, torch.Tensor], dict[str, str]]
) -> tuple[torch.nn.Module, ModelSpec]:
    """The model (and its spec) from the class and config recorded in the weights file's header (the
    manifest holds a copy, which must match), with those weights (``weights``: its tensors and header
    metadata, as ``read_tensors`` returned them)."""
    state, meta = weights
    model_rec = _recorded(meta, "prx_compile.model", WEIGHTS)
    if model_rec != reader.manifest.get("model"):
        raise ArtifactError(f"manifest.model does not match the record in {WEIGHTS}.")
    try:
        spec = spec_of_class(field(model_rec, "class", str, "manifest.model"))
    except ConfigError as e:
        raise ArtifactError(f"manifest.model.class: {e}") from e
    cfg = field(model_rec, "config", dict, "manifest.model")
    params = spec.constructor_defaults()
    for key, v in cfg.items():
        if key not in params:
            raise ArtifactError(f"manifest.model.config.{str(key)[:40]} is not a {spec.class_name} setting.")
        _check_value(key, v, params[key], spec)
    try:
        model = spec.construct(cfg)
    except Exception as e:  # diffusers' own checks (e.g. heads not dividing the width)
        raise ArtifactError(f"manifest.model.config does not make a {spec.class_name}: {str(e)[:200]}") from e
    why = spec.config_problem(model.config)
    if why is not None:
        raise ArtifactError(f"manifest.model.config: {why}.")
    expected = model.state_dict()
    if set(state) != set(expected):
        extra, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
        raise ArtifactError(
            f"{WEIGHTS} does not fit the model config (extra {extra[:3]}, missing {missing[:3]})."
        )
    dtypes = {t.dtype for t in state.values()}
    want = config.torch_dtype()
    if len(dtypes) != 1 or not dtypes <= set(DTYPES.values()) or (want is not None and dtypes != {want}):
        raise ArtifactError(
            f"{WEIGHTS} holds {sorted(map(str, dtypes))}, expected one dtype ({config.dtype})."
        )
    for k, t in state.items():
        if t.shape != expected[k].shape:
            raise ArtifactError(
                f"{WEIGHTS}: {k} has shape {tuple(t.shape)}, "
                f"the model config says {tuple(expected[k].shape)}."
            )
    model.load_state_dict(state, strict=True, assign=True)
    return model.requires_grad_(False).eval(), spec


def check_compatible(m: dict[str, Any]) -> None:
    """Raise ArtifactError if the artifact's engines cannot run here (TensorRT version, GPU)."""
    saved_versions = field(m, "versions", dict)
    try:
        here = artifact.versions(True)
    except BackendUnavailableError as e:
        raise ArtifactError(
            f"the artifact holds TensorRT engines but they cannot run here: {e}",
            "load it on a GPU with Torch-TensorRT, or with backend='eager', device='cpu' "
            "(the engine sets are then rebuilt).",
        ) from e
    for key in ("tensorrt", "tensorrt_package"):
        if saved_versions.get(key) != here.get(key):
            raise ArtifactError(
                f"the engines were built with {key} {str(saved_versions.get(key))[:40]}, this machine has "
                f"{here.get(key)}.",
                "load with rebuild=True to rebuild from the saved weights.",
            )
    gpu = artifact.gpu()
    saved = m.get("gpu")
    if gpu is None:
        raise ArtifactError(
            "the artifact holds TensorRT engines but this machine has no CUDA GPU.",
            "load it on a GPU, or with backend='eager', device='cpu' (the engine sets are then rebuilt).",
        )
    if not isinstance(saved, dict) or saved.get("capability") != gpu["capability"]:
        cap = saved.get("capability") if isinstance(saved, dict) else None
        raise ArtifactError(
            f"the engines were built for compute capability {str(cap)[:20]}, this GPU is {gpu['capability']} "
            f"({gpu['name']}).",
            "load with rebuild=True to rebuild from the saved weights.",
        )


#: bytes of activations a step keeps per token and hidden channel, at the least (residual stream,
#: attention operands, the MLP's 3.5x wider hidden state)
ACTIVATION_FACTOR = 8


def check_memory(shapes: list[ShapeRange], model: torch.nn.Module, spec: ModelSpec, free_bytes: int) -> None:
    """ArtifactError when the largest step of an engine set needs more device memory for its
    activations (a lower bound) than ``free_bytes``: an artifact cannot make a first call allocate
    what the device does not have."""
    hidden = spec.width(model)
    elem = next(model.parameters()).element_size()
    for s in shapes:
        need = s.max_tokens() * hidden * elem * ACTIVATION_FACTOR
        if need > free_bytes:
            raise ArtifactError(
                f"engine set {s.describe()} needs at least {need / 2**30:.1f} GiB of device memory for a "
                f"step's activations, and {free_bytes / 2**30:.1f} GiB are free.",
                "load it on a larger GPU, or build engine sets for smaller shapes.",
            )


def _files_read(m: dict[str, Any]) -> set[str]:
    """The files ``load_compiled`` reads for manifest ``m``: the weights, the LoRA, and each engine
    set's blobs and constants as its record names them (a malformed record names none here; the load
    refuses it later)."""
    names = {WEIGHTS, LORA}
    records = m.get("sets")
    for i, rec in enumerate(records[:256] if isinstance(records, list) else []):
        state = rec.get("state") if isinstance(rec, dict) else None
        if not isinstance(state, dict):
            continue
        blobs = state.get("blobs")
        names |= {f"sets/{i}/{b}" for b in (blobs if isinstance(blobs, list) else []) if isinstance(b, str)}
        if state.get("tensors") is True:
            names.add(f"sets/{i}/tensors.safetensors")
    return names


def artifact_digest(path: str | os.PathLike) -> str:
    """``"sha256:<hex>"`` of the artifact at ``path``, its files verified first: what a publisher
    prints and a user passes to ``load_compiled(path, digest=...)``. It covers every file (the manifest
    it hashes lists each file's sha256)."""
    return artifact.open_artifact(path, kind=KIND, verify=True).digest


def inspect_artifact(path: str | os.PathLike, *, verify: bool = True) -> dict[str, Any]:
    """A summary of an artifact: versions, GPU, config, model, engine sets, LoRA, files. With
    ``verify``, every file is checked first (a damaged artifact raises ArtifactError). Fields of an
    unexpected type show as empty; ``load_compiled`` is what refuses them."""
    reader = artifact.open_artifact(path, kind=KIND, verify=verify)
    m = reader.manifest

    def mapping(d: Any, key: str) -> dict:
        v = d.get(key) if isinstance(d, dict) else None
        return v if isinstance(v, dict) else {}

    cfg = mapping(m, "config")
    sets = []
    records = m.get("sets")
    for rec in records if isinstance(records, list) else []:
        try:
            desc = ShapeRange.from_dict(rec.get("shapes") if isinstance(rec, dict) else None).describe()
        except ValueError:
            desc = "?"
        engines = mapping(mapping(rec, "state"), "meta").get("engines", {})
        sets.append({"shapes": desc, "engines": len(engines) if isinstance(engines, dict) else "?"})
    files = m["files"]
    return {
        "path": str(path),
        "digest": reader.digest,
        "format_version": m["format_version"],
        "created": str(m.get("created")),
        "versions": {k: str(v) for k, v in mapping(m, "versions").items()},
        "gpu": mapping(m, "gpu"),
        "backend": cfg.get("backend"),
        "attention": cfg.get("attention"),
        "weights": cfg.get("weights"),
        "precision": cfg.get("precision", "dtype"),
        "dtype": cfg.get("dtype"),
        "text_len": cfg.get("text_len"),
        "model": mapping(m, "model").get("class"),
        "engine_sets": sets,
        "lora": mapping(m, "lora") or None,
        "files": len(files),
        "bytes": sum(e["bytes"] for e in files.values()),
        "verified": verify,
    }
