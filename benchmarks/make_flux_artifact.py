"""Save a compiled FLUX.1-dev (random weights, bf16, ``flux-1024-bf16``, first call made) and its
inputs, for ``load_probe.py``: ``python benchmarks/make_flux_artifact.py ARTIFACT INPUTS.pt``
(``--tiny``: the tiny FLUX on a CPU with the eager backend)."""

import sys
import time

import torch
from flux import DEV, SPEC, TINY, make_model

from prx_compile import compile_transformer, save_compiled

art, inputs = sys.argv[1:3]
tiny = "--tiny" in sys.argv
device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
model = make_model(TINY if tiny else DEV, device, dtype)
size, text = (16, 8) if tiny else (1024, 512)
kw = SPEC.example_inputs(model, 1, (size // 16) ** 2, 1, text, dtype=dtype, device=device, seed=0)
kw["timestep"] = torch.full((1,), 0.5, device=device)
overrides = (
    dict(resolution=size, vae_scale_factor=8, text_len=[text, text], specialize=[[size, size, 1]])
    if tiny
    else {}
)
if tiny:
    overrides.update(backend="eager", device="cpu", dtype=None)
ct = compile_transformer(model, config="flux-1024-bf16", **overrides)
out = ct(**kw, return_dict=False)[0]
t0 = time.perf_counter()
save_compiled(ct, art)
torch.save({k: v.cpu() for k, v in kw.items()}, inputs)
torch.save(out.cpu(), inputs + ".out")  # what the loaded artifact must compute (load_probe.py)
print(f"saved {art} in {time.perf_counter() - t0:.1f} s")
