"""Our schema module against pydantic (strict) and msgspec on what prx_compile reads from disk.

    pip install --target /tmp/schema_libs pydantic msgspec   # not dependencies: for this probe only
    PYTHONPATH=/tmp/schema_libs python benchmarks/probes/schema_libraries.py OUT.json

Three inputs, each timed from the JSON bytes to a checked value (best of 5 runs, CPU):
  program   a Program's JSON of 5000 steps (the shape ``Program.from_json`` checks first: op, engine,
            args, kwargs, out per step), valid;
  files     an artifact manifest's files table of 2000 entries ({bytes, sha256 list}), valid;
  hostile   the same program with ``steps`` a list of 10**7 zeros (20 MB): it must be refused;
  too_long  a program of 100 001 well-formed steps, one over the bound: it must be refused.
Also each library's installed size. A library missing here is reported as such.
"""

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

from prx_compile import schema
from prx_compile.backends.tensorrt.program import _PROGRAM
from prx_compile.io.artifact import _FILES

MAX_STEPS = 100_000


def program_bytes(n: int) -> bytes:
    steps = [
        {
            "op": "aten.add.Tensor" if i % 2 else "engine",
            "engine": None if i % 2 else "_run_on_acc_0",
            "args": [{"ref": f"v{i - 1}" if i else "in:hidden_states"}, {"ref": "w:blocks.0.weight"}],
            "kwargs": {},
            "out": f"v{i}",
        }
        for i in range(n)
    ]
    return json.dumps(
        {"inputs": ["hidden_states"], "steps": steps, "output": {"ref": f"v{n - 1}"}, "segments": 1}
    ).encode()


def files_bytes(n: int) -> bytes:
    return json.dumps(
        {f"sets/0/e{i}.engine": {"bytes": 1000 + i, "sha256": ["ab" * 32]} for i in range(n)}
    ).encode()


HOSTILE = json.dumps({"inputs": ["hidden_states"], "steps": [0] * 10**7, "output": 0, "segments": 1}).encode()


TOO_LONG = program_bytes(MAX_STEPS + 1)


def ours() -> dict[str, Any]:
    return {
        "program": lambda b: schema.check(_PROGRAM, json.loads(b), "program"),
        "files": lambda b: schema.check(_FILES, json.loads(b), "files"),
        "error": schema.SchemaError,
        "size_mb": 0.0,
    }


def pydantic_checks() -> dict[str, Any]:
    import pydantic
    from pydantic import BaseModel, ConfigDict, Field, StringConstraints

    strict = ConfigDict(strict=True, extra="forbid")
    Name = Annotated[str, StringConstraints(max_length=100, pattern=r"^[A-Za-z0-9_]{1,100}$")]

    class Step(BaseModel):
        model_config = strict
        op: Annotated[str, StringConstraints(max_length=80)]
        engine: Name | None
        args: Annotated[list[Any], Field(max_length=10_000)]
        kwargs: Annotated[
            dict[Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,40}$")], Any],
            Field(max_length=64),
        ]
        out: Annotated[str, StringConstraints(pattern=r"^v[0-9]{1,7}$")]

    class Program(BaseModel):
        model_config = strict
        inputs: Annotated[list[Annotated[str, StringConstraints(max_length=40)]], Field(max_length=8)]
        steps: Annotated[list[Step], Field(max_length=MAX_STEPS)]
        output: Any
        segments: Annotated[int, Field(ge=0, le=MAX_STEPS)]

    class Entry(BaseModel):
        model_config = strict
        bytes: Annotated[int, Field(ge=0, le=2**37)]
        sha256: Annotated[
            list[Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]], Field(max_length=2**11)
        ]

    files = pydantic.TypeAdapter(
        Annotated[dict[Annotated[str, StringConstraints(max_length=300)], Entry], Field(max_length=100_000)]
    )
    return {
        "program": lambda b: Program.model_validate_json(b),
        "files": lambda b: files.validate_json(b),
        "error": pydantic.ValidationError,
        "size_mb": installed_mb("pydantic") + installed_mb("pydantic_core"),
        "version": pydantic.VERSION,
    }


def msgspec_checks() -> dict[str, Any]:
    import msgspec
    from msgspec import Meta, Struct

    Name = Annotated[str, Meta(max_length=100, pattern=r"^[A-Za-z0-9_]{1,100}$")]

    class Step(Struct, forbid_unknown_fields=True):
        op: Annotated[str, Meta(max_length=80)]
        engine: Name | None
        args: Annotated[list[Any], Meta(max_length=10_000)]
        kwargs: Annotated[
            dict[Annotated[str, Meta(pattern=r"^[a-z][a-z0-9_]{0,40}$")], Any], Meta(max_length=64)
        ]
        out: Annotated[str, Meta(pattern=r"^v[0-9]{1,7}$")]

    class Program(Struct, forbid_unknown_fields=True):
        inputs: Annotated[list[Annotated[str, Meta(max_length=40)]], Meta(max_length=8)]
        steps: Annotated[list[Step], Meta(max_length=MAX_STEPS)]
        output: Any
        segments: Annotated[int, Meta(ge=0, le=MAX_STEPS)]

    class Entry(Struct, forbid_unknown_fields=True):
        bytes: Annotated[int, Meta(ge=0, le=2**37)]
        sha256: Annotated[list[Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]], Meta(max_length=2**11)]

    files_type = Annotated[dict[Annotated[str, Meta(max_length=300)], Entry], Meta(max_length=100_000)]
    return {
        "program": lambda b: msgspec.json.decode(b, type=Program, strict=True),
        "files": lambda b: msgspec.json.decode(b, type=files_type, strict=True),
        "error": msgspec.ValidationError,
        "size_mb": installed_mb("msgspec"),
        "version": msgspec.__version__,
    }


def installed_mb(package: str) -> float:
    mod = __import__(package)
    root = Path(mod.__file__).parent
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 2**20


def best(fn, data: bytes, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(data)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    out = Path(sys.argv[1])
    inputs = {"program": program_bytes(5000), "files": files_bytes(2000)}
    res: dict[str, Any] = {"python": sys.version.split()[0], "bytes": {k: len(v) for k, v in inputs.items()}}
    res["bytes"]["hostile"], res["bytes"]["too_long"] = len(HOSTILE), len(TOO_LONG)
    for name, make in (
        ("prx_compile.schema", ours),
        ("pydantic", pydantic_checks),
        ("msgspec", msgspec_checks),
    ):
        try:
            lib = make()
        except ImportError as e:
            res[name] = {"missing": str(e)}
            continue
        row: dict[str, Any] = {k: lib[k] for k in ("size_mb", "version") if k in lib}
        for kind, data in inputs.items():
            row[f"{kind}_ms"] = 1e3 * best(lib[kind], data)
        for kind, data in (("hostile", HOSTILE), ("too_long", TOO_LONG)):
            t0 = time.perf_counter()
            try:
                lib["program"](data)
                row[kind] = "accepted"
            except lib["error"] as e:
                row[kind] = f"refused: {str(e).splitlines()[0][:120]}"
            row[f"{kind}_ms"] = 1e3 * (time.perf_counter() - t0)
        res[name] = row
        print(name, row, flush=True)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
