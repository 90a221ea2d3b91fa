"""The command line both conversions share (`attnserve import-hf`, `attnserve export-hf`): a source
directory and `-o` the directory to write; `wrote <dir>` when done, one line saying why when refused."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def conversion_parser(prog: str, description: str, source: str, source_help: str,
                      out_help: str) -> argparse.ArgumentParser:
    """`prog <source> -o <out>`."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument(source, help=source_help)
    p.add_argument("-o", "--out", required=True, help=out_help)
    return p


def run_conversion(convert: Callable[[], Path], errors: tuple[type[Exception], ...],
                   refused: Callable[[Exception], int]) -> int:
    """Run `convert` and print what it wrote (exit code 0); an error of `errors` goes to `refused`, which
    reports it and gives the exit code."""
    try:
        out = convert()
    except errors as e:
        return refused(e)
    print(f"wrote {out}")
    return 0
