"""Export: one transformer step as a ``torch.export`` program.

* ``step``: ``export_step``, the export itself (dynamic batch, image size and text length over a
  ``prx_compile.shapes.ShapeRange``, the axes the model's spec names), the example inputs, the
  weight tensors of a step and the modules' plain settings it bakes in;
* ``repeat``: the first block of each block list traced, copied for the others.
"""

from .step import Step, example_inputs, export_step, settings, step_module, weight_tensors

__all__ = ["Step", "example_inputs", "export_step", "settings", "step_module", "weight_tensors"]
