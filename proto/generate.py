"""Regenerates the Python stubs of the .proto files in this folder.

    python proto/generate.py          # write the stubs next to the .proto files
    python proto/generate.py --check  # exit 1 when the committed stubs have drifted

The stubs are committed so that machines without grpcio-tools can import them.
The .proto files are compiled as ``twinplane/proto/*.proto`` so that the
generated imports read ``from twinplane.proto import ...``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTOS = ("generation.proto", "dataplane.proto")
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Compiles every .proto into out_dir; returns the generated files."""
    from importlib import resources

    from grpc_tools import protoc  # only needed here, not at run time

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        pkg = src / "twinplane" / "proto"
        pkg.mkdir(parents=True)
        for name in PROTOS:
            shutil.copy(PROTO_DIR / name, pkg / name)
        gen = Path(tmp) / "gen"
        gen.mkdir()
        args = [
            "protoc",
            f"-I{src}",
            f"-I{resources.files('grpc_tools') / '_proto'}",  # google/protobuf/*.proto
            f"--python_out={gen}",
            f"--pyi_out={gen}",
            f"--grpc_python_out={gen}",
            *(f"twinplane/proto/{name}" for name in PROTOS),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        out = []
        for name in PROTOS:
            for suffix in SUFFIXES:
                file = name.removesuffix(".proto") + suffix
                shutil.copy(gen / "twinplane" / "proto" / file, out_dir / file)
                out.append(out_dir / file)
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args()
    if not args.check:
        for path in generate(PROTO_DIR):
            print("wrote", path.relative_to(PROTO_DIR.parent))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = [p.name for p in generate(Path(tmp)) if p.read_bytes() != (PROTO_DIR / p.name).read_bytes()]
    if stale:
        print("stubs out of date, run python proto/generate.py:", *stale)
        return 1
    print("stubs up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
