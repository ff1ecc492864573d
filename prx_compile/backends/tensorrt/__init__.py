"""The Torch-TensorRT backend (Torch-TensorRT is imported on first use, never when these modules load).

* ``backend``: ``TensorRTBackend``: export, lower, partition into TensorRT engines and PyTorch ops;
* ``repeats``: structurally identical partitions (the blocks) share one engine;
* ``program``: the partitioned step as validated data (``Program``) and its interpreter;
* ``shim``: every call into Torch-TensorRT and TensorRT, and the versions they report.
"""

from .backend import TensorRTBackend

__all__ = ["TensorRTBackend"]
