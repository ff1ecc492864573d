"""The Torch-TensorRT backend (Torch-TensorRT is imported to build, never when these modules load).

* ``backend``: ``TensorRTBackend``: export, lower, partition into TensorRT engines and PyTorch ops;
* ``repeats``: structurally identical partitions (the blocks) share one engine;
* ``program``: the partitioned step as validated data (``Program``) and its interpreter;
* ``shim``: every call into Torch-TensorRT (the build), and the versions;
* ``engine``: the engines run, saved, loaded and refit through TensorRT's own bindings.
"""

from .backend import TensorRTBackend

__all__ = ["TensorRTBackend"]
