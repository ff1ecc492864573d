"""The one validation mechanism (``prx_compile.schema``) and the readers built on it: every spec
accepts what it describes and refuses the rest with the path, in time bounded by the spec."""

import math
import time

import pytest

from prx_compile import schema as s
from prx_compile.backends.tensorrt import engine
from prx_compile.backends.tensorrt.backend import _check_provenance
from prx_compile.errors import ArtifactError, LoRAError


@pytest.mark.parametrize(
    "spec,good,bad",
    [
        (s.Int(0, 10), [0, 10], [-1, 11, True, 1.0, "1", None, 10**5000]),
        (s.Float(-1, 1), [0, 0.5, -1, 1], [math.nan, math.inf, 2, False, "0"]),
        (s.Bool(), [True, False], [0, 1, None, "true"]),
        (s.Null(), [None], [0, "", []]),
        (s.Str(3), ["", "abc"], ["abcd", 3, None, b"ab"]),
        (s.Str(10, pattern=r"[a-z]+"), ["abc"], ["ab1", "", "A"]),
        (s.Str(10, choices=("id", "t")), ["id", "t"], ["x", "ID"]),
        (s.Str(10, test=lambda v: v.endswith("!")), ["hi!"], ["hi"]),
        (s.List(s.Int(0, 1), max_len=2, min_len=1), [[0], [0, 1]], [[], [0, 1, 1], [2], (0,), "01"]),
        (s.Tuple(s.Str(5), s.Int(0, 9)), [["a", 1]], [["a"], ["a", 1, 2], [1, "a"], ("a", 1)]),
        (s.Dict({"a": s.Int(0, 9), "b": s.Bool()}, optional=("b",)), [{"a": 1}, {"a": 1, "b": True}],
         [{}, {"b": True}, {"a": 1, "c": 0}, {"a": "1"}, [("a", 1)]]),
        (s.Map(s.Str(3), s.Int(0, 9), max_len=2), [{}, {"x": 1, "y": 2}],
         [{"x": 1, "y": 2, "z": 3}, {"long": 1}, {1: 1}, {"x": -1}, []]),
        (s.OneOf(s.Null(), s.Int(0, 9)), [None, 3], ["3", 10]),
        (s.Later("someone"), [object(), None, {"any": "thing"}], []),
    ],
)  # fmt: skip
def test_each_spec_accepts_what_it_describes_and_refuses_the_rest(spec, good, bad):
    for v in good:
        assert s.check(spec, v, "x") is v
    for v in bad:
        with pytest.raises(s.SchemaError, match=r"^x[^:]*(: expected | is missing$| has the key )"):
            s.check(spec, v, "x")


def test_the_error_names_the_path_and_an_excerpt_of_the_value():
    spec = s.Dict({"a": s.List(s.Dict({"b": s.Int(0, 1)}), max_len=5)})
    with pytest.raises(s.SchemaError) as e:
        s.check(spec, {"a": [{"b": 0}, {"b": 0}, {"b": "x" * 10_000}]}, "rec")
    assert e.value.path == "rec.a[2].b" and str(e.value).startswith("rec.a[2].b: expected an integer")
    assert len(str(e.value)) < 200 and isinstance(e.value, ValueError)


def test_sizes_are_refused_before_the_items_are_looked_at():
    cases = [
        (s.List(s.Int(0, 1), max_len=10), [0] * 10**7),
        (s.Map(s.Str(9), s.Int(0, 1), max_len=10), {str(i): 0 for i in range(10**6)}),
    ]
    t0 = time.perf_counter()
    for spec, huge in cases:
        with pytest.raises(s.SchemaError):
            s.check(spec, huge, "x")
    assert time.perf_counter() - t0 < 0.5  # walking the items would take seconds


def test_engine_records_and_provenance_are_read_through_the_schema():
    good = {
        "inputs": ["x", "w.0"],
        "outputs": ["out"],
        "weight_name_map": {"c0": ["blocks.0.w", "torch.bfloat16"]},
        "requires_output_allocator": False,
        "outputs_unowned": True,
    }
    assert engine.check_engine_record(good) is good
    for path, bad in [
        ("engine record.inputs[0]", {**good, "inputs": ["$(rm -rf)"]}),
        (
            "engine record.weight_name_map['c0'][1]",
            {**good, "weight_name_map": {"c0": ["w", "torch.complex64"]}},
        ),
        ("engine record.outputs_unowned", {**good, "outputs_unowned": 1}),
        ("engine record", {**good, "extra": 0}),
    ]:
        with pytest.raises(s.SchemaError) as e:
            engine.check_engine_record(bad)
        assert e.value.path == path
    assert _check_provenance({"c": ["p", "t"]}, {"p": 2}) == {"c": ("p", "t")}
    for bad in ({"c": ["p", "x"]}, {"c": ["q", "id"]}, {"c": "p"}, [["c", "p"]]):
        with pytest.raises(s.SchemaError, match="provenance"):
            _check_provenance(bad, {"p": 2})


def test_a_hostile_lora_record_is_a_lora_error_naming_the_field():
    from prx_compile.lora import restore_state
    from prx_compile.tools.testing import make_prx

    model = make_prx()
    for bad, where in [
        ({"adapters": {}, "active": {}, "x": 1}, "the LoRA record has the key 'x'"),
        ({"adapters": {}}, r"the LoRA record\.active is missing"),
        ({"adapters": {"../a": {"source": "", "layers": {}}}, "active": {}}, "the LoRA record.adapters key"),
        (
            {"adapters": {"a": {"source": "", "layers": {"l": math.inf}}}, "active": {}},
            r"adapters\['a'\].layers",
        ),
        ({"adapters": {"a": {"source": 7, "layers": {}}}, "active": {}}, r"adapters\['a'\].source"),
        ({"adapters": {}, "active": {"a": 1e300}}, r"active\['a'\]"),
    ]:
        with pytest.raises(LoRAError, match=where):
            restore_state(model, bad, {})


def test_a_model_config_value_in_a_manifest_is_checked_by_its_type():
    from prx_compile.io.saving import _check_value
    from prx_compile.models import SPECS

    prx = SPECS["prx"]
    _check_value("depth", 16, 16, prx)
    _check_value("axes_dim", [32, 32], None, prx)
    bad = [("depth", 257, 16), ("depth", True, 16), ("theta", math.nan, 1.0)]
    bad += [("axes_dim", [0], None), ("axes_dim", "32", None), ("flag", 1, False)]
    for key, v, default in bad:
        with pytest.raises(ArtifactError, match=f"manifest.model.config.{key}=.* is not an allowed value"):
            _check_value(key, v, default, prx)


def test_a_string_spec_that_cannot_hold_its_own_choices_is_refused_when_made():
    with pytest.raises(ValueError, match=r"Str\(1\) cannot hold"):
        s.Str(1, choices=("id", "t"))  # the provenance spec of 0.7 refused every "id"


def test_a_mapping_names_the_key_that_is_missing_or_not_allowed():
    spec = s.Dict({"a": s.Int(0, 9), "b": s.Int(0, 9)}, optional=("b",))
    with pytest.raises(s.SchemaError, match=r"^manifest\.a is missing$"):
        s.check(spec, {"b": 1}, "manifest")
    with pytest.raises(s.SchemaError, match=r"^manifest has the key 'zz', not one of \['a', 'b'\]$"):
        s.check(spec, {"a": 1, "zz": 2}, "manifest")
    with pytest.raises(s.SchemaError, match=r"^manifest has the key 7, not one of"):
        s.check(spec, {"a": 1, 7: 2}, "manifest")
