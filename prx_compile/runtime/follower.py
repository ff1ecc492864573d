"""``ChangeFollower``: the one place that decides what a change of the transformer costs.

Whatever changes the transformer between two calls is followed before the next one (``follow``):

==================================================  ============================================
change                                              what it costs
==================================================  ============================================
a weight edited in place (``copy_``,                nothing with ``weights: inputs`` (the engines
``load_state_dict``, a LoRA)                        read it); a refit of the engines that hold it
                                                    with ``weights: engine``; its FP8 copy
                                                    re-quantised with ``precision: fp8``
a weight a LoRA changed, edited by anything else    the edit is the weight's new base value and the
                                                    active LoRAs are applied over it again (as PEFT
                                                    keeps an adapter beside its base layer)
a submodule swapped for one of the same structure   re-bound (``weights: inputs``) or rebuilt
a new structure (names, shapes, dtypes, types)      every engine set rebuilt at its next call, with
                                                    a warning
weights moved to another device                     refused, in one line
an FP8 linear's master moved (``fp8_masters:        moved back to where ``fp8_masters`` keeps it,
host``: ``compiled.transformer.to("cuda")``)        its FP8 copy re-quantised
==================================================  ============================================

Keepers register here: objects that derive weights from other weights (a loaded LoRA; FP8 copies)
and must bring them up to date before a call. A keeper has ``stale() -> bool`` (cheap, every call)
and ``sync() -> set[str]`` (the weight FQNs it rewrote). The LoRA keeper lives on the transformer
(``keepers(transformer)``), so an eager transformer and every compiled module over it see the same;
the FP8 keeper is the follower's own.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any, Protocol

import torch

from ..config import DTYPES
from ..errors import ConfigError, LoRAError
from ..quant import fp8
from .engine_sets import EngineSets
from .watch import ModelWatch, changes, signature

logger = logging.getLogger(__name__)

#: where keepers live on a transformer (its ``__dict__``: no module attribute, no state-dict key)
KEEPERS = "_prx_keepers"


class Keeper(Protocol):
    def stale(self) -> bool: ...

    def sync(self) -> set[str]: ...


def keepers(transformer: torch.nn.Module) -> dict[str, Keeper]:
    """The keepers registered on ``transformer``, by name, in registration order."""
    return transformer.__dict__.setdefault(KEEPERS, {})


def register(transformer: torch.nn.Module, name: str, keeper: Keeper) -> None:
    """Register ``keeper`` on ``transformer`` under ``name`` (replacing one of that name)."""
    keepers(transformer)[name] = keeper


class FP8Keeper:
    """The FP8 copies of the block linears (``precision: fp8``), re-quantised when their weight's
    version counter moved (``copy_``, ``load_state_dict``; not writes through ``.data``)."""

    def __init__(self, modules: list[fp8.FP8Linear]):
        self.modules = modules
        self.versions: tuple[int, ...] | None = None

    def _now(self) -> tuple[int, ...]:
        return tuple(m._parameters["weight"]._version for m in self.modules)

    def stale(self) -> bool:
        return bool(self.modules) and self._now() != self.versions

    def sync(self) -> set[str]:
        for module in self.modules:
            module.refresh()
        self.versions = self._now()
        return set()  # the FP8 buffers are rewritten in place: engines and graphs read them live


class ChangeFollower:
    """Follows ``model`` for the engine sets ``sets`` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, sets: EngineSets):
        self.model = model
        self.sets = sets
        self.fp8 = FP8Keeper(self._fp8_modules())
        self.watch = ModelWatch(model)  # what the engine sets were built for

    def _fp8_modules(self) -> list[fp8.FP8Linear]:
        return [m for m in self.model.modules() if isinstance(m, fp8.FP8Linear)]

    def _keepers(self) -> list[Keeper]:
        return [*keepers(self.model).values(), self.fp8]  # a LoRA writes the weights FP8 quantises

    def stale(self) -> bool:
        """Whether a call must first ``follow``: the cheap checks alone, nothing done."""
        return (
            self.watch.moved()
            or (self.sets.needs_refit and self.watch.edited())
            or any(k.stale() for k in self._keepers())
        )

    def follow(self) -> dict[str, Any]:
        """Bring the engine sets up to date with the transformer, before a call: cheap when nothing
        changed. Returns what was done: ``rebuild`` (reasons), ``rebound``, ``refit`` (names)."""
        moved = self.watch.moved()
        for keeper in keepers(self.model).values():  # a LoRA first: it writes the weights the rest reads
            if moved or keeper.stale():
                keeper.sync()
        report: dict[str, Any] = {}
        if moved or self.watch.moved():
            report = self._structure_changed()
        elif self.sets.needs_refit:
            names = self.watch.changed_weights()
            if names:
                report = self._refit(names)
        if self.fp8.stale():
            self.fp8.sync()
        return report

    def weights_changed(self, names: list[str], quantized: Collection[str] = ()) -> dict[str, Any]:
        """These parameters were changed in place (by a LoRA): their FP8 copies (but those of
        ``quantized``, which the caller refreshed) and every built engine set are brought up to date
        now."""
        fp8.requantize(self.model, [n for n in names if n not in quantized])
        self.fp8.sync()  # and any other FP8 linear edited in place since the last call
        total = self.sets.weights_changed(names)
        self.watch.synced(names)
        return total

    def _refit(self, names: list[str]) -> dict[str, Any]:
        """``weights_changed`` for edits made outside ``load_lora``; where the engines cannot take them
        (weights TensorRT folded beyond tracing), the sets are built again instead, as MTTM does."""
        try:
            self.weights_changed(names)
            return {"refit": names}
        except LoRAError:
            why = f"{len(names)} weight(s) the engines cannot refit changed ({', '.join(names[:3])})"
            self._rebuild(why)
            self.watch.synced()
            return {"rebuild": [why]}

    def _structure_changed(self) -> dict[str, Any]:
        """The module tree or a tensor's storage changed: rebuild, re-bind or refit, or refuse."""
        model, watch, sets = self.model, self.watch, self.sets
        plan = sets.plan
        if plan.config.precision == "fp8":  # a swapped block linear becomes FP8 again; a cast one too
            fp8.install(model, plan.spec.block_linears)
            fp8.place_masters(model, plan.config.fp8_masters)  # a moved master goes back (fp8_masters)
            self.fp8 = FP8Keeper(self._fp8_modules())
            for module in self.fp8.modules:
                module.requantize()
            self.fp8.versions = self.fp8._now()
        new = signature(model)
        diff = changes(watch.signature, new)
        device = torch.device(plan.config.device)
        moved = sorted(diff.devices - {device.type})
        if moved:
            raise ConfigError(
                f"the transformer's weights were moved to {moved[0]}; the compiled transformer runs on "
                f"{device}.",
                f"move them back: compiled.transformer.to({str(device)!r}).",
            )
        dtype = next(model.parameters()).dtype
        if plan.config.backend == "tensorrt" and dtype not in DTYPES.values():
            raise ConfigError(
                f"the transformer was cast to {dtype}, which TensorRT engines cannot run.",
                "cast it to torch.bfloat16, torch.float16 or torch.float32 (pipe.to(dtype) does too).",
            )
        old_versions = watch.version_map()
        sets.drop_graphs()  # storage may have moved under captured graphs
        built = [b for b in sets.backends if b.is_built]
        if diff.swapped and not diff.structure:
            stuck = [b for b in built if not b.rebind()]
            if stuck:
                diff.structure.append(f"{', '.join(diff.swapped[:3])} swapped (the engines hold its weights)")
        if diff.replaced and not diff.structure and not sets.needs_refit:
            stuck = [b for b in built if not b.rebind()]  # they hold the replaced tensors themselves
            if stuck:
                diff.structure.append(
                    f"{', '.join(diff.replaced[:3])} replaced (the sets hold the old tensors)"
                )
        report: dict[str, Any] = {"rebound": diff.swapped} if diff.swapped else {}
        if diff.structure:
            self._rebuild("; ".join(diff.structure))
            report = {"rebuild": diff.structure}
        watch.reset()
        if not diff.structure and sets.needs_refit:
            versions = watch.version_map()
            names = sorted(
                set(diff.replaced) | {n for n, v in versions.items() if old_versions.get(n, v) != v}
            )
            if names:
                report.update(self._refit(names))
        return report

    def _rebuild(self, why: str) -> None:
        """Every engine set is built again at its next call, for the transformer's current dtype."""
        plan, dtype = self.sets.plan, next(self.model.parameters()).dtype
        if plan.config.dtype is not None and plan.config.torch_dtype() != dtype:
            names = {v: k for k, v in DTYPES.items()}
            plan = plan.replace(config=plan.config.replace(dtype=names.get(dtype)))
        self.sets.rebuild(why, plan)
