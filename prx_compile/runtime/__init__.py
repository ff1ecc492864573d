"""Runtime: what runs the compiled step in place of ``pipe.transformer``.

* ``module``: ``compile_prx`` and ``CompiledTransformer`` (engine sets per shape range, built on first
  use or through the engine cache, chosen per call);
* ``watch``: what changed in the transformer since its engine sets were built;
* ``cudagraphs``: whole-step CUDA graphs, captured once per input signature and replayed.
"""

from .module import CompiledTransformer, compile_prx

__all__ = ["CompiledTransformer", "compile_prx"]
