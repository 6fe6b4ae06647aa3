"""Regenerate the committed stubs from ``protos/specserve/v1/specserve.proto``.

Usage (from a source checkout, with the dev extra installed)::

    python -m specserve.v1.regenerate            # rewrites specserve/v1/specserve_pb2*.py{,i}
    python -m specserve.v1.regenerate --out DIR  # writes DIR/specserve/v1/... instead

grpcio-tools is imported only here, so serving never needs it.
"""

from __future__ import annotations

import argparse
import importlib.resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parents[2] / "protos"
PROTO_FILE = "specserve/v1/specserve.proto"
PACKAGE_DIR = Path(__file__).resolve().parent
GENERATED_FILES = ("specserve_pb2.py", "specserve_pb2.pyi", "specserve_pb2_grpc.py")


def generate(out_root: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc on the contract; return the generated files under ``out_root/specserve/v1``."""
    from grpc_tools import protoc  # dev dependency

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"--proto_path={proto_root}",
        f"--proto_path={well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        PROTO_FILE,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc} on {proto_root / PROTO_FILE}")
    return [out_root / "specserve" / "v1" / name for name in GENERATED_FILES]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PACKAGE_DIR.parents[1], help="output root (default: the checkout)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
