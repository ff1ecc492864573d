"""Put on the PYTHONPATH of ``generate``'s workers by tests/test_generate.py: the worker whose
``RANK`` equals ``PRX_TEST_KILL_RANK`` kills itself with SIGKILL once its pipeline is loaded, at the
point where it would wait for its peers before its first image (with ``PRX_TEST_KILL_EARLY`` set:
at once, before it joins them). The product has no hook for this: ``prx_compile.tools.generate`` is
patched here as it is imported."""

import importlib.abc
import importlib.util
import os
import signal
import sys

TARGET = "prx_compile.tools.generate"


class _KillAtFirstWait(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # the real finders find it; this one only patches what they load
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module._wait_for_peers = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)

        spec.loader.exec_module = exec_module
        return spec


_RANK = os.environ.get("PRX_TEST_KILL_RANK")
if _RANK and _RANK == os.environ.get("RANK"):
    sys.meta_path.insert(0, _KillAtFirstWait())
if _RANK and _RANK == os.environ.get("RANK") and os.environ.get("PRX_TEST_KILL_EARLY"):
    os.kill(os.getpid(), signal.SIGKILL)  # before it joins its peers: they would wait for it
