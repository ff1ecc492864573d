"""Runtime: what runs the compiled step in place of ``pipe.transformer``.

* ``module``: ``compile_transformer`` (and ``compile_prx``), ``assemble`` and ``CompiledTransformer``,
  the facade;
* ``engine_sets``: the engine sets per shape range, built on first use or through the engine cache,
  chosen per call, and their CUDA graphs;
* ``follower``: what a change of the transformer costs before the next call; the keepers (a LoRA,
  FP8 copies) register there;
* ``watch``: what changed in the transformer since its engine sets were built;
* ``cudagraphs``: whole-step CUDA graphs, captured once per input signature and replayed.
"""

from .module import CompiledTransformer, compile_prx, compile_transformer

__all__ = ["CompiledTransformer", "compile_prx", "compile_transformer"]
