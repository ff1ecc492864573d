"""Export: one PRX denoising step as a ``torch.export`` program.

* ``fusion``: the module-level rewrite, before export, of each PRX attention's core (QK norm, RoPE,
  joint attention) into one ``prx_compile::prx_attention`` op (``CompileConfig.attention = "fused"``);
* ``step``: ``export_prx``, the export itself (dynamic batch, latent size and text length over a
  ``prx_compile.shapes.ShapeRange``), and the example inputs and weight tensors of a step.
"""

from .fusion import FusedPRXAttnProcessor, fused_attention_processors
from .step import ACTIVATIONS, PRXStep, example_inputs, export_prx, image_ids, weight_tensors

__all__ = [
    "ACTIVATIONS",
    "FusedPRXAttnProcessor",
    "PRXStep",
    "example_inputs",
    "export_prx",
    "fused_attention_processors",
    "image_ids",
    "weight_tensors",
]
