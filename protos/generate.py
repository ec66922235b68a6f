"""Regenerate the Python code of the `expertmesh.v1` protos (committed beside them; never edit it by hand).

    python -m expertmesh.protos.generate           # write *_pb2.py, *_pb2.pyi, *_pb2_grpc.py into protos/
    python -m expertmesh.protos.generate --check   # exit 1 if the committed code differs from a fresh run

The folder is compiled under protoc's virtual path `expertmesh/protos` (`-Iexpertmesh/protos=<this folder>`), so
the protos import each other as "expertmesh/protos/x.proto" and the generated modules import
`from expertmesh.protos import x_pb2`, which resolves inside the installed package. `*_pb2_grpc.py` is kept only
for protos that declare a service. The output depends on the grpcio-tools version (its header names it).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VIRTUAL = "expertmesh/protos"
GENERATED = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_SERVICE = re.compile(r"^\s*service\s+\w+", re.MULTILINE)


def proto_files(folder: Path = HERE) -> list[Path]:
    return sorted(folder.glob("*.proto"))


def generate(out_dir: Path, folder: Path = HERE) -> dict[str, bytes]:
    """Compile every proto in `folder`; returns {file name: content} of the modules to keep."""
    import grpc_tools
    from grpc_tools import protoc

    protos = proto_files(folder)
    if not protos:
        raise SystemExit(f"{folder}: no .proto files")
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{VIRTUAL}={folder}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(f"{VIRTUAL}/{p.name}" for p in protos),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed (exit {rc}): {' '.join(args)}")
    produced = out_dir / VIRTUAL
    keep: dict[str, bytes] = {}
    for p in protos:
        stem = p.stem
        suffixes = GENERATED if _SERVICE.search(p.read_text()) else GENERATED[:2]
        for suffix in suffixes:
            f = produced / f"{stem}{suffix}"
            if not f.exists():
                raise SystemExit(f"protoc did not produce {f.name} for {p.name}")
            keep[f.name] = f.read_bytes()
    return keep


def committed(folder: Path = HERE) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file() and f.name.endswith(GENERATED)}


def stale(folder: Path = HERE) -> list[str]:
    """What differs between the committed generated code and a fresh run: one line per file."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp), folder)
    have = committed(folder)
    problems = [f"{name}: missing" for name in sorted(fresh.keys() - have.keys())]
    problems += [
        f"{name}: generated file without a .proto (or without a service)" for name in sorted(have.keys() - fresh.keys())
    ]
    problems += [
        f"{name}: differs from a fresh run" for name in sorted(fresh.keys() & have.keys()) if fresh[name] != have[name]
    ]
    return problems


def write(folder: Path = HERE) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp), folder)
    for name in committed(folder).keys() - fresh.keys():  # outputs of a removed proto / service
        (folder / name).unlink()
    for name, data in fresh.items():
        (folder / name).write_bytes(data)
    return sorted(fresh)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m expertmesh.protos.generate", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the committed generated code is stale")
    args = p.parse_args(argv)
    if args.check:
        from grpc_tools import grpc_version

        problems = stale()
        if problems:
            print(
                f"generated code in {HERE} is stale (grpcio-tools {grpc_version.VERSION}); "
                f"run `python -m expertmesh.protos.generate`:",
                file=sys.stderr,
            )
            for line in problems:
                print(f"  {line}", file=sys.stderr)
            return 1
        print(f"generated code in {HERE} is up to date")
        return 0
    for name in write():
        print(f"wrote {HERE / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
