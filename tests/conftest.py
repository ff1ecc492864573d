"""Shared CPU fixtures: tiny non-degenerate PRX transformers and their exported graphs."""

import gc
import logging

import pytest
import torch

from prx_compile.export import example_inputs, export_step
from prx_compile.shapes import ShapeRange
from prx_compile.tools.testing import make_prx

RANGE = ShapeRange(batch=(1, 4), height=(8, 32), width=(8, 32), text=(4, 16))


def pytest_collection_finish(session):
    """The modules every test imported (torch, diffusers, ...) are never garbage: keep the cyclic
    collector off them, and collect less often (exports make many short-lived objects)."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


@pytest.fixture(autouse=True)
def _quiet_diffusers():
    logging.getLogger("diffusers").setLevel(logging.ERROR)


def prx_inputs(model, batch=2, h=16, w=16, text=12, masked=5, seed=0):
    return example_inputs(model, batch, h, w, text, masked_tokens=masked, seed=seed)


@pytest.fixture(scope="session", params=["reshape", "fold"])
def exported(request):
    """(model, ExportedProgram) for both patchify forms, exported with dynamic shapes."""
    model = make_prx(patchify=request.param)
    ep, _ = export_step(model, prx_inputs(model), RANGE)
    return model, ep


def plan_of(config=None, model=None, **overrides):
    """The ``Plan`` of ``config`` (anything ``CompileConfig.resolve`` takes) for ``model`` (default: the
    tiny PRX): what the config means for that model here."""
    from prx_compile import CompileConfig
    from prx_compile.plan import Plan

    return Plan.resolve(CompileConfig.resolve(config, **overrides), model if model is not None else _tiny())


_TINY = []


def _tiny():
    if not _TINY:
        _TINY.append(make_prx())
    return _TINY[0]


def eager(model, kw):
    with torch.no_grad():
        return model(**kw, return_dict=False)[0]
