"""``EngineSets``: the engine sets of one compiled transformer, the shape policy that picks one for a
call, and the CUDA graphs that replay them.

A call runs the most specific set that fits its shape, building it on first use. A shape whose batch
alone is too large runs in batch chunks that the sets take (``on_shape_miss: split``, the default; a
warning once per shape); any other shape outside every set gets a set of its own (``build`` does that
for every miss, with a warning); ``error`` raises ``ShapeOutOfRangeError``. While the range set is not
built, the first ``auto_specialize`` new shapes inside it get static sets of their own.

Shapes are the spec's points (``ModelSpec.point``): (batch, height, width, text), where height and
width are latent pixels or (FLUX) image tokens and 1.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from .. import progress
from ..backends import Backend, make_backend
from ..errors import ShapeOutOfRangeError
from ..plan import Plan
from ..shapes import ShapeRange
from .cudagraphs import CUDAGraphRunner

logger = logging.getLogger(__name__)

#: the most tokens (batch x (image + text)) of an engine set a call outside every set may get built
#: (``on_shape_miss``): a size far beyond serving is refused in one line rather than compiled for
#: minutes (a 2048² PRX step at batch 4 has 66560)
MAX_MISS_TOKENS = 1 << 17


class EngineSets:
    """The engine sets over one transformer (see the module docstring).

    Attributes:
        backends: one ``Backend`` per engine set (``backend.shapes`` is its ``ShapeRange``).
        builds: how many engine sets were built in this process (cache hits and loads not counted).
        cache_hits: one record per set the engine cache was asked for (``io.cache``).
        replays_dropped: steps replayed ahead whose result a change then made void.
    """

    def __init__(self, model: torch.nn.Module, plan: Plan, backends: list[Backend] | None = None):
        self.model = model
        self.plan = plan
        self.spec = plan.spec
        self.device = torch.device(plan.config.device)
        self.backends: list[Backend] = (
            backends if backends is not None else [make_backend(model, plan, s) for s in plan.shape_sets()]
        )
        self.graphs: dict[int, CUDAGraphRunner] = {}
        self.pool = None
        self.rebuilding: dict[int, str] = {}  # id(engine set) -> why it is built again
        self.split_warned: set[tuple[int, int, int, int]] = set()  # shapes run in batch chunks
        self.builds = 0
        self.cache_hits: list[dict[str, Any]] = []
        self.replays_dropped = 0

    @property
    def graphs_on(self) -> bool:
        return self.plan.config.cuda_graphs and self.device.type == "cuda"

    # -- which set -------------------------------------------------------------------------------
    def for_inputs(self, inputs: dict[str, torch.Tensor]) -> Backend | None:
        """The engine set a call with ``inputs`` runs: the most specific one that fits (built or not),
        or None when none fits (a call would then build one, or raise). Nothing is built here."""
        point = self.spec.point(inputs)
        fits = [be for be in self.backends if be.shapes.fits(*point)]
        return min(fits, key=lambda be: be.shapes.volume()) if fits else None

    def widest(self) -> ShapeRange:
        return max((b.shapes for b in self.backends), key=lambda s: s.volume())

    def backend_for(self, inputs: dict[str, torch.Tensor]) -> Backend:
        """The most specific engine set that fits (built on first use), or a new one on a miss."""
        backend = self.for_inputs(inputs)
        if backend is not None and not backend.is_built and not backend.shapes.is_static():
            backend = self._set_of_its_own(inputs) or backend
        if backend is None:
            backend = self._miss(inputs)
        if not backend.is_built:
            i = next(i for i, be in enumerate(self.backends) if be is backend)
            backend = self.build(i)  # a cache hit replaces the set in self.backends
        backend.load()  # before any CUDA graph capture
        return backend

    def _describe(self, point: tuple[int, int, int, int]) -> str:
        b, h, w, t = point
        if self.spec.tokens:
            return f"batch {b}, {h} image tokens, text {t} tokens"
        return f"batch {b}, latent {h}x{w}, text {t} tokens"

    def _miss(self, inputs: dict[str, torch.Tensor]) -> Backend:
        point = self.spec.point(inputs)
        sets = "; ".join(be.shapes.describe() for be in self.backends)
        shape = self._describe(point)
        problems = self.widest().problems(*point)
        if any("multiple" in p for p in problems):  # no engine set can take it
            px = self.spec.multiple(self.plan.model_config) * self.plan.config.vae_scale_factor
            raise ShapeOutOfRangeError(
                f"{shape} is outside every engine set ({'; '.join(problems)}). Built for: {sets}.",
                f"use image sizes that are multiples of {px} pixels (e.g. {px * 32}).",
            )
        shapes = self.plan.static(*point)
        if shapes.max_tokens() > MAX_MISS_TOKENS:
            raise ShapeOutOfRangeError(
                f"{shape} is outside every engine set and is {shapes.max_tokens()} tokens a step, more than "
                f"{MAX_MISS_TOKENS}: no engines are built for it. Built for: {sets}.",
                "pass a smaller image or batch.",
            )
        if self.plan.config.on_shape_miss == "error":
            raise ShapeOutOfRangeError(
                f"{shape} is outside every engine set ({'; '.join(problems)}). Built for: {sets}.",
                "widen batch/aspect_bins/text_len or add the shape to specialize in the config, "
                "or set on_shape_miss='split' or 'build'.",
            )
        t0 = time.perf_counter()
        backend = self.add_set(shapes)
        logger.warning(
            "built engines for %s in %.1f s: it was outside every engine set (%s). Add it to "
            "specialize (or widen the range) to build it ahead.",
            shape,
            time.perf_counter() - t0,
            sets,
        )
        return backend

    def add_set(self, shapes: ShapeRange) -> Backend:
        """A new engine set for ``shapes``, built now; a failed build leaves no set behind."""
        self.backends.append(make_backend(self.model, self.plan, shapes))
        try:
            return self.build(len(self.backends) - 1)
        except BaseException:
            self.backends.pop()
            raise

    def _set_of_its_own(self, inputs: dict[str, torch.Tensor]) -> Backend | None:
        """``auto_specialize``: a static engine set for this call's shape, built now, where the call
        would build the config's range set and fewer than ``auto_specialize`` such sets exist (the
        static sets inside a range that ``specialize`` does not name); None: the range set is built
        (also for a range ``set_range`` declared: that asks for the range)."""
        cfg = self.plan.config
        ranges = [be.shapes for be in self.backends if not be.shapes.is_static()]
        if cfg.static or self.plan.range_shapes() not in ranges:
            return None
        planned = set(self.plan.specialized_shapes())
        made = [
            be.shapes
            for be in self.backends
            if be.shapes.is_static()
            and be.shapes not in planned
            and any(r.fits(*be.shapes.opt_point()) for r in ranges)
        ]
        if len(made) >= cfg.auto_specialize:
            return None
        backend = self.add_set(self.plan.static(*self.spec.point(inputs)))
        logger.info(
            "built a static engine set for %s (auto_specialize: %d of %d; once there are %d, a new "
            "shape builds the range set)",
            backend.shapes.describe(),
            len(made) + 1,
            cfg.auto_specialize,
            cfg.auto_specialize,
        )
        return backend

    # -- build -----------------------------------------------------------------------------------
    def example(self, shapes: ShapeRange) -> dict[str, torch.Tensor]:
        """The step's inputs at ``shapes``' tuning point (as ``ModelSpec.arguments`` makes a call's)."""
        b, h, w, t = shapes.opt_point()
        dtype = next(self.model.parameters()).dtype
        kwargs = self.spec.example_inputs(self.model, b, h, w, t, dtype=dtype, device=self.device)
        return self.spec.arguments(self.model, kwargs)

    def build(self, index: int) -> Backend:
        """Build engine set ``index`` (through the engine cache where the config has one)."""
        backend = self.backends[index]
        why = self.rebuilding.pop(id(backend), None)
        example = self.example(backend.shapes)
        logger.info("building engine set %d/%d: %s", index + 1, len(self.backends), backend.shapes.describe())
        t0 = time.perf_counter()
        with progress.stage(f"engine set {index + 1}/{len(self.backends)}: {backend.shapes.describe()}"):
            if self.plan.config.engine_cache_dir:
                from ..io.cache import build_through_cache

                backend, hit = build_through_cache(backend, example)
                self.cache_hits.append(hit)
                self.backends[index] = backend
                if hit["load_s"] is None:
                    self.builds += 1
            else:
                backend.build(example)
                self.builds += 1
        logger.info("engine set ready in %.1f s: %s", time.perf_counter() - t0, backend.shapes.describe())
        if why:
            logger.warning(
                "rebuilt engine set %s in %.1f s: the transformer changed (%s).",
                backend.shapes.describe(),
                time.perf_counter() - t0,
                why,
            )
        return backend

    def build_all(self) -> None:
        """Build every engine set not built yet; load every set read from an artifact."""
        for i, backend in enumerate(self.backends):
            if not backend.is_built:
                self.build(i)
            else:
                backend.load()  # a loaded artifact's engines, deserialised now rather than at first use

    def rebuild(self, why: str, plan: Plan) -> None:
        """Replace every engine set by an unbuilt one over the same shapes under ``plan`` (built
        again at its next call)."""
        built = [b for b in self.backends if b.is_built]
        self.plan = plan
        self.graphs.clear()
        self.drop_graphs()
        fresh = [make_backend(self.model, plan, b.shapes) for b in self.backends]
        pending = self.rebuilding  # sets changed before and not built again yet keep their reason
        self.rebuilding = {
            id(new): why if old.is_built else pending[id(old)]
            for new, old in zip(fresh, self.backends, strict=True)
            if old.is_built or id(old) in pending
        }
        self.backends = fresh
        if built:
            logger.warning(
                "the transformer changed since its engines were built (%s): %d engine set(s) are built "
                "again at their next call.",
                why,
                len(built),
            )

    def set_range(self, shapes: ShapeRange) -> None:
        """Replace the range set(s) by one over ``shapes`` (built at its first call); static sets stay."""
        dropped = [b for b in self.backends if not b.shapes.is_static()]
        if any(b.is_built for b in dropped):
            logger.warning("dropping the built range engine set(s) for %s", shapes.describe())
        for b in dropped:
            self.graphs.pop(id(b), None)
        self.drop_graphs([])
        self.backends = [b for b in self.backends if b.shapes.is_static()]
        self.backends.append(make_backend(self.model, self.plan, shapes))

    # -- the step --------------------------------------------------------------------------------
    def call(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step: on the engine set that fits, or (``on_shape_miss: split``) for a batch no set
        takes whole, in chunks along the batch that sets take; else ``backend_for``'s miss."""
        if self.plan.config.on_shape_miss == "split" and self.for_inputs(inputs) is None:
            sizes = self.chunks(inputs)
            if sizes is not None:
                return self._in_chunks(inputs, sizes)
        return self._run(self.backend_for(inputs), inputs)

    def chunks(self, inputs: dict[str, torch.Tensor]) -> list[int] | None:
        """Batch sizes that add up to the call's batch, each taken by an engine set at the call's
        image size and text length (the largest such batch first, greedily); None where there is
        no such split (another image size or text length: a set of its own is built)."""
        b, h, w, t = self.spec.point(inputs)
        sizes, left = [], b
        while left:
            takes = (min(be.shapes.batch[1], left) for be in self.backends)
            n = max(
                (k for k, be in zip(takes, self.backends, strict=True) if be.shapes.fits(k, h, w, t)),
                default=0,
            )
            if n == 0:
                return None
            sizes.append(n)
            left -= n
        if (b, h, w, t) in self.split_warned:
            return sizes
        self.split_warned.add((b, h, w, t))
        sets = "; ".join(be.shapes.describe() for be in self.backends)
        logger.warning(
            "%s is outside every engine set (%s): it runs as batches of %s through the sets that take "
            "them. Add it to specialize (or widen the batch range) for engines of its own, or set "
            "on_shape_miss='build'.",
            self._describe((b, h, w, t)),
            sets,
            " + ".join(map(str, sizes)),
        )
        return sizes

    def _in_chunks(self, inputs: dict[str, torch.Tensor], sizes: list[int]) -> torch.Tensor:
        """The step on ``inputs`` as one step per chunk of ``sizes`` (the spec's batched inputs
        sliced), each chunk's output copied into the result before the next step runs (an engine
        set may reuse its output memory)."""
        out, start = None, 0
        for n in sizes:
            part = {k: v[start : start + n] if self.spec.batched(k) else v for k, v in inputs.items()}
            y = self._run(self.backend_for(part), part)
            if out is None:
                out = y.new_empty((sum(sizes), *y.shape[1:]))
            out[start : start + n].copy_(y)
            start += n
        return out

    def _run(self, backend: Backend, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step on ``backend``; its first one in this process is timed into ``backend.timings``
        (``first_run_s``: JIT kernels and warm-ups included; ``graph_capture_s``)."""
        if "first_run_s" in backend.timings:
            return self._step(backend, inputs)
        with progress.stage(f"first step ({backend.shapes.describe()})", backend.timings, "first_run_s"):
            out = self._step(backend, inputs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        runner = self.graphs.get(id(backend))
        if runner is not None and runner.capture_s is not None:
            backend.timings["graph_capture_s"] = runner.capture_s
        return out

    def _step(self, backend: Backend, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if not self.graphs_on:
            return backend(**inputs)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        runner = self.graphs.get(id(backend))
        if runner is None:
            runner = self.graphs[id(backend)] = CUDAGraphRunner(backend, pool=self.pool)
        runner.pool = self.pool  # a new pool after every graph was dropped (drop_graphs)
        return runner(**inputs)

    def replay(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The step replayed from the CUDA graph captured for ``inputs`` on a set that has run, or None
        where there is none (nothing is captured or built here)."""
        if not self.graphs_on:
            return None
        backend = self.for_inputs(inputs)
        runner = self.graphs.get(id(backend)) if backend is not None else None
        if runner is None or "first_run_s" not in backend.timings:
            return None
        return runner.replay(inputs)

    def drop_graphs(self, runners: list[CUDAGraphRunner] | None = None) -> None:
        """Drop the CUDA graphs of ``runners`` (None: every runner's). Once no graph is left, the
        next capture gets a new memory pool: PyTorch keeps the id of a pool whose graphs are all
        gone but refuses to capture into it again (an internal assert, ``use_count > 0``), and
        that set would then run without a graph."""
        for runner in self.graphs.values() if runners is None else runners:
            runner.reset()
        if not any(runner.graphs for runner in self.graphs.values()):
            self.pool = None

    # -- weights ---------------------------------------------------------------------------------
    @property
    def needs_refit(self) -> bool:
        """True when weight changes must be pushed into engines (``weights: engine``)."""
        return any(b.needs_refit and b.is_built for b in self.backends)

    def weights_changed(self, names: list[str]) -> dict[str, Any]:
        """Bring every built engine set up to date after these parameters changed in place (refit with
        ``weights: engine``; nothing with ``weights: inputs``, whose engines read them)."""
        total: dict[str, Any] = {"refit_s": 0.0, "engines_refit": 0}
        for backend in self.backends:
            if not backend.is_built:
                continue
            report = backend.weights_changed(names)
            total["refit_s"] += report.get("refit_s", 0.0)
            total["engines_refit"] += report.get("engines_refit", 0)
            if not report.get("graphs_valid", True) and id(backend) in self.graphs:
                self.drop_graphs([self.graphs[id(backend)]])
        return total
