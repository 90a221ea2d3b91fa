"""Fixtures of the export tests that build on the shipped model."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_MODEL = ROOT / "models" / "shakespeare"


@pytest.fixture(scope="session")
def shipped_int4_bundle(tmp_path_factory) -> Path:
    """The shipped model exported with its 4-bit serving graph beside the fp32 one (the shipped bundle
    does not carry it: docs/onnx.md says why)."""
    from export.bundle_writer import export_bundle
    from export.variants import INT4

    path = tmp_path_factory.mktemp("shipped_int4")
    export_bundle(SHIPPED_MODEL, path, name="shakespeare", int4=INT4)
    return path
