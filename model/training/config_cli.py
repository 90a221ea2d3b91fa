"""A training config dataclass as a command line: every field a flag, and back again.

    parser = parser_for(TrainConfig, "attnserve train", description)   # --n-layer 4, --bf16 / --no-bf16
    command_line(cfg, "attnserve train")                                 # the shortest line that gives cfg
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from attnserve.arguments import HintingParser


def parser_for(cls, prog: str, description: str) -> argparse.ArgumentParser:
    """One flag per field of the dataclass `cls`: booleans as --x / --no-x, the rest typed by their default."""
    p = HintingParser(prog=prog, description=description)
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool" or isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            p.add_argument(flag, type=type(f.default), default=f.default)
    return p


def command_line(cfg, prog: str) -> str:
    """The shortest `prog` line that reproduces cfg: --out, then every field that differs from its default."""
    defaults = type(cfg)()
    args = [prog, f"--out {cfg.out}"]
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "out" or value == getattr(defaults, f.name):
            continue
        flag = f.name.replace("_", "-")
        args.append(f"--{flag}" if value is True else f"--no-{flag}" if value is False else f"--{flag} {value}")
    return " ".join(args)
