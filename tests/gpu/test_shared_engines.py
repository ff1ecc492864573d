"""One engine per distinct piece (``share_engines``), on the GPU: a 4-block PRX's blocks 1-3 run one
engine; outputs match the unshared build and eager; LoRA in place, the artifact and the range set."""

import pytest
import torch

from prx_compile import compile_prx, load_compiled, load_lora, save_compiled, unload_lora
from prx_compile.backends.tensorrt import engine
from prx_compile.lora import make_random_lora
from prx_compile.tools.bench import rel_err
from prx_compile.tools.testing import make_prx

from .conftest import RANGE, SMALL_PRX
from .test_tensorrt import TOL, eager, inputs

pytestmark = pytest.mark.gpu
DEEP = {**SMALL_PRX, "depth": 4}
STATIC = dict(static=True, specialize=[[512, 512, 2]], **RANGE)


@pytest.fixture(scope="module")
def model():
    return make_prx(DEEP, dtype=torch.bfloat16, device="cuda")


@pytest.fixture(scope="module")
def shared(model):
    return compile_prx(model, **STATIC).build()


def test_the_blocks_run_one_engine_and_match_the_unshared_build(model, shared):
    kw = inputs(model)
    out = shared(**kw, return_dict=False)[0].clone()
    rep = shared.backends[0].report()
    assert (rep["engines"], rep["engine_calls"], rep["torch_segments"]) == (3, 5, 4), rep
    assert rel_err(out, eager(model, kw)) < TOL
    # sharing changes no number: compared on the same kernels (each build measures its own, and two
    # measurements may pick two exact kernels that round differently)
    pinned = dict(attention_kernel="cudnn", fuse_mlp_gate=False, **STATIC)
    one = compile_prx(model, **pinned)
    unshared = compile_prx(model, share_engines=False, **pinned)
    got, want = one(**kw, return_dict=False)[0], unshared(**kw, return_dict=False)[0]
    assert unshared.backends[0].report()["engines"] == 5 and one.backends[0].report()["engines"] == 3
    assert rel_err(got, want) < 1e-3
    assert not out.isnan().any()
    timings = shared.backends[0].timings
    assert {"export_s", "lower_s", "compile_s", "engines_build_s", "engines_wall_s"} <= set(timings), timings
    assert timings["kernels_measure_s"] > 0, timings  # the kernels measured (and warm) during the export
    kernels = shared.backends[0].kernels
    assert kernels.how == "measured" and kernels.ms and kernels.attention in shared.plan.attention_candidates


def test_lora_in_place_reaches_every_block_of_a_shared_engine(model, shared):
    kw = inputs(model, seed=7)
    base = shared(**kw, return_dict=False)[0].clone()
    load_lora(shared, make_random_lora(model, 16, seed=1, std=0.05), "a")
    out = shared(**kw, return_dict=False)[0].clone()
    assert rel_err(out, eager(model, kw)) < TOL and rel_err(out, base) > 1e-2
    unload_lora(shared)
    assert torch.equal(shared(**kw, return_dict=False)[0], base)
    assert shared.builds == 1


def test_the_artifact_holds_each_engine_once(model, shared, tmp_path):
    kw = inputs(model, seed=9)
    want = shared(**kw, return_dict=False)[0].clone()
    save_compiled(shared, tmp_path / "art")
    assert len(list((tmp_path / "art" / "sets" / "0").glob("*.engine"))) == 3
    loaded = load_compiled(tmp_path / "art")
    assert torch.equal(loaded(**kw, return_dict=False)[0], want)
    assert loaded.backends[0].report()["engine_calls"] == 5 and loaded.builds == 0


def test_a_range_set_shares_its_block_pieces(model):
    ct = compile_prx(model, **RANGE)
    for kw in (inputs(model, h=48, w=80), inputs(model, batch=1, text=30, masked=5, seed=4)):
        out = ct(**kw, return_dict=False)[0]
        assert rel_err(out, eager(model, kw)) < TOL
    rng = max(ct.backends, key=lambda b: b.shapes.volume())
    rep = rng.report()
    # each middle block reuses at least two of the first block's pieces (PRX: 9 distinct at any depth)
    assert rep["engine_calls"] - rep["engines"] >= 2 * (DEEP["depth"] - 2), rep
    sizes = [engine.context_memory_bytes(m) for m in rng.engines.values()]
    assert rng.arena.nbytes == max(sizes) < sum(sizes), sizes  # one arena: the largest, not the sum


def test_engines_built_side_by_side_and_on_one_arena_match_one_at_a_time_on_their_own_memory(model, shared):
    """build_workers and share_context_memory change how a set is built and where its contexts'
    memory lives, not what it computes: bit-identical outputs, graphed and not, at the default
    static_linears (more distinct engines); the arena holds the largest context (the range set's
    test below checks that is less than the sum)."""
    kw = inputs(model, seed=11)
    # on pinned kernels: two builds' measurements may pick two kernels that round differently
    config = {**STATIC, "static_linears": "torch", "attention_kernel": "cudnn", "fuse_mlp_gate": False}
    serial = compile_prx(model, build_workers=1, share_context_memory=False, **config)
    want = serial(**kw, return_dict=False)[0].clone()
    for cuda_graphs in (True, False):
        ct = compile_prx(model, build_workers=4, cuda_graphs=cuda_graphs, **config)
        for _ in range(2):  # a graph's capture, then its replay
            assert torch.equal(ct(**kw, return_dict=False)[0], want)
        rep, backend = ct.backends[0].report(), ct.backends[0]
        assert rep["engines"] == serial.backends[0].report()["engines"] > 3, rep
        sizes = [engine.context_memory_bytes(m) for m in backend.engines.values()]
        assert backend.arena.nbytes == max(sizes), (rep, sizes)  # static pieces may need none
        assert all(m.context is not None for m in backend.engines.values())
    assert serial.backends[0].report()["arena_mb"] == 0.0
    assert rel_err(want, eager(model, kw)) < TOL


def test_a_loaded_set_runs_its_contexts_on_one_arena(model, shared, tmp_path):
    kw = inputs(model, seed=12)
    want = shared(**kw, return_dict=False)[0].clone()
    save_compiled(shared, tmp_path / "art")
    loaded = load_compiled(tmp_path / "art")
    assert torch.equal(loaded(**kw, return_dict=False)[0], want)
    rep = loaded.backends[0].report()
    assert 0 < rep["arena_mb"] < rep["context_mb"], rep
