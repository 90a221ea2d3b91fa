"""The command line both conversions share (`attnserve import-hf`, `attnserve export-hf`): a source
directory and `-o` the directory to write; `wrote <dir>` when done, one line on stderr (exit code 2)
saying why when refused."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from attnserve.arguments import HintingParser


def conversion_main(argv: list[str] | None, prog: str, description: str, source_help: str, out_help: str,
                    convert: Callable[[str, str], Path], errors: tuple[type[Exception], ...]) -> int:
    """`prog <source> -o <out>`: run `convert(source, out)` and print what it wrote; an error of `errors`
    is reported as `prog: <source>: <why>`."""
    p = HintingParser(prog=prog, description=description)
    p.add_argument("source", help=source_help)
    p.add_argument("-o", "--out", required=True, help=out_help)
    args = p.parse_args(argv)
    try:
        out = convert(args.source, args.out)
    except errors as e:
        why = f"missing config key {e}" if isinstance(e, KeyError) else str(e)
        print(f"{prog}: {args.source}: {why}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
