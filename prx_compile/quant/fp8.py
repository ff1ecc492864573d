"""``precision: fp8``: the transformer blocks' linears as FP8 GEMMs.

    install(transformer, spec.block_linears)   # block linears -> FP8Linear, in place (as torchao's quantize_)
    place_masters(transformer, "host")         # their exact weights to pinned CPU memory (fp8_masters)
    requantize(transformer, names)           # after those weights changed in place

Each targeted ``nn.Linear`` (the model's spec names them: ``ModelSpec.block_linears``, its blocks'
attention projections and MLP linears) becomes an ``FP8Linear``: the same
module with the same ``weight`` parameter (the exact weights, which LoRA merges into), plus two
non-persistent buffers derived from it, ``weight_fp8`` (out, in) float8_e4m3fn and ``weight_scale``
(out,) fp32, one scale per output channel. Its forward is ``torch.ops.prx_compile.fp8_linear``:
activations are quantised per token (row-wise dynamic scales) and multiplied by ``torch._scaled_mm``.
Embedders, modulation and the final layer stay in the model's dtype.

The buffers are engine inputs like every weight (``weights: inputs``), so re-quantising writes into
them in place: CUDA graphs and engines stay valid, nothing is rebuilt.

The step never reads ``weight`` (the master), so it may live elsewhere (``fp8_masters: host``):
``place_masters`` moves it into pinned CPU memory (the same ``Parameter`` object, its ``.data``
replaced), and re-quantising copies it to the buffers' device first. Then the block linears take
their FP8 bytes on the device, not those plus their bf16 ones.
"""

from __future__ import annotations

import re

import torch

from ..errors import ConfigError
from ..ops.kernels import row_quant_fp8


def quantize_weight(
    weight: torch.Tensor, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> ((N, K) float8_e4m3fn, (N,) fp32) with ``weight ~= q * scale[:, None]``, computed on
    ``device`` (None: the weight's) by the activations' row quantisation (``ops.kernels.row_quant_fp8``:
    one pass per row on a GPU, no fp32 copy of the weight)."""
    # a blocking copy: from pinned host memory (``fp8_masters: host``) an asynchronous one could read
    # the master after a write the caller makes once this returns
    w = weight.detach().to(device if device is not None else weight.device)
    q, scale = row_quant_fp8(w)
    return q, scale.view(-1)


class FP8Linear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward is an FP8 GEMM over its ``weight_fp8`` / ``weight_scale``.

    ``weight`` and ``bias`` are the original module's parameters (the same tensors). Shapes:
    x (..., in_features) -> (..., out_features), in x's dtype.
    """

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> FP8Linear:
        module = cls.__new__(cls)
        torch.nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.weight = linear.weight
        module.bias = linear.bias
        q, scale = quantize_weight(linear.weight)
        module.register_buffer("weight_fp8", q, persistent=False)
        module.register_buffer("weight_scale", scale, persistent=False)
        module._quantized_version = linear.weight._version
        module.train(linear.training)
        return module

    def requantize(self, value: torch.Tensor | None = None) -> None:
        """Refresh ``weight_fp8`` / ``weight_scale`` from ``weight`` (or from ``value``, the weight's
        current value already on the copies' device: a LoRA's merge, which then need not read a host
        master back), in place (engines and CUDA graphs keep reading the same buffers); as new buffers
        when the module was cast or reshaped, which rebuilds its engine sets anyway."""
        q, scale = quantize_weight(self.weight if value is None else value, self.weight_fp8.device)
        same = all(
            b.dtype == v.dtype and b.shape == v.shape and b.device == v.device
            for b, v in ((self.weight_fp8, q), (self.weight_scale, scale))
        )
        if same:
            with torch.no_grad():
                self.weight_fp8.copy_(q)
                self.weight_scale.copy_(scale)
        else:
            self.weight_fp8, self.weight_scale = q, scale
        self._quantized_version = self.weight._version

    def refresh(self) -> None:
        """``requantize`` if ``weight`` changed in place since the last quantisation (PyTorch's
        version counter: ``copy_``, ``load_state_dict``; not writes through ``.data``)."""
        if self.weight._version != self._quantized_version:
            self.requantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.prx_compile.fp8_linear(x, self.weight_fp8, self.weight_scale, self.bias)


def install(transformer: torch.nn.Module, targets: re.Pattern) -> int:
    """Replace the linears of ``transformer`` whose names ``targets`` matches by ``FP8Linear`` in place
    (idempotent).

    Returns how many modules run in FP8. Linears whose sizes FP8 GEMMs cannot take (not multiples of
    16) stay as they are."""
    count = 0
    for name, module in list(transformer.named_modules()):
        if not targets.match(name) or not isinstance(module, torch.nn.Linear):
            continue
        if isinstance(module, FP8Linear):
            count += 1
            continue
        if module.in_features % 16 or module.out_features % 16:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = transformer.get_submodule(parent_name)
        parent._modules[attr] = FP8Linear.from_linear(module)  # ModuleList/Sequential index or attribute
        count += 1
    return count


def _pinned(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_pinned()


def place_masters(transformer: torch.nn.Module, where: str) -> int:
    """Keep the ``FP8Linear`` masters (``weight``) where ``fp8_masters`` says: "host", pinned CPU
    memory (when their FP8 copies are on a GPU); "device", beside the FP8 copies. Each moved weight
    stays the same ``Parameter`` (``.data`` replaced), so a LoRA's or a user's references hold. Returns
    how many were moved. Host memory that cannot be pinned is a ConfigError, every master back on the
    device."""
    moved = 0
    for module in transformer.modules():
        if not isinstance(module, FP8Linear):
            continue
        weight, device = module.weight, module.weight_fp8.device
        if where == "host" and device.type != "cpu" and not _pinned(weight):  # a cast unpins it
            try:
                data = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=True)
            except RuntimeError as e:
                place_masters(transformer, "device")
                wanted = sum(m.weight.nbytes for m in transformer.modules() if isinstance(m, FP8Linear))
                why = str(e).splitlines()[0][:120].rstrip(".")
                raise ConfigError(
                    f"fp8_masters: host could not pin {wanted / 2**30:.1f} GB of host memory for the FP8 "
                    f"linears' exact weights ({why}).",
                    "free host memory, or use fp8_masters: device (they stay on the GPU).",
                ) from e
            data.copy_(weight.detach())
        elif where == "device" and weight.device != device:
            data = weight.detach().to(device)
        else:
            continue
        with torch.no_grad():
            weight.data = data
        module._quantized_version = weight._version  # the values are the ones quantised
        moved += 1
    if moved and where == "host" and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the masters' device blocks go back to the driver (and TensorRT)
    return moved


def requantize(transformer: torch.nn.Module, weight_names: list[str] | set[str]) -> int:
    """Re-quantise the FP8 copies of these parameters (weight FQNs); other names are ignored.
    Returns how many modules were refreshed."""
    modules = dict(transformer.named_modules())
    done = 0
    for fqn in weight_names:
        module = modules.get(fqn.rpartition(".")[0])
        if isinstance(module, FP8Linear) and fqn.endswith(".weight"):
            module.requantize()
            done += 1
    return done


def fp8_modules(transformer: torch.nn.Module) -> int:
    """How many ``FP8Linear`` modules ``transformer`` has."""
    return sum(isinstance(m, FP8Linear) for m in transformer.modules())
