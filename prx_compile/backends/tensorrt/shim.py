"""Every Torch-TensorRT API this project depends on, in one place: what builds the engines.

Checked against Torch-TensorRT 2.11 (and its TensorRT-RTX build), with the changes of 2.12-2.14 read
from their sources: ``use_explicit_typing`` was removed from ``dynamo.compile`` (explicit typing is
the default), ``PythonTorchTensorRTModule`` is gone in 2.13. torch_tensorrt is imported lazily, here,
and only to build: the engines run through TensorRT's own bindings (``engine``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ...errors import BackendUnavailableError
from . import engine
from .engine import INSTALL_HINT

logger = logging.getLogger(__name__)

#: the Torch-TensorRT line this release is checked against ([first, last) of major.minor), and the
#: environment variable that lets a user try another one anyway, at their own risk
CHECKED = ((2, 11), (2, 12))
UNCHECKED_ENV = "PRX_COMPILE_UNCHECKED_TORCH_TENSORRT"
PACKAGES = ("torch-tensorrt", "torch-tensorrt-rtx")


def installed_version() -> tuple[str, str] | None:
    """(package, version) of the installed Torch-TensorRT distribution (either build), read from its
    metadata without importing it; None when neither is installed."""
    from importlib import metadata

    for name in PACKAGES:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_version(found: tuple[str, str] | None = None) -> None:
    """BackendUnavailableError, in one line naming the installed and the checked versions and the pip
    command, when the installed Torch-TensorRT is outside ``CHECKED`` (its runtime classes and
    settings changed in 2.13 and 2.14); ``$PRX_COMPILE_UNCHECKED_TORCH_TENSORRT=1`` skips the check."""
    found = found if found is not None else installed_version()
    if found is None or os.environ.get(UNCHECKED_ENV, "").strip() == "1":
        return
    name, version = found
    parts = re.match(r"(\d+)\.(\d+)", version)
    mm = (int(parts[1]), int(parts[2])) if parts else None
    lo, hi = CHECKED
    if mm is not None and lo <= mm < hi:
        return
    checked = f"{lo[0]}.{lo[1]}"
    raise BackendUnavailableError(
        f"{name} {version} is installed; this prx_compile is checked against Torch-TensorRT {checked} "
        f"(with torch {checked}) only.",
        f"pip install '{name}>={checked},<{hi[0]}.{hi[1]}' 'torch>={checked},<{hi[0]}.{hi[1]}' "
        f"(or pip install 'prx_compile[tensorrt]'); to try {version} anyway, at your own risk, set "
        f"{UNCHECKED_ENV}=1.",
    )


@functools.lru_cache(maxsize=1)
def torch_tensorrt():
    """The torch_tensorrt module, or BackendUnavailableError saying how to get it (also for a
    Torch-TensorRT outside the checked line: ``check_version``)."""
    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            "backend='tensorrt' needs a CUDA GPU, and torch sees none.", INSTALL_HINT
        )
    check_version()
    try:
        import torch_tensorrt as ttrt
    except Exception as e:  # ImportError, or OSError when TensorRT's libraries are missing
        raise BackendUnavailableError(
            f"backend='tensorrt' needs Torch-TensorRT, which cannot be imported here "
            f"({type(e).__name__}: {e}).",
            INSTALL_HINT,
        ) from e
    return ttrt


def versions() -> dict[str, str]:
    """Torch-TensorRT's version (from its metadata: nothing is imported) and the TensorRT that runs
    the engines (``engine.versions``)."""
    runs = engine.versions()  # first: BackendUnavailableError without a GPU, before any file is read
    found = installed_version()
    return {"torch_tensorrt": found[1] if found else "?", **runs}


def compile_settings(
    required: dict[str, Any], optional: dict[str, Any], compile_fn: Any = None
) -> dict[str, Any]:
    """Keyword arguments for ``torch_tensorrt.dynamo.compile``.

    required: settings correctness depends on; one this Torch-TensorRT does not take raises
        BackendUnavailableError naming it. optional: left out (logged) where unknown.
    """
    fn = compile_fn or torch_tensorrt().dynamo.compile
    params = inspect.signature(fn).parameters
    missing = sorted(k for k in required if k not in params)
    if missing:
        raise BackendUnavailableError(
            f"this Torch-TensorRT ({getattr(torch_tensorrt(), '__version__', '?')}) has no setting(s) "
            f"{missing}, which compile_prx needs to be correct.",
            "install Torch-TensorRT 2.11 (the version this release is checked against).",
        )
    dropped = sorted(k for k in optional if k not in params)
    if dropped:
        logger.info("Torch-TensorRT has no setting(s) %s: left at their defaults", dropped)
    return {**required, **{k: v for k, v in optional.items() if k in params}}


@contextlib.contextmanager
def lowering_passes(passes: list[Any]) -> Iterator[None]:
    """Within the block, ``passes`` (functions ``(gm, settings) -> gm``) run after Torch-TensorRT's
    own post-lowering passes: added with its registration API (``_aten_lowering_pass``) and removed
    with ``_remove_lowering_pass`` when the block ends."""
    torch_tensorrt()
    from torch_tensorrt.dynamo.lowering.passes import _aten_lowering_pass as registry

    for fn in passes:
        registry._aten_lowering_pass(fn)
    try:
        yield
    finally:
        for fn in passes:
            registered = registry.ATEN_POST_LOWERING_PASSES.passes
            if fn in registered:
                registry._remove_lowering_pass(index=registered.index(fn))


def engine_record(module: torch.nn.Module) -> dict[str, Any]:
    """What an ``engine.Engine`` is made from, read from the module Torch-TensorRT's converter
    returned: its bindings' names, its weight_name_map (engine weight name -> [state-dict key,
    dtype name]) and whether it needs an output allocator."""
    wmap = getattr(module, "weight_name_map", None) or {}
    return {
        "inputs": list(module.input_names),
        "outputs": list(module.output_names),
        "weight_name_map": {k: [v[0], str(v[1])] for k, v in wmap.items() if k != "constant_mapping"},
        "requires_output_allocator": bool(getattr(module, "requires_output_allocator", False)),
        "outputs_unowned": False,
    }


@contextlib.contextmanager
def building(wrap: Any, release_memory: bool = True) -> Iterator[None]:
    """Within the block (one ``torch_tensorrt.dynamo.compile``; one build at a time, a lock):

    * each partition is converted by ``wrap(convert_module)`` (e.g. ``repeats.SharedEngines().wrap``)
      instead of Torch-TensorRT's own ``convert_module``: 2.11's ``compile_module`` calls the name it
      imported, once per partition, and sets what it returns as that partition's child;
    * a ``torch_tensorrt.Input`` made without a tensor gets zeros broadcast from one element as its
      example instead of ``torch.rand`` of its whole shape on the CPU. Torch-TensorRT makes one per
      input of every partition (with weights as inputs: every weight, again for each partition):
      14.3 s of a 1.17 B-parameter build on the H200 (``profile_build_h200.txt``). The examples give
      shapes and dtypes; the one place 2.11 runs a partition on them (``repair_double_inputs``, for
      float64 inputs) reads its output's dtype only;
    * ``repair_double_inputs`` (``truncate_double``) returns at once for a partition with no float64
      input, as 2.11's does after moving every input's example to the GPU first (with weights as
      inputs: every weight, for each partition: ~2 s of the range set's first call, under a
      sampler, in ``profile_build_v10_range_h200.txt``);
    * with ``release_memory=False``, the ``gc.collect()`` + device sync + ``empty_cache`` that 2.11
      runs after each engine's conversion (``release_host_and_device_memory``, to free the host
      copies of weights an engine holds) is skipped: with weights as engine inputs an engine holds
      none, and the collection cost 0.44 s per engine on the H200, holding the GIL that the other
      conversions need (``profile_build_range_h200.txt``)."""
    torch_tensorrt()
    from torch_tensorrt._Input import Input
    from torch_tensorrt.dynamo import _compiler
    from torch_tensorrt.dynamo.conversion import _conversion

    with _CONVERT_LOCK:
        original, example = _compiler.convert_module, Input.example_tensor
        release = getattr(_conversion, "release_host_and_device_memory", None)
        repair = getattr(_compiler, "repair_double_inputs", None)
        _compiler.convert_module = wrap(original)
        Input.example_tensor = _zeros_example
        if release is not None and not release_memory:
            _conversion.release_host_and_device_memory = _keep_memory
        if repair is not None:
            _compiler.repair_double_inputs = _only_doubles(repair)
        try:
            yield
        finally:
            _compiler.convert_module, Input.example_tensor = original, example
            if release is not None:
                _conversion.release_host_and_device_memory = release
            if repair is not None:
                _compiler.repair_double_inputs = repair


def _only_doubles(repair: Any) -> Any:
    """``repair_double_inputs`` run only for a partition with a float64 input (the others it returns
    unchanged, as 2.11's does, without making their examples on the device first)."""

    def run(parent: Any, submodule: Any, inputs: Any, device: Any, name: str | None = None) -> Any:
        if not any(is_float64(i) for i in inputs):
            return inputs
        return repair(parent, submodule, inputs, device, name)

    return run


def is_float64(inp: Any) -> bool:
    """Whether a ``torch_tensorrt.Input`` is a float64 tensor (a shape tensor is not)."""
    if getattr(inp, "is_shape_tensor", False):
        return False
    return inp.dtype.to(torch.dtype, use_default=True) == torch.float64


def decompositions(settings: dict[str, Any]) -> dict[Any, Any]:
    """The decomposition table ``torch_tensorrt.dynamo.compile`` applies for ``settings``."""
    torch_tensorrt()
    from torch_tensorrt.dynamo.lowering import get_decompositions

    params = inspect.signature(get_decompositions).parameters
    options = {"enable_experimental_decompositions": False, "decompose_attention": False}
    kwargs = {k: settings.get(k, v) for k, v in options.items() if k in params}
    return get_decompositions(**kwargs)


@contextlib.contextmanager
def decomposed(ep: Any) -> Iterator[None]:
    """Within the block, ``ep.run_decompositions(...)`` returns ``ep``: for a program already
    decomposed with ``decompositions(settings)`` (``dynamo.compile`` would trace it once more, the
    same way: ~7 s of the range set's first call, under a sampler, in
    ``profile_build_v10_range_h200.txt``)."""
    ep.run_decompositions = lambda *args, **kwargs: ep  # shadows the method, on this instance only
    try:
        yield
    finally:
        del ep.run_decompositions


def _keep_memory() -> None:
    """Stands in for Torch-TensorRT's ``release_host_and_device_memory`` during a build (``building``)."""


def _zeros_example(self: Any, optimization_profile_field: str | None = None) -> torch.Tensor:
    """``Input.example_tensor`` of 2.11 (the shape it picks), as zeros broadcast from one element."""
    shape = self.shape
    if isinstance(shape, dict):
        shape = shape[optimization_profile_field or "opt_shape"]
    return torch.zeros((), dtype=self.dtype.to(torch.dtype, use_default=True)).expand(tuple(shape))


_CONVERT_LOCK = threading.Lock()


def as_engines(convert: Any, arena: engine.DeviceArena | None = None) -> Any:
    """``convert`` (Torch-TensorRT's ``convert_module``) returning an ``engine.Engine`` (one execution
    context, with an empty TensorRT-RTX runtime cache, on ``arena``'s memory) in place of
    Torch-TensorRT's module. Where Torch-TensorRT has ``lazy_engine_init`` (2.11) its module never
    deserialises the engine; without it, it makes a context of its own first (compiling the
    engine's kernels once more, on TensorRT-RTX), which is dropped."""
    from torch_tensorrt.dynamo import CompilationSettings

    lazy = "lazy_engine_init" in {f.name for f in dataclasses.fields(CompilationSettings)}

    def run(module: Any, inputs: Any, *args: Any, settings: Any, **kwargs: Any) -> engine.Engine:
        if lazy:  # Torch-TensorRT's own settings stay as they are
            settings = dataclasses.replace(settings, lazy_engine_init=True)
        built = convert(module, inputs, *args, settings=settings, **kwargs)
        name = str(kwargs.get("name", getattr(built, "name", "engine")))
        gpu = getattr(getattr(settings, "device", None), "gpu_id", None)  # the build's device
        if not isinstance(gpu, int) or gpu < 0:
            gpu = torch.cuda.current_device()
        device = torch.device("cuda", gpu)
        return engine.Engine(bytes(built.serialized_engine), engine_record(built), name, device, None, arena)

    return run
