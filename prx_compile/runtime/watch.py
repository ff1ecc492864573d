"""What a ``CompiledTransformer`` checks at each call: did the transformer change since its engine sets
were built, and (``weights: engine``) which weights changed in place.

    watch = ModelWatch(transformer)
    watch.moved()            # cheap, every call: the module tree, a tensor's storage or a setting changed
    watch.in_place()         # its last part alone: every tensor's storage is where it was
    changes(watch.signature, signature(transformer))   # only then: what changed, by name
    watch.changed_weights()  # FQNs whose version counter moved (copy_, load_state_dict)

``moved`` compares tuples built by C-level passes over the recorded modules' ``_parameters``,
``_buffers`` and ``_modules`` dicts (no per-tensor Python loop): their sizes and keys (a name added or
removed), every submodule by identity (one swapped) and every tensor's storage address (a parameter
replaced, a cast, a move, ``.data =``). Only when it says so is the full ``Signature`` (names, shapes,
dtypes, devices, module types and identities) computed and compared. The watch keeps the recorded
objects alive until the next ``reset``, so an identity it compares can never be reused by a new
object. Measured on a 2-core CPU shared with other jobs: ``moved`` 0.18-0.31 ms per call for the
1.17 B PRX (303 modules, 188 tensors), 0.035 ms for the tiny one; the version pass (``weights:
engine`` only) 0.05-0.13 ms. The storage-address pass (0.08-0.14 ms of it) replaces the one CUDA
graphs already made per step. 0.27 added every module's hook handles and every attention module's
processor (an export traces both): ``moved`` went from 0.052 to 0.070 ms (1.17 B PRX, 303 modules) and
from 0.24 to 0.32 ms (FLUX.1, 1279 modules), medians on that CPU with meta-device models; 0.28 added
every module's own ``forward`` attribute (``m.forward = f``, traced too): 0.071 -> 0.074 ms and
0.32 -> 0.33 ms, measured the same way; 0.32 added each module's plain settings (``export.settings``:
an eps, RoPE's theta; 748 in the 1.17 B PRX, 2795 in FLUX.1, compared by value in one C-level pass):
0.077 -> 0.097 ms and 0.37 -> 0.43 ms.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from ..export import settings, weight_tensors

_NOT_NONE = functools.partial(operator.is_not, None)
_VERSION = operator.attrgetter("_version")
_flat = itertools.chain.from_iterable
_GONE = object()


#: where a transformer lists the handle ids of hooks the library registers on it itself (a loaded
#: LoRA's eager pre-hook, which does nothing while traced): no part of what a set was built for
INTERNAL_HOOKS = "_prx_internal_hooks"
_PROCESSOR = operator.attrgetter("processor")


@dataclass(frozen=True)
class Signature:
    """The structure engines depend on: tensors by FQN -> (shape, dtype, device type, identity);
    modules by name -> (type, identity); and by name, what an export traces beside its class's code:
    its forward hooks and pre-hooks, a ``forward`` set on the module itself (``m.forward = f``), and its
    attention processor (diffusers' ``processor``)."""

    tensors: dict[str, tuple]
    modules: dict[str, tuple[type, int]]
    traced: dict[str, tuple] = field(default_factory=dict)
    #: by module name, its plain settings as ((name, value), ...) (``settings``)
    settings: dict[str, tuple] = field(default_factory=dict)


#: ``_traced`` of a module with nothing but its class's code
_PLAIN = ((), (), None, None, None)


def _traced(m: torch.nn.Module, internal: Collection[int]) -> tuple:
    """(pre-hooks, hooks, own forward, processor type, processor) of ``m``: each hook as (handle id,
    function identity), the library's own (handle ids ``internal``) left out; the forward set on the
    module itself as (its function's identity, its identity), or None."""
    pre, post = (
        tuple((k, id(fn)) for k, fn in d.items() if k not in internal)
        for d in (m._forward_pre_hooks, m._forward_hooks)
    )
    fwd, proc = m.__dict__.get("forward"), m.__dict__.get("processor")
    own = None if fwd is None else (id(getattr(fwd, "__func__", fwd)), id(fwd))
    return pre, post, own, (None if proc is None else type(proc)), (None if proc is None else id(proc))


def _kinds(traced: tuple) -> tuple:
    """What a swapped module (new objects throughout) must keep: its hook functions, the function of
    its own forward and its processor type."""
    pre, post, own, proc_type, _ = traced
    return tuple(f for _, f in pre), tuple(f for _, f in post), own and own[0], proc_type


def signature(model: torch.nn.Module) -> Signature:
    tensors = {n: (tuple(t.shape), t.dtype, t.device.type, id(t)) for n, t in weight_tensors(model).items()}
    named = list(model.named_modules())
    internal = model.__dict__.get(INTERNAL_HOOKS, ())
    traced = {n: _traced(m, internal) for n, m in named}
    return Signature(
        tensors,
        {n: (type(m), id(m)) for n, m in named},
        {n: t for n, t in traced.items() if t != _PLAIN},
        {n: tuple(s.items()) for n, m in named if (s := settings(m))},
    )


def hooked(model: torch.nn.Module) -> list[str]:
    """The modules of ``model`` with forward hooks or a forward of their own (the library's own hooks
    aside): code an export traces that no record can name."""
    internal = model.__dict__.get(INTERNAL_HOOKS, ())
    return [n or "the transformer" for n, m in model.named_modules() if any(_traced(m, internal)[:3])]


def differences(model: torch.nn.Module, reference: torch.nn.Module) -> list[str]:
    """What an export of ``model`` would trace that ``reference`` (the same class as constructed) has
    not, one entry per module: hooks, a forward set on the module or another processor type
    ("<module> (hooks, forward or processor)"), and each plain setting that differs ("<module>.<name>").
    Modules ``reference`` lacks or has of another type (FP8's layers) are passed over; the library's
    own hooks too."""
    internal = model.__dict__.get(INTERNAL_HOOKS, ())
    ref = dict(reference.named_modules())
    out = []
    for name, m in model.named_modules():
        r = ref.get(name)
        if r is None or type(r) is not type(m):
            continue
        if _kinds(_traced(m, internal)) != _kinds(_traced(r, ())):
            out.append(f"{name or 'the transformer'} (hooks, forward or processor)")
        out += _edited(name, settings(m), settings(r))
    return out


def _edited(module: str, a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """``<module>.<name>`` for each setting that differs between ``a`` and ``b`` (one there only too)."""
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k, _GONE) != b.get(k, _GONE))
    return [f"{module}.{k}" if module else k for k in keys]


@dataclass
class Changes:
    """What differs between two signatures. ``structure``: what engines were built for (names, shapes,
    dtypes, devices, module types), one line per kind; ``swapped``: submodules replaced by others of the
    same type and structure; ``replaced``: tensors replaced by others of the same shape and dtype."""

    structure: list[str] = field(default_factory=list)
    swapped: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    devices: set[str] = field(default_factory=set)


def _some(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def changes(old: Signature, new: Signature) -> Changes:
    out = Changes()
    added = [n for n in new.tensors if n not in old.tensors]
    removed = [n for n in old.tensors if n not in new.tensors]
    if added:
        out.structure.append(f"new tensors {_some(added)}")
    if removed:
        out.structure.append(f"tensors removed: {_some(removed)}")
    shapes, casts = [], {}
    for n, (shape, dtype, device, ident) in new.tensors.items():
        if n not in old.tensors:
            continue
        oshape, odtype, odevice, oident = old.tensors[n]
        if shape != oshape:
            shapes.append(f"{n} {list(oshape)} -> {list(shape)}")
        if dtype != odtype:
            casts.setdefault((odtype, dtype), []).append(n)
        if device != odevice:
            out.devices.add(device)
        if ident != oident and (shape, dtype) == (oshape, odtype):
            out.replaced.append(n)
    if shapes:
        out.structure.append(f"shapes {_some(shapes)}")
    for (a, b), names in casts.items():
        out.structure.append(f"{len(names)} tensor(s) {a} -> {b} ({_some(names, 2)})")
    retyped, swapped = [], []
    for n, (cls, ident) in new.modules.items():
        if n in old.modules and old.modules[n][0] is not cls:
            retyped.append(f"{n or 'the transformer'}: {old.modules[n][0].__name__} -> {cls.__name__}")
        elif n in old.modules and old.modules[n][1] != ident:
            swapped.append(n)
    if retyped:
        out.structure.append(f"modules {_some(retyped)}")
    gone = [n for n in old.modules if n not in new.modules]
    if gone and not removed:
        out.structure.append(f"modules removed: {_some(gone)}")
    # a swapped module's own submodules are new objects too: name only the outermost
    out.swapped = [n for n in swapped if not any(n.startswith(p + ".") for p in swapped if p != n)]
    # hooks and processors: a swapped module's are new objects, so there only their kinds count
    hooked = []
    for n in sorted(old.traced.keys() | new.traced.keys()):
        a, b = old.traced.get(n, _PLAIN), new.traced.get(n, _PLAIN)
        if n in old.modules and n in new.modules and (_kinds(a) != _kinds(b) if n in swapped else a != b):
            hooked.append(n or "the transformer")
    if hooked:
        out.structure.append(
            f"forward hooks, replaced forwards or attention processors changed on {_some(hooked)}"
        )
    edited = []
    for n in sorted(old.settings.keys() & new.settings.keys()):
        edited += _edited(n, dict(old.settings[n]), dict(new.settings[n]))
    if edited:
        out.structure.append(f"settings changed: {_some(edited)}")
    return out


class ModelWatch:
    """The transformer as its engine sets last saw it (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.reset()

    def reset(self) -> None:
        """Record the model as it is now."""
        named = list(self.model.named_modules())
        self._dicts = [d for _, m in named for d in (m._parameters, m._buffers, m._modules)]
        self._filled = [d for d in self._dicts if d]  # most are empty (leaf modules): keys of the rest
        self._module_dicts = [m._modules for _, m in named if m._modules]
        self._tensor_dicts = [d for _, m in named for d in (m._parameters, m._buffers) if d]
        self._fqns = [
            f"{name}.{k}" if name else k
            for name, m in named
            for d in (m._parameters, m._buffers)
            for k, v in d.items()
            if v is not None
        ]
        self._hooks = [d for _, m in named for d in (m._forward_pre_hooks, m._forward_hooks)]
        self._attention = [m for _, m in named if "processor" in m.__dict__]
        self._attrs = [m.__dict__ for _, m in named]
        pairs = [(m.__dict__, k) for _, m in named for k in settings(m)]
        self._setting_dicts, self._setting_keys = [d for d, _ in pairs], [k for _, k in pairs]
        self._held = (  # keeps every compared id unique
            tuple(_flat(map(dict.values, self._dicts))),
            tuple(_flat(map(dict.values, self._hooks))),
            tuple(map(_PROCESSOR, self._attention)),
            self._forwards(),
        )
        self.token = self._token()
        self.signature = signature(self.model)
        self.versions = self._versions()

    def _tensors(self):
        return filter(_NOT_NONE, _flat(map(dict.values, self._tensor_dicts)))

    def _token(self) -> tuple:
        # submodules compare by identity (nn.Module has no __eq__); tensors by storage address (a
        # replaced tensor has a new one too), never with ``==`` (elementwise)
        return (
            tuple(map(len, self._dicts)),
            tuple(_flat(self._filled)),
            tuple(_flat(map(dict.values, self._module_dicts))),
            tuple(map(torch.Tensor.data_ptr, self._tensors())),
            self._hook_ids(),
            tuple(map(id, map(_PROCESSOR, self._attention))),
            self._forwards(),  # compared by identity (functions have no other equality)
            tuple(map(dict.get, self._setting_dicts, self._setting_keys)),  # numbers, strings: by value
        )

    def _forwards(self) -> tuple:
        """Each module's own ``forward`` attribute (None for almost all: their class's)."""
        return tuple(map(dict.get, self._attrs, itertools.repeat("forward")))

    def _hook_ids(self) -> tuple[int, ...]:
        """Every hook's handle id (never reused): one added or removed; the library's own left out."""
        ids = tuple(_flat(self._hooks))  # almost every dict is empty: a C-level pass
        internal = self.model.__dict__.get(INTERNAL_HOOKS)
        return tuple(k for k in ids if k not in internal) if ids and internal else ids

    def _versions(self) -> tuple[int, ...]:
        return tuple(map(_VERSION, self._tensors()))

    def moved(self) -> bool:
        """Whether the module tree, any tensor's storage or a plain setting changed since ``reset``."""
        try:
            return self._token() != self.token
        except (RuntimeError, TypeError, ValueError):  # a setting now a tensor: its == is no answer
            return True

    def in_place(self) -> bool:
        """Whether every recorded tensor still has the storage address it had at ``reset`` (only the
        last part of ``moved``'s pass): then every address a graph captured since reads is memory a
        live tensor holds, whatever else changed (``moved`` tells that)."""
        return tuple(map(torch.Tensor.data_ptr, self._tensors())) == self.token[3]

    def edited(self) -> bool:
        """Whether a tensor's version counter moved since it was last synced (cheap ``changed_weights``)."""
        return self._versions() != self.versions

    def version_map(self) -> dict[str, int]:
        return dict(zip(self._fqns, self.versions, strict=True))

    def changed_weights(self) -> list[str]:
        """FQNs changed in place since they were last synced (``synced``)."""
        now = self._versions()
        if now == self.versions:
            return []
        return [n for n, a, b in zip(self._fqns, self.versions, now, strict=True) if a != b]

    def synced(self, names: list[str] | set[str] | None = None) -> None:
        """These FQNs (None: all) are now up to date in every compiled copy."""
        now = self._versions()
        if names is None:
            self.versions = now
            return
        wanted = set(names)
        self.versions = tuple(
            b if n in wanted else a for n, a, b in zip(self._fqns, self.versions, now, strict=True)
        )
