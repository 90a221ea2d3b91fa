"""Generate the Python gRPC stubs (with .pyi) from protos/ into the `attnserve` package.

    python protos/build.py            # writes attnserve/v1/*_pb2*.py(i)
    python protos/build.py --out DIR  # writes elsewhere (the staleness test compares the two)

The stubs are committed, so serving needs no grpcio-tools; a test fails if they are stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def build(out: Path) -> list[Path]:
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    files = [str(p.relative_to(PROTO_DIR)) for p in proto_files()]
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", *files]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {files}")
    stems = [out / Path(f).with_suffix("") for f in files]
    return [Path(f"{stem}{suffix}") for stem in stems for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT)
    for path in build(p.parse_args(argv).out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
