"""diffusers' LoRA methods on a compiled transformer, over prx_compile's LoRA.

A diffusers transformer takes its LoRA methods from PEFT (``PeftAdapterMixin``), and a pipeline's
``load_lora_weights``, ``set_adapters``, ``disable_lora``, ``enable_lora``, ``delete_adapters`` and
``unload_lora_weights`` call them on ``pipe.transformer``. On a compiled transformer PEFT's would add
or act on PEFT layers, which its engines never call: 0.27 refused the first call after a load, and
took the others silently, the LoRA staying in the weights. ``CompiledTransformer`` takes these
instead (``DiffusersLoRA``, a base before the transformer's class); they act on prx_compile's
adapters (``lora.adapters``), with PEFT's meaning:

===========================================  ==============================================
diffusers (model; a pipeline's call them)    on a compiled transformer
===========================================  ==============================================
``load_lora_adapter`` (``load_lora_weights``)  ``load_lora``, the new adapter alone active at
                                             1.0, or set aside while disabled (diffusers'
                                             conversion of the file comes first; its
                                             ``<prefix>.`` keys only; alpha from its
                                             ``network_alphas`` or ``metadata``); a local
                                             path or a state dict
``set_adapters(names, weights)``             ``set_lora`` (a weight of None is 1.0; per-block
                                             weights are refused)
``set_adapter(name)``                        ``set_adapters([name])``
``disable_lora``, ``disable_adapters``       the base weights; the active adapters set aside
``enable_lora``, ``enable_adapters``         the adapters set aside, applied again
``delete_adapters(names)``                   ``unload_lora(compiled, names)`` for the names
                                             loaded; then, as PEFT, when an active one went
                                             and none is left active, the first left by
                                             name is, at the scale it last had
``unload_lora``                              ``unload_lora(compiled)``
``active_adapters()``, ``peft_config``       the active adapters (disabled too); the loaded ones
``fuse_lora``, ``unfuse_lora``,              refused in one line (the LoRA is in the weights
``save_lora_adapter``, ``add_adapter``,      already; no PEFT layers or configs to fuse,
``enable_lora_hotswap``, ``hotswap=True``    unfuse, save, add or swap; a pipeline's
                                             ``unfuse_lora`` calls none of them: it does
                                             nothing)
``fuse_qkv_projections``                     diffusers', refused while a LoRA is loaded (the
                                             fused layers would copy its share as their base)
===========================================  ==============================================

A pipeline's ``get_active_adapters`` looks for PEFT layers in the modules: it returns [] here
(``pipe.transformer.active_adapters()`` tells).
"""

from __future__ import annotations

import collections
import logging
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, LoRAError, excerpt
from . import adapters as lora

logger = logging.getLogger(__name__)

#: diffusers' loading arguments that only say where to download from: nothing is downloaded here
_HUB_ARGS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")


class DiffusersLoRA:
    """The methods above, for ``CompiledTransformer``."""

    def _loaded(self, verb: str) -> dict[str, str]:
        names = lora.loaded(self)
        if not names:
            raise LoRAError(
                f"{verb}: no LoRA is loaded on this compiled transformer.",
                "load one with pipe.load_lora_weights(file) or prx_compile.load_lora(pipe, file, name).",
            )
        return names

    def load_lora_adapter(
        self,
        pretrained_model_name_or_path_or_dict: Any,
        prefix: str | None = "transformer",
        hotswap: bool = False,
        **kwargs: Any,
    ) -> None:
        """A LoRA as diffusers' ``load_lora_weights`` hands it over (its keys ``<prefix>.<module>...``
        in diffusers' layout, with ``network_alphas`` / ``metadata``), or a local file or folder."""
        if hotswap:
            raise ConfigError(
                "hotswap: a compiled transformer's LoRA switches in place without it.",
                "load the new LoRA under another adapter_name and set_adapters to it.",
            )
        name = kwargs.pop("adapter_name", None)
        alphas, metadata = kwargs.pop("network_alphas", None), kwargs.pop("metadata", None)
        weight_name = kwargs.pop("weight_name", None)
        for arg in ("_pipeline", "low_cpu_mem_usage", "adapter_config", *_HUB_ARGS):
            kwargs.pop(arg, None)
        if kwargs:
            raise ConfigError(f"load_lora_adapter: unknown arguments {sorted(kwargs)[:5]}.")
        if metadata is not None and not isinstance(metadata, dict):
            raise LoRAError(
                f"load_lora_adapter: metadata (the file's lora_adapter_metadata) is a "
                f"{type(metadata).__name__}, not a JSON object."
            )
        if alphas and metadata:
            raise ConfigError(
                "load_lora_adapter: network_alphas and metadata cannot both be given (as diffusers)."
            )
        src = pretrained_model_name_or_path_or_dict
        config = None
        if isinstance(src, dict):
            state = dict(src)
        elif not isinstance(src, (str, os.PathLike)):
            raise LoRAError(
                f"load_lora_adapter takes a state dict or a local path, not a {type(src).__name__}."
            )
        else:
            path = Path(src) / weight_name if weight_name else Path(src)
            if not path.exists():
                raise LoRAError(f"{path} is not a local LoRA file or folder (nothing is downloaded).")
            state, config = lora.read_lora_file(path)
        if prefix is not None:  # as diffusers: only this component's keys, and its part of the metadata
            state = {k.removeprefix(f"{prefix}."): v for k, v in state.items() if k.startswith(f"{prefix}.")}
            metadata = {
                k.removeprefix(f"{prefix}."): v
                for k, v in (metadata or {}).items()
                if k.startswith(f"{prefix}.")
            }
        if not state:  # a LoRA of the text encoders only: theirs to load (diffusers says the same)
            logger.warning("no LoRA keys for the transformer with prefix %r: nothing loaded into it", prefix)
            return
        # as diffusers: alpha only from network_alphas or metadata (its loader leaves .alpha keys unread)
        state = {k: v for k, v in state.items() if not k.endswith(".alpha")}
        if alphas:
            state.update(_alpha_tensors(state, alphas, prefix))
        if metadata:
            config = lora.config_scale(metadata, "load_lora_adapter: metadata")
        if name is None:
            taken = lora.loaded(self)  # diffusers' default_<number of adapters>, the next free one
            free = (f"default_{i}" for i in range(len(taken), 2 * len(taken) + 1))
            name = next(n for n in free if n not in taken)
        report = lora.load(self, state, name, config=config, alone=True, strict=False)
        if report["unmatched"]:  # as PEFT: keys of layers this model lacks are left out, with a warning
            logger.warning(
                "LoRA %r: %d key(s) match no Linear layer of the transformer and were left out, e.g. %s",
                name,
                len(report["unmatched"]),
                [excerpt(k, 80) for k in report["unmatched"][:3]],
            )

    def set_adapters(self, adapter_names: str | list[str], weights: Any = None) -> None:
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        weights = weights if isinstance(weights, list) else [weights] * len(names)
        if any(isinstance(w, dict) for w in weights):
            raise LoRAError(
                "set_adapters: per-block LoRA weights (a dict) are not supported on a compiled transformer.",
                "give one number per adapter.",
            )
        if len(set(names)) != len(names):
            raise LoRAError(f"set_adapters: an adapter is named twice in {names[:10]}.")
        self._loaded("set_adapters")
        lora.set_adapters(self, names, [1.0 if w is None else _number(w) for w in weights])

    def set_adapter(self, adapter_name: str | list[str]) -> None:
        self.set_adapters(adapter_name)

    def disable_lora(self) -> None:
        lora.disable_lora(self)

    def enable_lora(self) -> None:
        lora.enable_lora(self)

    disable_adapters = disable_lora
    enable_adapters = enable_lora

    def delete_adapters(self, adapter_names: str | list[str]) -> None:
        """Names not loaded here are passed over, as PEFT does (a pipeline names the text encoders' too)."""
        lora.delete_adapters(self, [adapter_names] if isinstance(adapter_names, str) else list(adapter_names))

    def unload_lora(self) -> None:
        if lora.loaded(self):
            lora.unload_lora(self)

    def active_adapters(self) -> list[str]:
        """The active adapters (while disabled, as PEFT: those ``enable_lora`` will apply)."""
        return list(lora.active(self, set_aside=True))

    @property
    def peft_config(self) -> dict[str, Any]:
        """The loaded adapters by name (where each came from), as diffusers' ``get_list_adapters`` reads
        the keys; no attribute without one, as on a transformer without adapters."""
        names = lora.loaded(self)
        if not names:
            raise AttributeError("peft_config")
        return {n: {"source": src} for n, src in names.items()}

    def fuse_lora(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError(
            "fuse_lora / unfuse_lora / save_lora_adapter / add_adapter / enable_lora_hotswap: a compiled "
            "transformer's LoRA is in its weights already (no PEFT layers or configs to fuse, unfuse, save, "
            "add or swap).",
            "set_adapters / unload_lora switch it; pipe.save_pretrained saves the weights with it applied.",
        )

    unfuse_lora = save_lora_adapter = add_adapter = enable_lora_hotswap = fuse_lora

    def fuse_qkv_projections(self) -> None:
        """diffusers' (each attention's q/k/v weights copied into one new layer); refused while a LoRA
        is loaded: the copy would take the LoRA's share as the new layer's base, which no LoRA
        operation could take out again."""
        if lora.loaded(self):
            raise LoRAError(
                "fuse_qkv_projections: a LoRA is loaded, and the fused layers would copy its share into "
                "their base weights (unload_lora could not take it out).",
                "unload_lora first (a LoRA loaded after the fusion changes q/k/v layers the fused "
                "attention no longer reads, as in eager diffusers).",
            )
        self.transformer.fuse_qkv_projections()


def _number(value: Any) -> Any:
    """A Python number for a NumPy scalar or a one-element tensor (PEFT takes them); anything else as it
    is, for ``set_lora``'s check to name."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value
    return value.item() if type(value).__module__ == "numpy" and getattr(value, "size", 0) == 1 else value


def _alpha_tensors(
    state: dict[str, Any], alphas: dict[str, Any], prefix: str | None
) -> dict[str, torch.Tensor]:
    """diffusers' ``network_alphas`` (``<prefix>.<module>.alpha`` or ``...lora_A.alpha`` -> a number) as
    the ``<module>.alpha`` tensors ``parse_lora`` reads; a layer of ``state`` without one gets the most
    common alpha, as diffusers' ``get_peft_kwargs`` makes it the config's ``lora_alpha``."""
    found: dict[str, float] = {}
    for key, value in alphas.items():
        if prefix is not None and not key.startswith(f"{prefix}."):
            continue
        if isinstance(value, bool) or not isinstance(_number(value), (int, float)):
            raise LoRAError(f"network_alphas[{key[:80]!r}] is not a number.")
        key = key.removeprefix(f"{prefix}.") if prefix is not None else key
        found[key.removesuffix(".alpha").split(".lora_A")[0].split(".lora_down")[0]] = float(_number(value))
    if not found:
        return {}
    common = collections.Counter(found.values()).most_common(1)[0][0]
    modules = {k.split(".lora_A")[0] for k in state if ".lora_A" in k}
    return {
        f"{m}.alpha": torch.tensor([found.get(m, common)], dtype=torch.float64) for m in {*found, *modules}
    }
