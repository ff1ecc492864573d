"""Every Torch-TensorRT / TensorRT API difference this project depends on, in one place.

Checked against Torch-TensorRT 2.11 (and its TensorRT-RTX build), with the changes of 2.12-2.14 read
from their sources: ``use_weight_map_cache`` and ``PythonTorchTensorRTModule`` are gone in 2.13,
``enabled_precisions``/``use_explicit_typing`` were removed from ``dynamo.compile``.
torch_tensorrt is imported lazily, here only.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch

from ..errors import BackendUnavailableError

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "install it on a machine with an NVIDIA GPU: pip install 'prx_compile[tensorrt]' "
    "(or 'prx_compile[tensorrt-rtx]'); or use backend='inductor' or 'eager'."
)


@functools.lru_cache(maxsize=1)
def torch_tensorrt():
    """The torch_tensorrt module, or BackendUnavailableError saying how to get it."""
    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            "backend='tensorrt' needs a CUDA GPU, and torch sees none.", INSTALL_HINT
        )
    try:
        import torch_tensorrt as ttrt
    except Exception as e:  # ImportError, or OSError when TensorRT's libraries are missing
        raise BackendUnavailableError(
            f"backend='tensorrt' needs Torch-TensorRT, which cannot be "
            f"imported here ({type(e).__name__}: {e}).",
            INSTALL_HINT,
        ) from e
    return ttrt


def trt():
    torch_tensorrt()  # installs the TensorRT (or TensorRT-RTX) proxy module as ``tensorrt``
    import tensorrt

    return tensorrt


def versions() -> dict[str, str]:
    ttrt, t = torch_tensorrt(), trt()
    return {
        "torch_tensorrt": getattr(ttrt, "__version__", "?"),
        "tensorrt": getattr(t, "__version__", "?"),
        "tensorrt_package": getattr(ttrt, "tensorrt_package_name", "") or "tensorrt",
    }


def compile_kwargs(**wanted: Any) -> dict[str, Any]:
    """``wanted`` minus the keys this Torch-TensorRT's ``dynamo.compile`` does not know."""
    params = inspect.signature(torch_tensorrt().dynamo.compile).parameters
    kept = {k: v for k, v in wanted.items() if k in params}
    dropped = sorted(set(wanted) - set(kept))
    if dropped:
        logger.debug(
            "Torch-TensorRT %s has no setting(s) %s: left out", versions()["torch_tensorrt"], dropped
        )
    return kept


def engine_classes() -> tuple[type, ...]:
    rt = torch_tensorrt().dynamo.runtime
    return tuple(
        c
        for c in (getattr(rt, "TorchTensorRTModule", None), getattr(rt, "PythonTorchTensorRTModule", None))
        if c is not None
    )


def engine_modules(gm: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every TensorRT engine child of a compiled GraphModule."""
    classes = engine_classes()
    return [(n, m) for n, m in gm.named_children() if isinstance(m, classes)]


def torch_segments(gm: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every PyTorch-executed partition (``_run_on_gpu_*``)."""
    return [(n, m) for n, m in gm.named_children() if n.startswith("_run_on_gpu")]


def live_engine(module: torch.nn.Module):
    """The module's ``trt.ICudaEngine`` if the runtime keeps one in Python (Python runtime), else None."""
    engine = getattr(module, "engine", None)
    return engine if engine is not None and hasattr(engine, "num_io_tensors") else None


def weight_name_map(module: torch.nn.Module) -> dict[str, Any]:
    """engine weight name -> [state-dict key, dtype], as Torch-TensorRT recorded it at build."""
    wmap = getattr(module, "weight_name_map", None)
    if wmap is None and hasattr(module, "engine") and hasattr(module.engine, "__getstate__"):
        from torch_tensorrt.dynamo.runtime._TorchTensorRTModule import SERIALIZED_METADATA_IDX

        meta = module.decode_metadata(module.engine.__getstate__()[0][SERIALIZED_METADATA_IDX])
        wmap = meta.get("weight_name_map")
    return {k: v for k, v in (wmap or {}).items() if k != "constant_mapping"}


def engine_bytes(module: torch.nn.Module) -> bytes:
    """The serialized engine, including weights changed by refits since the build."""
    engine = live_engine(module)
    return engine_bytes_from(engine) if engine is not None else bytes(module.serialized_engine)


def refit_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Refit the named engine weights of one engine module in place (others keep their values).

    weights: engine weight name -> flat contiguous CUDA tensor in the engine's dtype.
    Python runtime: the live engine is refit. C++ runtime: the engine is deserialized, refit,
    serialized and set up again (slower, same result).
    """
    t = trt()
    from torch_tensorrt.logging import TRT_LOGGER

    engine = live_engine(module)
    live = engine is not None
    if not live:
        engine = t.Runtime(TRT_LOGGER).deserialize_cuda_engine(bytes(module.serialized_engine))
    refitter = t.Refitter(engine, TRT_LOGGER)
    for name, w in weights.items():
        tw = t.Weights(_trt_dtype(w.dtype), w.data_ptr(), w.numel())
        if not refitter.set_named_weights(name, tw, t.TensorLocation.DEVICE):
            raise RuntimeError(f"TensorRT refused new values for engine weight {name!r}")
    missing = list(refitter.get_missing_weights())
    if missing:
        raise RuntimeError(f"TensorRT needs these weights refit together: {missing[:5]} ...")
    if not refitter.refit_cuda_engine():
        raise RuntimeError("TensorRT refit_cuda_engine() failed")
    torch.cuda.synchronize()
    if not live:
        module.engine = None
        module.serialized_engine = engine_bytes_from(engine)
        module.setup_engine()


def engine_bytes_from(engine) -> bytes:
    t = trt()
    cfg = engine.create_serialization_config()
    if hasattr(t.SerializationFlag, "EXCLUDE_WEIGHTS"):
        cfg.clear_flag(t.SerializationFlag.EXCLUDE_WEIGHTS)
    if hasattr(t.SerializationFlag, "INCLUDE_REFIT"):
        cfg.set_flag(t.SerializationFlag.INCLUDE_REFIT)
    return bytes(engine.serialize_with_config(cfg))


def torch_dtype_of(weight_dtype: Any) -> torch.dtype:
    """Torch dtype for the dtype a weight_name_map stores (numpy dtype or torch dtype)."""
    from torch_tensorrt._enums import dtype as ttrt_dtype

    return ttrt_dtype._from(weight_dtype).to(torch.dtype)


def _trt_dtype(d: torch.dtype):
    t = trt()
    return {
        torch.float32: t.float32,
        torch.float16: t.float16,
        torch.bfloat16: t.bfloat16,
        torch.int32: t.int32,
        torch.int8: t.int8,
        torch.bool: t.bool,
    }[d]


def full_refit(mttm) -> None:
    """Torch-TensorRT's own refit of every engine from ``mttm.original_model`` (re-lowers the graph)."""
    mttm.refit_gm()


def engine_io(module: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(input binding names, output binding names) of an engine module, whatever its runtime."""
    ins = getattr(module, "input_names", None) or getattr(module, "input_binding_names", None) or []
    outs = getattr(module, "output_names", None) or getattr(module, "output_binding_names", None) or []
    return list(ins), list(outs)


def engine_record(module: torch.nn.Module) -> dict[str, Any]:
    """JSON-able facts needed to recreate an engine module from its bytes (no pickle)."""
    ins, outs = engine_io(module)
    wmap = {k: [v[0], str(v[1])] for k, v in weight_name_map(module).items()}
    exprs = getattr(module, "symbolic_shape_expressions", None)
    return {
        "input_names": ins,
        "output_names": outs,
        "weight_name_map": wmap,
        "requires_output_allocator": bool(getattr(module, "requires_output_allocator", False)),
        "symbolic_shape_expressions": exprs if _json_able(exprs) else None,
        "outputs_unowned": bool(getattr(module, "output_tensors_are_unowned", False)),
        "runtime": "python" if live_engine(module) is not None else "cpp",
    }


def _json_able(x: Any) -> bool:
    import json

    try:
        json.dumps(x)
        return True
    except TypeError:
        return False


def make_engine_module(serialized: bytes, record: dict[str, Any], name: str, device: torch.device):
    """An engine module (Python or C++ runtime, as recorded) around serialized engine bytes."""
    ttrt = torch_tensorrt()
    from torch_tensorrt.dynamo import CompilationSettings
    from torch_tensorrt.dynamo.utils import to_torch_tensorrt_device

    rt = ttrt.dynamo.runtime
    cls = getattr(rt, "PythonTorchTensorRTModule", None) if record["runtime"] == "python" else None
    cls = cls or rt.TorchTensorRTModule
    wmap = {k: [v[0], _dtype_from_str(v[1])] for k, v in record["weight_name_map"].items()}
    kwargs = {
        "name": name,
        "settings": CompilationSettings(device=to_torch_tensorrt_device(device)),
        "weight_name_map": wmap,
        "requires_output_allocator": record["requires_output_allocator"],
        "symbolic_shape_expressions": record["symbolic_shape_expressions"],
    }
    params = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in params}
    module = cls(serialized, record["input_names"], record["output_names"], **kwargs)
    if record.get("outputs_unowned") and hasattr(module, "set_output_tensors_as_unowned"):
        module.set_output_tensors_as_unowned(True)
    if not hasattr(module, "weight_name_map") or module.weight_name_map is None:
        module.weight_name_map = wmap
    return module


def _dtype_from_str(name: str):
    """'torch.bfloat16' -> torch.bfloat16; 'float32' (numpy) -> numpy.float32 dtype."""
    if name.startswith("torch."):
        return getattr(torch, name.split(".", 1)[1])
    import numpy as np

    return np.dtype(name)
