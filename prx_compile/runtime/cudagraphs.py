"""Whole-step CUDA graphs: capture ``fn(**inputs)`` once per input signature, then replay it.

One replay launches every TensorRT engine and every PyTorch op of the step (attention included), so
the ~100 launches per step cost one. Graphs share one memory pool (they replay one at a time and
their outputs are copied out at once); ``reset()`` drops them (after a refit, or when the weights
the captured launches read have moved).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


class CUDAGraphRunner:
    """Replays ``fn`` from CUDA graphs keyed by the inputs' shapes and dtypes.

    fn: takes tensor keyword arguments, returns one tensor (no host sync, no data-dependent shapes).
    max_graphs: least-recently-used graphs beyond this are dropped.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], max_graphs: int = 8, warmup: int = 2, pool=None):
        self.fn = fn
        self.max_graphs = max_graphs
        self.warmup = warmup
        self.graphs: OrderedDict = OrderedDict()
        self.pool = pool
        self.captures = 0
        self.capture_s: float | None = None  # seconds of the last capture (warm-ups not counted)
        self.failures: dict[tuple, str] = {}  # input signatures that cannot be captured, and why

    @staticmethod
    def key(inputs: dict[str, torch.Tensor]) -> tuple:
        return tuple((k, tuple(v.shape), v.dtype, v.device) for k, v in sorted(inputs.items()))

    def reset(self) -> None:
        self.graphs.clear()

    def _capture(self, inputs: dict[str, torch.Tensor]):
        static = {k: v.clone() for k, v in inputs.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):  # lazy builds, JIT kernels and allocations happen here
                self.fn(**static)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        t0 = time.perf_counter()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.fn(**static)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0
        self.captures += 1
        logger.info("captured a CUDA graph for %s", {k: tuple(v.shape) for k, v in inputs.items()})
        return graph, static, out

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        k = self.key(inputs)
        if k in self.failures:
            return self.fn(**inputs)
        entry = self.graphs.get(k)
        if entry is None:
            try:
                entry = self.graphs[k] = self._capture(inputs)
            except RuntimeError as e:  # e.g. a host-to-device copy inside the step: run without a graph
                self.failures[k] = f"{type(e).__name__}: {e}"[:300]
                logger.warning(
                    "CUDA graph capture failed for this input shape, running without: %s", self.failures[k]
                )
                torch.cuda.synchronize()
                return self.fn(**inputs)
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(k)
        return self._replay(entry, inputs)

    def replay(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The step from the graph already captured for ``inputs``' signature; None where there is none
        (nothing is captured here)."""
        k = self.key(inputs)
        entry = self.graphs.get(k)
        if entry is None:
            return None
        self.graphs.move_to_end(k)
        return self._replay(entry, inputs)

    @staticmethod
    def _replay(entry, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        graph, static, out = entry
        for name, v in inputs.items():
            static[name].copy_(v)
        graph.replay()
        return out.clone()
