"""Export: one transformer step as a ``torch.export`` program.

* ``step``: ``export_step``, the export itself (dynamic batch, image size and text length over a
  ``prx_compile.shapes.ShapeRange``, the axes the model's spec names), the example inputs and the
  weight tensors of a step;
* ``repeat``: the first block of each block list traced, copied for the others (blocks alike in
  their parameters, traced code and plain ``settings``, which an export bakes in).
"""

from .repeat import settings
from .step import Step, example_inputs, export_step, step_module, weight_tensors

__all__ = ["Step", "example_inputs", "export_step", "settings", "step_module", "weight_tensors"]
