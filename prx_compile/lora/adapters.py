"""LoRA for a supported transformer — eager or compiled — with exact fuse/unfuse and engine refit.

    load_lora(model, "style.safetensors", "style", scale=0.8)   # fuse into the weights (refit if compiled)
    set_lora(model, ["style", "detail"], [0.8, 0.5])             # switch / mix adapters
    unload_lora(model)                                           # the base weights, bit for bit

``model`` is a transformer of a supported class (``prx_compile.models``), a CompiledTransformer, or a
pipeline (its transformer).
Fused weights are always recomputed from an exact copy of the originals,
``W = W0 + sum_a scale_a * alpha_a/r_a * B_a @ A_a`` (fp32, then the weight dtype), so switching
A -> B -> A gives exactly A and unloading restores W0. The new values are written into the
transformer's parameters in place: with ``weights: inputs`` (the default) the compiled engines read
those very tensors, so nothing else happens; with ``weights: engine`` only the engine weights that
changed are refit. Bad input raises ``LoRAError`` before anything changes.

The exact originals of the changed weights are kept beside them (on their device; pinned on the host
for FP8 masters kept there, ``fp8_masters: host``) while a LoRA is loaded; ``unload_lora`` frees them.
The adapters' matrices live, and are merged, where the layer computes (``_compute_device``: beside an
FP8 copy, so a host master's merge runs on the GPU). Saved artifacts hold the original weights plus
the adapters, and a loaded artifact has the same adapters active, so ``unload_lora`` after a reload is
exact too.

Semantics, as PEFT's (an adapter lives beside its base layer): a LoRA stays applied over whatever base
weights are loaded. Any write to a weight a LoRA changed that is not the LoRA's own (``load_state_dict``,
strict or partial, ``copy_``, a new ``Parameter``) sets that weight's new *base* value, and the active
adapters are applied over it again (``LoRAKeeper``: at the next call of a compiled module, at the next
forward of an eager transformer, or at the next LoRA operation); writing back the value the LoRA
produced (``load_state_dict(model.state_dict())``) changes nothing. A cast (``.to(dtype)``) casts the
base values too. ``unload_lora`` leaves exactly the base weights as they are then.

File layouts: diffusers/PEFT (``<module>.lora_A.weight``, ``<module>.lora_B.weight``, optional
``transformer.`` / ``base_model.model.`` prefix, optional ``<module>.alpha``), kohya
(``lora_unet_<module_with_underscores>.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha``), and the
layouts a model's spec converts (``ModelSpec.convert_lora``: kohya's FLUX files name the original
model's layers).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import schema
from ..errors import ConfigError, LoRAError, excerpt, one_line
from ..models import spec_for
from ..quant import fp8
from ..runtime import follower
from ..runtime.watch import INTERNAL_HOOKS

logger = logging.getLogger(__name__)

_PEFT = re.compile(r"^(?P<mod>.+?)\.lora_(?P<part>A|B)(?:\.[^.]+)?\.weight$")
_KOHYA = re.compile(r"^(?P<mod>.+?)\.lora_(?P<part>down|up)\.weight$")
_ALPHA = re.compile(r"^(?P<mod>.+?)\.alpha$")
_LORA_KEY = re.compile(r"lora|\.alpha$")  # any layout's LoRA matrices and alphas, before conversion
#: what PEFT applies from a LoRA file and a compiled transformer does not: refused by name (as keys
#: of no layer, they would be left out with the rest of the LoRA applied, or blamed on the layers)
_UNSUPPORTED = (
    (re.compile(r"lora_magnitude_vector"), "DoRA (lora_magnitude_vector)"),
    (re.compile(r"\.lora_(?:B|up)(?:\.[^.]+)?\.bias$"), "a LoRA bias (lora_B.bias: PEFT's lora_bias)"),
)
_PREFIXES = ("transformer.", "base_model.model.", "model.diffusion_model.", "diffusion_model.")
_KOHYA_PREFIXES = ("lora_unet_", "lora_transformer_")
_FILES = ("pytorch_lora_weights.safetensors", "adapter_model.safetensors")
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
#: Bounds on a LoRA's numbers (far above any real LoRA; beyond them the fused weights overflow):
#: an adapter's scale (|scale|), a layer's alpha (|alpha|), alpha / r (|alpha / r|) and the rank
#: ``r`` an adapter_config.json may give.
MAX_SCALE = 1e4
MAX_ALPHA = 1e5
MAX_LAYER_SCALE = 1e4
MAX_RANK = 1 << 16
#: The largest adapter_config.json read (a real one is well under 10 kB).
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
#: the header key under which diffusers' ``save_lora_weights`` keeps each component's LoraConfig
#: (``transformer.r``, ``transformer.lora_alpha``, ...)
ADAPTER_METADATA = "lora_adapter_metadata"


@dataclass
class LoRALayer:
    """One linear layer's update ``scale * up @ down``: down (r, in), up (out, r), fp32."""

    down: torch.Tensor
    up: torch.Tensor
    scale: float


@dataclass
class Adapter:
    name: str
    layers: dict[str, LoRALayer]  # Linear module FQN -> update
    unmatched: list[str] = field(default_factory=list)
    source: str = ""
    scale: float = 1.0  # the scale it was last made active at (PEFT's rule after a delete reads it)


@dataclass
class LoRAState:
    """Kept on the transformer as ``_prx_lora``: exact base weights, loaded adapters, active scales."""

    originals: dict[str, torch.Tensor] = field(default_factory=dict)  # weight FQN -> exact base value
    adapters: dict[str, Adapter] = field(default_factory=dict)
    active: dict[str, float] = field(default_factory=dict)
    fused: set[str] = field(default_factory=set)  # weight FQNs that currently differ from the originals
    #: weight FQN -> (its module, attribute) and the parameter as the LoRA last wrote it (``_print``)
    slots: dict[str, tuple[torch.nn.Module, str]] = field(default_factory=dict)
    written: dict[str, tuple] = field(default_factory=dict)
    #: the active scales ``disable_lora`` set aside (diffusers' verb), for ``enable_lora``; None: enabled
    disabled: dict[str, float] | None = None


def _compute_device(linear: torch.nn.Module) -> torch.device:
    """Where a layer's LoRA lives and is merged: beside its FP8 copy where it has one (its exact
    weight may be kept on the host, ``fp8_masters: host``), else beside its weight."""
    q = getattr(linear, "weight_fp8", None)
    return q.device if isinstance(q, torch.Tensor) else linear.weight.device


def _kept(p: torch.Tensor) -> torch.Tensor:
    """An exact copy of ``p`` to keep as a base value: pinned where ``p`` is (a host master, copied to
    the device at each merge)."""
    p = p.detach()
    if not (p.device.type == "cpu" and p.is_pinned()):
        return p.clone()
    try:
        kept = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
    except RuntimeError as e:
        why = str(e).splitlines()[0][:120].rstrip(".")
        raise LoRAError(
            f"could not pin {p.nbytes / 2**20:.0f} MB of host memory for a LoRA's exact originals ({why}).",
            "free host memory, or compile with fp8_masters: device; nothing was changed.",
        ) from e
    return kept.copy_(p)


def _print(p: torch.Tensor) -> tuple:
    """What tells a write apart: the object, its storage, its version counter, dtype and device."""
    return (id(p), p.data_ptr(), p._version, p.dtype, p.device)


class LoRAKeeper:
    """Keeps a loaded LoRA applied over the base weights (``runtime.follower``'s keeper protocol):
    ``stale`` when a weight the LoRA changed was written by anything else; ``sync`` takes that write
    as the weight's new base value (or, for a cast or a move of the value the LoRA wrote, casts the
    base) and applies the active adapters over it again."""

    def __init__(self, transformer: torch.nn.Module):
        self.transformer = transformer

    def stale(self) -> bool:
        """Cheap, every call: a recorded weight written or replaced. (A module swapped for another
        is the follower's to see; ``sync`` looks weights up by name.)"""
        state = self.transformer.__dict__.get("_prx_lora")
        if state is None or not state.written:
            return False
        for fqn, (module, attr) in state.slots.items():
            p = module._parameters.get(attr)
            if p is None or _print(p) != state.written[fqn]:
                return True
        return False

    def sync(self, *, drop_gone: bool = False) -> set[str]:
        """Rebase the weights written outside the LoRA, found by name (a swapped module's weight is
        its new base); returns the FQNs rewritten. Weights removed or reshaped are a LoRAError, or
        with ``drop_gone`` (an unload) are forgotten: nothing of theirs is restored."""
        state = self.transformer.__dict__.get("_prx_lora")
        if state is None or not state.originals:
            return set()
        params = dict(self.transformer.named_parameters())
        modules = dict(self.transformer.named_modules())
        rebased, gone, under = set(), [], []
        for fqn, base in list(state.originals.items()):
            p = params.get(fqn)
            if p is None or p.shape != base.shape:
                gone.append(fqn)
                continue
            if _print(p) == state.written.get(fqn):
                continue
            merged = _merged(state, state.active, fqn, p, modules)  # what the LoRA wrote, recomputed
            # the value the LoRA wrote, cast (or there and back through 16 bits: .half().float())
            via = next(
                (d for d in _cast_paths(p.dtype) if _holds(p, merged.to(p.device, d).to(p.dtype), d)), None
            )
            if via is None:
                state.originals[fqn] = _kept(p)  # a new base value (whatever its dtype)
                if fqn in state.fused:  # it held the LoRA's share: an edit of it edits that share too
                    under.append(fqn)
            elif (via, p.dtype, p.device) == (base.dtype, base.dtype, base.device):
                continue  # written again as it was (or a copy put in its place)
            else:  # the base follows the cast or the move
                state.originals[fqn] = base.to(p.device, via).to(p.dtype)
            rebased.add(fqn)
        if under:
            logger.warning(
                "%d weight(s) holding a LoRA's share were written (%s): the written values are their new "
                "base, the active adapters applied over them (as PEFT for new values, load_state_dict's; "
                "a relative edit such as mul_ scaled the LoRA's share too, where PEFT edits the base alone).",
                len(under),
                ", ".join(under[:3]),
            )
        if gone and not drop_gone:
            raise LoRAError(
                f"weights a loaded LoRA changes were removed or reshaped ({', '.join(gone[:3])}): the LoRA "
                "cannot stay applied.",
                "unload_lora (it restores the weights that are left), then load the LoRA again.",
            )
        for fqn in gone:
            del state.originals[fqn]
            state.fused.discard(fqn)
        with torch.no_grad():
            for fqn in sorted(rebased):  # one weight at a time: no second copy of them all
                params[fqn].copy_(_merged(state, state.active, fqn, params[fqn], modules))
        if rebased:
            fp8.requantize(self.transformer, rebased)
        _record(self.transformer, state)
        return rebased


def _holds(p: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``p`` holds ``value`` (a merge recomputed, rounded through ``dtype``) up to what a
    recomputation may change: a matmul's last bit depends on its buffers' alignment, and a rounding
    to 16 bits can pass that on. So: equal, or differing in at most one element in a thousand, each
    by at most two units in the last place of ``dtype``. New weights differ almost everywhere."""
    differ = p != value
    if not bool(differ.any()):
        return True
    if float(differ.float().mean()) > 1e-3:
        return False
    a, b = p[differ].float(), value[differ].float()
    return bool(((a - b).abs() <= 2 * torch.finfo(dtype).eps * b.abs()).all())


def _cast_paths(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The dtypes a weight of ``dtype`` may have gone through in a cast that ``sync`` recognises."""
    return (dtype,) + tuple(d for d in (torch.bfloat16, torch.float16) if d.itemsize < dtype.itemsize)


def _record(transformer: torch.nn.Module, state: LoRAState) -> None:
    """Remember every weight the LoRA keeps as it is now (what ``LoRAKeeper.stale`` compares)."""
    modules = dict(transformer.named_modules())
    state.slots, state.written = {}, {}
    for fqn in state.originals:
        mod, _, attr = fqn.rpartition(".")
        p = modules[mod]._parameters[attr]
        state.slots[fqn] = (modules[mod], attr)
        state.written[fqn] = _print(p)


def _eager_sync(module: torch.nn.Module, args: Any) -> None:
    """Forward pre-hook of a transformer with a LoRA: an eager call sees its base weights' edits and
    swapped layers too (never while it is traced: an export reads the weights it is given)."""
    if torch.compiler.is_compiling():
        return
    keeper = follower.keepers(module).get("lora")
    if keeper is not None:
        with torch.no_grad():
            keeper.sync()


# -- reading -----------------------------------------------------------------------------------
def read_lora_file(path: str | Path) -> tuple[dict[str, torch.Tensor], tuple[float, int] | None]:
    """Tensors of a LoRA safetensors file (or a directory holding one), and the (scale, rank) its
    adapter config gives (``config_scale``), if any: PEFT's ``adapter_config.json`` beside it, or the
    ``lora_adapter_metadata`` diffusers' ``save_lora_weights`` writes in the file's header."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    folder = Path(path)
    cfg = folder / "adapter_config.json"
    config = config_scale(_json_file(cfg), str(cfg)) if folder.is_dir() and cfg.is_file() else None
    p = lora_file(folder)
    unreadable = (SafetensorError, OSError, ValueError, RuntimeError, MemoryError)
    try:
        with safe_open(str(p), framework="pt") as f:  # the header alone: shapes before any tensor
            raw = (f.metadata() or {}).get(ADAPTER_METADATA)
            ranks = {k: _rank(k, f.get_slice(k).get_shape()) for k in f.keys()}
    except unreadable as e:
        raise _not_safetensors(p, e) from e
    big = next((k for k, r in ranks.items() if r > MAX_RANK), None)
    if big is not None:
        raise LoRAError(f"{p}: {excerpt(big)} has rank {ranks[big]}, more than {MAX_RANK}: not a LoRA.")
    try:
        tensors = load_file(str(p))
    except unreadable as e:
        raise _not_safetensors(p, e) from e
    if raw is not None:
        where = f"{p}: {ADAPTER_METADATA}"
        try:
            meta = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise LoRAError(f"{where} is not valid JSON ({type(e).__name__}).") from e
        if not isinstance(meta, dict):
            raise LoRAError(f"{where} must be a JSON object.")
        # the pipeline's save_lora_weights prefixes each component's keys; a model's own
        # save_lora_adapter writes them bare
        mine = {k[len("transformer.") :]: v for k, v in meta.items() if k.startswith("transformer.")}
        mine = mine or {k: v for k, v in meta.items() if "." not in k}
        found_config = config_scale(mine, where) if mine else None
        if config is not None and found_config is not None and found_config != config:
            raise LoRAError(f"{p}: its {ADAPTER_METADATA} and adapter_config.json give different alpha / r.")
        config = config or found_config
    return tensors, config


def _keys(keys: list[str], n: int = 5) -> str:
    """The first ``n`` of ``keys`` for a message, each cut to 80 characters."""
    return "[" + ", ".join(excerpt(k, 80) for k in keys[:n]) + "]"


def _not_safetensors(path: Path, e: BaseException) -> LoRAError:
    return LoRAError(
        f"{path} is not a safetensors LoRA file ({one_line(e)}).", "LoRAs load from .safetensors only."
    )


def _rank(key: str, shape: list[int]) -> int:
    """The rank a LoRA matrix's shape gives (A/down: its rows; B/up: its columns); 0 for other keys."""
    m = _PEFT.match(key) or _KOHYA.match(key)
    if m is None or len(shape) != 2:
        return 0
    return shape[0] if m["part"] in ("A", "down") else shape[1]


def lora_file(path: Path) -> Path:
    """The safetensors file of a LoRA: ``path``, or in a folder the one ``_FILES`` names first."""
    if path.is_dir():
        found = [path / f for f in _FILES if (path / f).is_file()]
        if not found:
            raise LoRAError(f"{path} holds no LoRA file (looked for {list(_FILES)}).")
        path = found[0]
    if not path.is_file():
        raise LoRAError(f"LoRA file {path} does not exist.")
    if schema.mostly_holes(path.stat()):
        raise LoRAError(f"LoRA file {path} is a sparse file (mostly holes), which no LoRA trainer writes.")
    return path


def _json_file(path: Path) -> Any:
    """The JSON of a small file (an adapter config: at most ``MAX_ADAPTER_CONFIG_BYTES``)."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise LoRAError(f"{path} cannot be read ({type(e).__name__}).") from e
    if size > MAX_ADAPTER_CONFIG_BYTES:
        raise LoRAError(f"{path} is more than {MAX_ADAPTER_CONFIG_BYTES} bytes: not an adapter config.")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise LoRAError(f"{path} is not valid JSON ({type(e).__name__}).") from e


def config_scale(c: Any, where: str) -> tuple[float, int] | None:
    """(the layers' scale, their rank) from a PEFT LoraConfig as a dict (None when it gives neither
    alpha nor r): lora_alpha / r, or lora_alpha / sqrt(r) with ``use_rslora``; alpha a positive number
    up to ``MAX_ALPHA``, r a positive integer up to ``MAX_RANK``. Per-layer patterns
    (``alpha_pattern``, ``rank_pattern``) are refused rather than ignored."""
    if not isinstance(c, dict):
        raise LoRAError(f"{where} must hold a JSON object.")
    for key in ("alpha_pattern", "rank_pattern"):
        if c.get(key):
            raise LoRAError(
                f"{where}: per-layer {key} is not supported.",
                "merge the LoRA with PEFT, or give one alpha and r.",
            )
    alpha, r, rslora = c.get("lora_alpha"), c.get("r"), c.get("use_rslora", False)
    if alpha is None and r is None:
        return None
    if not _finite_number(alpha, MAX_ALPHA) or alpha <= 0:
        raise LoRAError(
            f"{where}: lora_alpha={excerpt(alpha, 40)} must be a positive number up to {MAX_ALPHA:g}."
        )
    if not _finite_number(r, MAX_RANK) or r <= 0 or (isinstance(r, float) and not r.is_integer()):
        raise LoRAError(
            f"{where}: r={excerpt(r, 40)} must be a positive number, an integer rank up to {MAX_RANK}."
        )
    if rslora not in (True, False, None):
        raise LoRAError(f"{where}: use_rslora={excerpt(rslora, 40)} must be true or false.")
    r = int(r)
    return _layer_scale(float(alpha), math.sqrt(r) if rslora else r, where), r


def _finite_number(v: Any, limit: float = 2.0**53) -> bool:
    """An int or float (not a bool) with ``|v| <= limit``: finite, and no OverflowError later
    (``float(10**400)`` raises; comparing it does not)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and -limit <= v <= limit


def _layer_scale(alpha: float, rank: float, where: str) -> float:
    """alpha / r (r: the rank, or its square root for rsLoRA), refused beyond ``MAX_LAYER_SCALE``
    (LoRAError naming ``where``)."""
    scale = alpha / rank
    if not abs(scale) <= MAX_LAYER_SCALE:
        raise LoRAError(
            f"{where}: alpha / r = {alpha:g} / {rank:g} = {scale:g} is beyond +-{MAX_LAYER_SCALE:g}.",
            "the LoRA's alpha is not what it was trained with; fix it or drop it (alpha / r = 1).",
        )
    return scale


def _linear_names(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def parse_lora(
    state_dict: dict[str, torch.Tensor],
    model: torch.nn.Module,
    name: str,
    *,
    strict: bool = True,
    config: tuple[float, int] | None = None,
    source: str = "",
) -> Adapter:
    """Map LoRA tensors to the model's Linear layers and check every shape.

    ``config``: (scale, rank) from the LoRA's adapter config (``read_lora_file``): the scale of every
    layer without an alpha of its own, whose rank must then be that rank.

    Raises LoRAError for: no LoRA keys at all, a layer with only one of its two matrices, unknown
    layers (when ``strict``), shape or rank mismatches. ``unmatched`` lists what ``strict=False``
    skipped.
    """
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise LoRAError(f"LoRA {name!r}: expected a dict of tensors.")
    linears = _linear_names(model)
    by_underscore = {n.replace(".", "_"): n for n in linears}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    alphas: dict[str, float] = {}
    unmatched: list[str] = []
    kohya = any(_KOHYA.match(k) for k in state_dict)
    if not kohya and not any(_PEFT.match(k) for k in state_dict):
        raise LoRAError(
            f"LoRA {name!r} ({source or 'state dict'}) has no lora_A/lora_B or lora_down/lora_up "
            "weights: it is not a LoRA."
        )
    for pattern, what in _UNSUPPORTED:
        key = next((k for k in state_dict if pattern.search(k)), None)
        if key is not None:
            raise LoRAError(
                f"LoRA {name!r}: {what} is not supported on a compiled transformer ({excerpt(key)})."
            )
    for key, t in state_dict.items():
        m = (_KOHYA if kohya else _PEFT).match(key)
        a = _ALPHA.match(key) if m is None else None
        if m is None and a is None:
            unmatched.append(key)
            continue
        mod = _module_name(m["mod"] if m else a["mod"], kohya, linears, by_underscore)
        if mod is None:
            unmatched.append(key)
            continue
        if a is not None:
            if t.numel() != 1 or not t.is_floating_point() and t.dtype not in (torch.int32, torch.int64):
                raise LoRAError(f"LoRA {name!r}: {excerpt(key)} must hold one number.")
            alpha = float(t.double().reshape(-1)[0])
            if not math.isfinite(alpha):
                raise LoRAError(f"LoRA {name!r}: {excerpt(key)} is {alpha}, not a finite number.")
            if alpha == 0:  # diffusers' converters: a layer that does nothing; kohya's trainers: alpha = r
                raise LoRAError(
                    f"LoRA {name!r}: {excerpt(key)} is 0, which readers disagree on (no update, or "
                    "alpha = r).",
                    "set alpha to the rank for a scale of 1, or drop the .alpha keys.",
                )
            if not abs(alpha) <= MAX_ALPHA:
                raise LoRAError(
                    f"LoRA {name!r}: layer {mod} alpha {alpha:g} is beyond +-{MAX_ALPHA:g}.",
                    "alpha is usually the rank or a small multiple of it; fix the file.",
                )
            if mod in alphas and alphas[mod] != alpha:
                raise LoRAError(f"LoRA {name!r}: layer {mod} has two different alpha values.")
            alphas[mod] = alpha
        else:
            part = "down" if m["part"] in ("A", "down") else "up"
            if not t.is_floating_point():
                raise LoRAError(f"LoRA {name!r}: {excerpt(key)} is {t.dtype}, not a floating-point matrix.")
            seen = parts.setdefault(mod, {}).get(part)
            if seen is not None and not (seen.shape == t.shape and torch.equal(seen, t)):
                raise LoRAError(
                    f"LoRA {name!r}: layer {mod} has two different "
                    f"{'lora_A/lora_down' if part == 'down' else 'lora_B/lora_up'} matrices.",
                    "keep one key per layer and matrix.",
                )
            parts[mod][part] = t
    if unmatched and strict:
        raise LoRAError(
            f"LoRA {name!r}: {len(unmatched)} key(s) match no Linear layer of the transformer, "
            f"e.g. {_keys(unmatched)}.",
            "pass strict=False to skip them (they are reported).",
        )
    layers = {}
    for mod, p in sorted(parts.items()):
        if set(p) != {"down", "up"}:
            missing = "lora_B/lora_up" if "down" in p else "lora_A/lora_down"
            raise LoRAError(f"LoRA {name!r}: layer {mod} has no {missing} matrix.")
        down, up, lin = p["down"], p["up"], linears[mod]
        if down.dim() != 2 or up.dim() != 2:
            raise LoRAError(
                f"LoRA {name!r}: layer {mod} matrices must be 2-D, got {tuple(down.shape)} and "
                f"{tuple(up.shape)}."
            )
        if down.shape[0] != up.shape[1]:
            raise LoRAError(
                f"LoRA {name!r}: layer {mod} rank mismatch: down/A has rank {down.shape[0]}, "
                f"up/B has rank {up.shape[1]}."
            )
        if down.shape[1] != lin.in_features or up.shape[0] != lin.out_features:
            raise LoRAError(
                f"LoRA {name!r}: layer {mod} expects A ({down.shape[0]}, {lin.in_features}) and "
                f"B ({lin.out_features}, {up.shape[1]}), got {tuple(down.shape)} and {tuple(up.shape)}."
            )
        rank = down.shape[0]
        if rank == 0:
            raise LoRAError(f"LoRA {name!r}: layer {mod} has rank 0.")
        for label, t in (("A/down", down), ("B/up", up)):
            if not bool(torch.isfinite(t).all()):
                raise LoRAError(f"LoRA {name!r}: layer {mod} matrix {label} holds NaN or infinite values.")
        if mod in alphas:
            scale = _layer_scale(alphas[mod], rank, f"LoRA {name!r}: layer {mod}")
        elif config is not None:
            scale, r = config
            if rank != r:
                raise LoRAError(f"LoRA {name!r}: layer {mod} has rank {rank}; its adapter config says r={r}.")
        else:
            scale = 1.0
        dev = _compute_device(lin)
        layers[mod] = LoRALayer(down.to(dev, torch.float32), up.to(dev, torch.float32), scale)
    if not layers:
        raise LoRAError(
            f"LoRA {name!r}: no layer of the transformer matched.", f"first keys: {_keys(unmatched)}"
        )
    return Adapter(name, layers, unmatched, source)


def _module_name(raw: str, kohya: bool, linears: dict, by_underscore: dict) -> str | None:
    if kohya:
        for p in _KOHYA_PREFIXES:
            if raw.startswith(p):
                return by_underscore.get(raw[len(p) :])
        return by_underscore.get(raw)
    for p in ("",) + _PREFIXES:
        if raw.startswith(p) and raw[len(p) :] in linears:
            return raw[len(p) :]
    return None


# -- applying ----------------------------------------------------------------------------------
def _compiled(model: Any) -> bool:
    """Is ``model`` a ``CompiledTransformer`` (the one object with a change follower; the runtime
    imports this stage, so the class is not imported here)?"""
    return isinstance(model, torch.nn.Module) and isinstance(
        model.__dict__.get("follower"), follower.ChangeFollower
    )


def _target(model: Any):
    """(transformer holding the weights, compiled module or None) for a model/compiled/pipeline."""
    model = model if _compiled(model) else getattr(model, "transformer", model)
    if _compiled(model):
        return model.transformer, model
    if not isinstance(model, torch.nn.Module):
        raise LoRAError(
            f"cannot apply a LoRA to a {type(model).__name__}.",
            "pass a transformer, a CompiledTransformer or a pipeline.",
        )
    return model, None


def _state(transformer: torch.nn.Module, *, unloading: bool = False) -> LoRAState:
    """The transformer's LoRA state, made on first use (with its keeper and eager hook), and brought
    up to date with writes to its weights (and layers swapped) since the LoRA's last write;
    ``unloading``: weights removed since are forgotten rather than refused."""
    state = transformer.__dict__.get("_prx_lora")
    if state is None:
        state = LoRAState()
        transformer.__dict__["_prx_lora"] = state
        follower.register(transformer, "lora", LoRAKeeper(transformer))
        handle = transformer.register_forward_pre_hook(_eager_sync)
        transformer.__dict__.setdefault(INTERNAL_HOOKS, set()).add(handle.id)  # not the model's own
    keeper = follower.keepers(transformer).get("lora")
    if keeper is not None:
        with torch.no_grad():
            keeper.sync(drop_gone=unloading)
    return state


def _terms(state: LoRAState, active: dict[str, float], mod: str) -> list[tuple[LoRALayer, float]]:
    """Layer ``mod``'s updates under the ``active`` adapters: (layer, adapter scale), by name."""
    return [
        (state.adapters[n].layers[mod], active[n])
        for n in sorted(active)
        if active[n] != 0.0 and mod in state.adapters[n].layers
    ]


def _fuse(w0: torch.Tensor, terms: list[tuple[LoRALayer, float]], out: torch.Tensor) -> torch.Tensor:
    """``out`` (N, K) <- ``w0`` (N, K) + the sum over ``terms`` of up (N, r) @ down (r, K) * the
    layer's scale * the adapter's, in fp32 and rounded once to ``out``'s dtype: PEFT's merge into a
    bf16 weight, bit for bit. No fp32 copy of the weight is made; a scale of 1 is not multiplied by."""
    if not terms:
        return out.copy_(w0)
    acc = None
    for layer, s in terms:
        d = layer.up @ layer.down
        for k in (layer.scale, s):
            if k != 1.0:  # x * 1.0 == x: skipped, not rounded differently
                d.mul_(k)
        acc = d if acc is None else acc.add_(d)
    return torch.add(w0, acc, out=out)


def _not_finite(state: LoRAState, active: dict[str, float], mod: str, dtype: torch.dtype) -> LoRAError:
    names = [n for n, _ in sorted(active.items()) if active[n] != 0.0 and mod in state.adapters[n].layers]
    return LoRAError(
        f"LoRA {', '.join(names)}: layer {mod}: the fused weight is not finite in {dtype} "
        f"(scales {[active[n] for n in names]}).",
        "lower the scale, or check the LoRA's alpha and matrices; nothing was changed.",
    )


def _merged(
    state: LoRAState, active: dict[str, float], fqn: str, p: torch.Tensor, modules: dict
) -> torch.Tensor:
    """Weight ``fqn`` (the parameter ``p``; ``modules``: the transformer's by name) under the
    ``active`` adapters, from its original (or ``p``), on its layer's ``_compute_device``. A
    LoRAError naming the layer when it is not finite in the weight's dtype (an fp16 weight
    overflows at 65504)."""
    mod = fqn.rsplit(".", 1)[0]
    w0 = state.originals.get(fqn, p.detach()).to(_compute_device(modules[mod]))
    terms = _terms(state, active, mod)
    out = _fuse(w0, terms, torch.empty_like(w0))
    if terms and not bool(torch.isfinite(out).all()):
        raise _not_finite(state, active, mod, w0.dtype)
    return out


def _write(transformer, state: LoRAState, active: dict[str, float], touched: set[str]) -> str | None:
    """Write every weight in ``touched`` as its original under the ``active`` adapters, and its FP8
    copy (quantised from the merged value on the device: a host master is written, never read back).
    Returns the first layer (by name) whose fused weight is not finite, checked with one
    synchronisation after every write (the caller then writes the previous values back)."""
    params = dict(transformer.named_parameters())
    modules = dict(transformer.named_modules())
    checks: list[tuple[str, torch.Tensor]] = []
    hosts: set[torch.device] = set()  # devices that copy into host masters
    with torch.no_grad():
        for fqn in sorted(touched):
            mod = fqn.rsplit(".", 1)[0]
            module, p = modules[mod], params[fqn]
            device = _compute_device(module)
            w0 = state.originals[fqn].to(device, non_blocking=True)  # a pinned host original
            terms = _terms(state, active, mod)
            value = _fuse(w0, terms, p if p.device == device else torch.empty_like(w0))
            if value is not p:
                p.copy_(value, non_blocking=True)  # into a pinned host master
                hosts.add(device)
            if terms:
                checks.append((mod, torch.isfinite(value).all()))
            if isinstance(module, fp8.FP8Linear):
                module.requantize(value)
    finite = torch.stack([ok.to(checks[0][1].device) for _, ok in checks]).tolist() if checks else []
    for device in hosts:
        torch.cuda.synchronize(device)  # the copies into the host masters have landed
    return next((mod for (mod, _), ok in zip(checks, finite, strict=True) if not ok), None)


def _apply(transformer, compiled, state: LoRAState, active: dict[str, float]) -> dict[str, Any]:
    """Fuse ``active`` into the weights (from the originals) and refit; roll back if a fused weight is
    not finite or the refit fails."""
    params = dict(transformer.named_parameters())
    wanted = {f"{m}.weight" for n in active for m in state.adapters[n].layers}
    touched = wanted | state.fused
    for fqn in touched:
        if fqn not in state.originals:
            state.originals[fqn] = _kept(params[fqn])
    before = dict(state.active)  # what the weights hold now: recomputed exactly for a roll-back
    report: dict[str, Any] = {"changed": len(touched)}
    try:  # a failure anywhere (a weight not finite, out of memory half way, a refit) rolls back
        bad = _write(transformer, state, active, touched)
        if bad is not None:
            raise _not_finite(state, active, bad, params[f"{bad}.weight"].dtype)
        if compiled is not None and touched:
            report["refit"] = compiled.weights_changed(sorted(touched), quantized=touched)
    except Exception:
        _write(transformer, state, before, touched)
        if compiled is not None and touched:
            compiled.weights_changed(sorted(touched), quantized=touched)
        _record(transformer, state)
        raise
    state.active = dict(active)
    for n, scale in active.items():
        state.adapters[n].scale = scale
    state.fused = {f for f in touched if f in wanted}
    _record(transformer, state)
    return report


def load_lora(
    model: Any,
    lora: str | Path | dict[str, torch.Tensor],
    name: str,
    scale: float = 1.0,
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a LoRA as adapter ``name`` and activate it (with the adapters already active) at ``scale``.

    Returns {"adapter", "layers", "unmatched", "changed", "refit"?}. Raises LoRAError, leaving the model
    as it was, on a bad file, unknown layers (``strict``), shape/rank mismatches or a taken name.
    """
    return load(model, lora, name, scale, strict=strict)


def load(
    model: Any,
    lora: str | Path | dict[str, torch.Tensor],
    name: str,
    scale: float = 1.0,
    *,
    strict: bool = True,
    config: tuple[float, int] | None = None,
    alone: bool = False,
) -> dict[str, Any]:
    """``load_lora``; ``config``: (scale, rank) for a state dict (a file's own comes from the file);
    ``alone``: the new adapter is the only one active (as diffusers' ``load_lora_weights`` leaves it;
    while disabled, the only one ``enable_lora`` applies)."""
    transformer, compiled = _target(model)
    state = _state(transformer)
    if not isinstance(name, str) or not _ADAPTER_NAME.fullmatch(name):
        raise LoRAError(f"adapter name {str(name)[:40]!r} must be 1-64 of [A-Za-z0-9_.-].")
    _check_scales([scale])
    if name in state.adapters:
        raise LoRAError(
            f"an adapter named {name!r} is already loaded.", "unload_lora() first, or use another name."
        )
    source = "state dict"
    if isinstance(lora, (str, Path)):
        source = str(lora)
        lora, config = read_lora_file(lora)
    lora = _converted(transformer, lora, name)
    adapter = parse_lora(lora, transformer, name, strict=strict, config=config, source=source)
    state.adapters[name] = adapter
    if alone and state.disabled is not None:  # PEFT's layers stay disabled: what enable_lora applies
        adapter.scale = float(scale)
        state.disabled = {name: float(scale)}
        _record(transformer, state)
        return {"adapter": name, "layers": len(adapter.layers), "unmatched": adapter.unmatched, "changed": 0}
    try:
        report = _apply(transformer, compiled, state, {**({} if alone else state.active), name: float(scale)})
    except Exception:
        del state.adapters[name]
        _record(transformer, state)
        raise
    state.disabled = None  # the adapters active before (none while disabled) and this one
    return {"adapter": name, "layers": len(adapter.layers), "unmatched": adapter.unmatched, **report}


def set_lora(model: Any, names: str | list[str], scales: float | list[float] | None = None) -> dict[str, Any]:
    """Make exactly ``names`` active, with ``scales`` (one per name, or one for all; default 1.0)."""
    transformer, compiled = _target(model)
    state = _state(transformer)
    names = [names] if isinstance(names, str) else list(names)
    if scales is None:
        scales = [1.0] * len(names)
    elif isinstance(scales, (int, float)):
        scales = [scales] * len(names)
    _check_active(state, names, scales)
    report = _apply(transformer, compiled, state, dict(zip(names, map(float, scales), strict=True)))
    state.disabled = None
    return report


def _check_active(state: LoRAState, names: list[str], scales: list[Any]) -> None:
    """Loaded adapter names, and a scale each that ``_check_scales`` takes."""
    if len(scales) != len(names):
        raise LoRAError(f"got {len(names)} adapter names and {len(scales)} scales.")
    _check_scales(scales)
    unknown = [n for n in names if n not in state.adapters]
    if unknown:
        raise LoRAError(f"no adapter named {unknown} is loaded.", f"loaded: {sorted(state.adapters)}.")


def _converted(transformer: torch.nn.Module, lora: Any, name: str) -> Any:
    """A LoRA in a layout the model's spec converts (``ModelSpec.convert_lora``), in diffusers' layout;
    a LoRAError where the conversion fails on a malformed file."""
    if not isinstance(lora, dict) or not all(isinstance(v, torch.Tensor) for v in lora.values()):
        return lora  # parse_lora names what is wrong
    # 8-bit floats (an FP8 LoRA file): fp32 before any arithmetic (the matrices are kept in fp32)
    # (a LoRA's keys only: what matches no layer is left out anyway, and would take 4 times its bytes)
    lora = {
        k: v.float() if v.is_floating_point() and v.element_size() == 1 and _LORA_KEY.search(k) else v
        for k, v in lora.items()
    }
    try:
        spec = spec_for(transformer)
    except ConfigError:
        return lora
    try:
        return spec.convert_lora(lora)
    except Exception as e:  # diffusers' converters raise ValueError, KeyError, ...
        raise LoRAError(f"LoRA {name!r} cannot be converted to diffusers' layout: {str(e)[:200]}") from e


def _check_scales(scales: list[Any]) -> None:
    for v in scales:
        if not _finite_number(v, MAX_SCALE):
            raise LoRAError(
                f"LoRA scale {excerpt(v, 40)} is not a finite number in [-{MAX_SCALE:g}, {MAX_SCALE:g}]."
            )


def unload_lora(model: Any, names: str | list[str] | None = None) -> dict[str, Any]:
    """Drop every adapter (or those ``names``; the others stay as they are active) and restore the
    original weights bit for bit where no adapter is left active (and refit)."""
    transformer, compiled = _target(model)
    state = _state(transformer, unloading=True)
    names = list(state.adapters) if names is None else [names] if isinstance(names, str) else list(names)
    names = list(dict.fromkeys(names))  # each once
    unknown = [n for n in names if n not in state.adapters]
    if unknown:
        raise LoRAError(f"no adapter named {unknown} is loaded.", f"loaded: {sorted(state.adapters)}.")
    report = _apply(transformer, compiled, state, {n: s for n, s in state.active.items() if n not in names})
    for n in names:
        del state.adapters[n]
    if state.disabled is not None:
        state.disabled = {n: s for n, s in state.disabled.items() if n not in names}
    if not state.adapters:
        state.originals.clear()
        state.disabled = None
    _record(transformer, state)
    return report


# -- diffusers' adapter methods (PEFT's semantics), for ``lora.diffusers`` ----------------------------
def loaded(model: Any) -> dict[str, str]:
    """The loaded adapters, in load order: name -> where each came from."""
    state = _target(model)[0].__dict__.get("_prx_lora")
    return {n: a.source for n, a in state.adapters.items()} if state is not None else {}


def active(model: Any, *, set_aside: bool = False) -> dict[str, float]:
    """The adapters in the weights and their scales: {} while disabled, or (``set_aside``, as PEFT
    reports them) those ``enable_lora`` will apply."""
    state = _target(model)[0].__dict__.get("_prx_lora")
    if state is None:
        return {}
    return dict(state.disabled if set_aside and state.disabled is not None else state.active)


def set_adapters(model: Any, names: list[str], scales: list[float]) -> None:
    """``set_lora``; while disabled, what ``enable_lora`` will apply (PEFT keeps its layers disabled
    through ``set_adapters``)."""
    state = _state(_target(model)[0])
    if state.disabled is None:
        set_lora(model, names, scales)
        return
    _check_active(state, names, scales)
    state.disabled = dict(zip(names, map(float, scales), strict=True))
    for n, scale in state.disabled.items():
        state.adapters[n].scale = scale


def disable_lora(model: Any) -> None:
    """The base weights; the active adapters set aside for ``enable_lora``."""
    transformer, compiled = _target(model)
    state = _state(transformer)
    if state.adapters and state.disabled is None:
        set_aside = dict(state.active)
        _apply(transformer, compiled, state, {})
        state.disabled = set_aside


def enable_lora(model: Any) -> None:
    """The adapters ``disable_lora`` set aside, applied again."""
    transformer, compiled = _target(model)
    state = _state(transformer)
    if state.disabled is not None:
        _apply(transformer, compiled, state, state.disabled)
        state.disabled = None


def delete_adapters(model: Any, names: list[str]) -> None:
    """``unload_lora(model, names)`` for the names loaded (others may be another component's: PEFT
    passes them over); then, as PEFT does, when an active adapter (or one ``disable_lora`` set aside)
    was deleted and none is left active, the first remaining by name is, at the scale it last had."""
    transformer, compiled = _target(model)
    state = _state(transformer)
    names = [n for n in dict.fromkeys(names) if n in state.adapters]
    if not names:
        return
    off = state.disabled is not None
    deleted_active = any(n in (state.disabled if off else state.active) for n in names)
    unload_lora(model, names)
    if off and state.disabled is None:  # all gone: PEFT's layers stay disabled until unload_lora
        state.disabled = {}
    if (
        not deleted_active
        or not state.adapters
        or (state.disabled if state.disabled is not None else state.active)
    ):
        return
    first = state.adapters[min(state.adapters)]
    logger.warning("the active LoRA adapters were deleted: %r is active now (as PEFT does)", first.name)
    if state.disabled is not None:
        state.disabled = {first.name: first.scale}
    else:
        _apply(transformer, compiled, state, {first.name: first.scale})


def summary(model: Any) -> dict[str, Any] | None:
    """Loaded adapters, their layer counts and the active scales; ``disabled``: the scales
    ``disable_lora`` set aside, while it holds (a later ``load_lora_adapter`` is set aside too, even
    after every adapter was deleted, as PEFT's layers stay disabled). None without LoRA."""
    transformer, _ = _target(model)
    state = transformer.__dict__.get("_prx_lora")
    if state is None or not state.adapters and state.disabled is None:
        return None
    out = {
        "adapters": {n: {"layers": len(a.layers), "source": a.source} for n, a in state.adapters.items()},
        "active": dict(state.active),
    }
    if state.disabled is not None:
        out["disabled"] = dict(state.disabled)
    return out


def export_state(
    model: Any,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any] | None]:
    """What an artifact stores of the LoRA state: (exact originals of the changed weights, every
    adapter's matrices as ``<adapter>/<layer>/down|up``, a JSON record), or ({}, {}, None)."""
    transformer, _ = _target(model)
    state = transformer.__dict__.get("_prx_lora")
    if state is None or not state.adapters and state.disabled is None:
        return {}, {}, None
    tensors, adapters = {}, {}
    for name, adapter in state.adapters.items():
        adapters[name] = {
            "source": adapter.source[:500],
            "layers": {m: lay.scale for m, lay in adapter.layers.items()},
            "scale": adapter.scale,
        }
        for mod, layer in adapter.layers.items():
            tensors[f"{name}/{mod}/down"], tensors[f"{name}/{mod}/up"] = layer.down, layer.up
    record = {"adapters": adapters, "active": dict(state.active)}
    if state.disabled is not None:
        record["disabled"] = dict(state.disabled)
    return dict(state.originals), tensors, record


#: the LoRA record an artifact holds (``export_state``); the matrices are checked against the model
_RECORD = schema.Dict(
    {
        "adapters": schema.Map(
            schema.Str(64, pattern=_ADAPTER_NAME.pattern, what="an adapter name ([A-Za-z0-9_.-])"),
            schema.Dict(
                {
                    "source": schema.Str(500),
                    "layers": schema.Map(
                        schema.Str(300), schema.Float(-MAX_LAYER_SCALE, MAX_LAYER_SCALE), max_len=100_000
                    ),
                    "scale": schema.Float(-MAX_SCALE, MAX_SCALE),  # since 0.28: the scale it last had
                },
                optional=("scale",),
            ),
            max_len=1000,
        ),
        "active": schema.Map(schema.Str(64), schema.Float(-MAX_SCALE, MAX_SCALE), max_len=1000),
        # since 0.28: what diffusers' disable_lora set aside (the weights hold no adapter then)
        "disabled": schema.Map(schema.Str(64), schema.Float(-MAX_SCALE, MAX_SCALE), max_len=1000),
    },
    optional=("disabled",),
)


def restore_state(transformer: torch.nn.Module, record: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Load the adapters ``export_state`` saved into a transformer that holds the original weights,
    and activate them as they were. Raises LoRAError naming what is malformed (nothing changes)."""
    try:
        schema.check(_RECORD, record, "the LoRA record")
    except schema.SchemaError as e:
        raise LoRAError(str(e)) from e
    adapters_data, active, disabled = record["adapters"], record["active"], record.get("disabled")
    if not set(active) | set(disabled or {}) <= set(adapters_data) or active and disabled is not None:
        raise LoRAError("the LoRA record's adapters and active scales do not match.")
    _check_scales(list(active.values()))
    linears = _linear_names(transformer)
    adapters = {}
    for name, data in adapters_data.items():
        layers = {}
        for mod, scale in data["layers"].items():
            lin = linears.get(mod)
            down, up = tensors.get(f"{name}/{mod}/down"), tensors.get(f"{name}/{mod}/up")
            if lin is None or down is None or up is None:
                raise LoRAError(f"adapter {name!r}: layer {str(mod)[:80]!r} is unknown or incomplete.")
            ok = (
                down.dim() == 2
                and up.dim() == 2
                and down.dtype == up.dtype == torch.float32
                and 0 < down.shape[0] == up.shape[1]
                and down.shape[1] == lin.in_features
                and up.shape[0] == lin.out_features
                and bool(torch.isfinite(down).all() and torch.isfinite(up).all())
            )
            if not ok:
                raise LoRAError(f"adapter {name!r}: layer {mod} matrices do not fit or are not finite.")
            dev = _compute_device(lin)
            layers[mod] = LoRALayer(down.to(dev), up.to(dev), float(scale))
        adapters[name] = Adapter(name, layers, [], data["source"], float(data.get("scale", 1.0)))
    named = {
        f"{n}/{mod}/{part}"
        for n, d in adapters_data.items()
        for mod in d["layers"]
        for part in ("down", "up")
    }
    extra = sorted(set(tensors) - named)
    if extra:  # as the weights file: nothing in it that its record does not account for
        raise LoRAError(f"{len(extra)} tensor(s) the LoRA record does not name, e.g. {extra[0][:80]!r}.")
    state = _state(transformer)
    state.adapters.update(adapters)
    _apply(transformer, None, state, dict(active))
    state.disabled = None if disabled is None else dict(disabled)


def make_random_lora(
    model: torch.nn.Module,
    rank: int = 4,
    *,
    seed: int = 0,
    std: float = 0.02,
    targets: tuple[str, ...] | None = None,
    layout: str = "peft",
    alpha: float | None = None,
) -> dict[str, torch.Tensor]:
    """A random LoRA state dict for the model's linears (tests, demos, benchmarks): those whose names
    end with one of ``targets``, or by default the blocks' linears (``ModelSpec.block_linears``).

    layout "peft": ``transformer.<module>.lora_A.weight``; "kohya": ``lora_unet_<module>.lora_down.weight``.
    """
    block_linears = spec_for(model).block_linears if targets is None else None
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for n, m in _linear_names(model).items():
        if not (block_linears.match(n) if block_linears is not None else any(n.endswith(t) for t in targets)):
            continue
        a = torch.randn(rank, m.in_features, generator=g) * std
        b = torch.randn(m.out_features, rank, generator=g) * std
        if layout == "kohya":
            k = "lora_unet_" + n.replace(".", "_")
            sd[f"{k}.lora_down.weight"], sd[f"{k}.lora_up.weight"] = a, b
            if alpha is not None:
                sd[f"{k}.alpha"] = torch.tensor(alpha)
        else:
            sd[f"transformer.{n}.lora_A.weight"], sd[f"transformer.{n}.lora_B.weight"] = a, b
            if alpha is not None:
                sd[f"transformer.{n}.alpha"] = torch.tensor(alpha)
    return sd
