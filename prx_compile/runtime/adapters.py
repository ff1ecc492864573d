"""diffusers' adapter methods on a compiled transformer, over prx_compile's LoRA.

A diffusers transformer takes its LoRA methods from PEFT (``PeftAdapterMixin``), and a pipeline's
``set_adapters``, ``disable_lora``, ``enable_lora``, ``delete_adapters`` and ``unload_lora_weights``
call them on ``pipe.transformer``. On a compiled transformer PEFT's would act on PEFT layers it does
not have: a silent no-op, with the LoRA still in the weights. Here they act on the adapters
``prx_compile.load_lora`` loaded, through the LoRA keeper registered on the transformer
(``follower.keepers``; this stage does not import ``lora``):

==========================================  ==================================================
diffusers (model or pipeline)               on a compiled transformer
==========================================  ==================================================
``set_adapters(names, weights)``            ``set_lora(compiled, names, weights)`` (a weight of
                                            None is 1.0; per-block weights are refused)
``set_adapter(name)``                       ``set_adapters([name])``
``disable_lora()``, ``disable_adapters()``  the base weights; the active adapters set aside
``enable_lora()``, ``enable_adapters()``    the adapters set aside, applied again
``delete_adapters(names)``                  ``unload_lora(compiled, names)``
``unload_lora()``                           ``unload_lora(compiled)``
``active_adapters()``, ``peft_config``      the active adapters; the loaded ones (keys)
``load_lora_adapter``, ``add_adapter``,     refused in one line: ``load_lora`` reads the same files
``load_lora_weights`` (a pipeline's)        into the weights the engines read
``fuse_lora``, ``unfuse_lora``,             refused in one line (the LoRA is in the weights
``save_lora_adapter``,                      already; unfusing it would need PEFT layers)
``enable_lora_hotswap``
==========================================  ==================================================

A pipeline's ``get_active_adapters`` looks for PEFT layers in the modules: it returns [] here.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, LoRAError
from .follower import keepers


class DiffusersAdapters:
    """The methods above, for ``CompiledTransformer`` (a base before the transformer's class)."""

    transformer: Any

    def _lora(self, verb: str, needed: bool = True) -> Any:
        """The transformer's LoRA keeper, if it holds adapters; else None, or (``needed``) a LoRAError."""
        keeper = keepers(self.transformer).get("lora")
        if keeper is not None and keeper.adapters():
            return keeper
        if needed:
            raise LoRAError(
                f"{verb}: no LoRA is loaded on this compiled transformer.",
                "load one with prx_compile.load_lora(pipe, file, name).",
            )
        return None

    def set_adapters(self, adapter_names: str | list[str], weights: Any = None) -> None:
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        weights = weights if isinstance(weights, list) else [weights] * len(names)
        if any(isinstance(w, dict) for w in weights):
            raise LoRAError(
                "set_adapters: per-block LoRA weights (a dict) are not supported on a compiled transformer.",
                "give one number per adapter.",
            )
        self._lora("set_adapters").set_adapters(self, names, [1.0 if w is None else w for w in weights])

    def set_adapter(self, adapter_name: str | list[str]) -> None:
        self.set_adapters(adapter_name)

    def disable_lora(self) -> None:
        keeper = self._lora("disable_lora", needed=False)
        if keeper is not None:
            keeper.disable(self)

    def enable_lora(self) -> None:
        keeper = self._lora("enable_lora", needed=False)
        if keeper is not None:
            keeper.enable(self)

    disable_adapters = disable_lora
    enable_adapters = enable_lora

    def delete_adapters(self, adapter_names: str | list[str]) -> None:
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        self._lora("delete_adapters").delete(self, names)

    def unload_lora(self) -> None:
        keeper = self._lora("unload_lora", needed=False)
        if keeper is not None:
            keeper.delete(self, list(keeper.adapters()))

    def active_adapters(self) -> list[str]:
        keeper = self._lora("active_adapters", needed=False)
        return list(keeper.active()) if keeper is not None else []

    @property
    def peft_config(self) -> dict[str, Any]:
        """The loaded adapters by name (where each came from), as diffusers' ``get_list_adapters`` reads
        the keys; no attribute without one, as on a transformer without adapters."""
        keeper = self._lora("peft_config", needed=False)
        if keeper is None:
            raise AttributeError("peft_config")
        return {n: {"source": src} for n, src in keeper.adapters().items()}

    def load_lora_adapter(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError(
            "diffusers' load_lora_weights / load_lora_adapter would add PEFT layers, which a compiled "
            "transformer's engines never call.",
            "use prx_compile.load_lora(pipe, file, name): the same files (diffusers', PEFT's, kohya's), "
            "written into the weights the engines read; then pipe.set_adapters works as usual.",
        )

    add_adapter = load_lora_adapter

    def fuse_lora(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError(
            "fuse_lora / unfuse_lora / save_lora_adapter / enable_lora_hotswap: a compiled transformer's "
            "LoRA is in its weights already (nothing to fuse, and no PEFT layers to unfuse or save).",
            "set_adapters / unload_lora switch it; pipe.save_pretrained saves the weights with it applied.",
        )

    unfuse_lora = save_lora_adapter = enable_lora_hotswap = fuse_lora
