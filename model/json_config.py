"""What the two configs share: written next to the weights as `config.json` and read back, refusing
fields the config does not have."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Self


class JsonConfig:
    """A dataclass config (`GPTConfig`, `Seq2SeqConfig`) as a dict and as a JSON file."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Self:
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields: {unknown}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Self:
        return cls.from_dict(json.loads(Path(path).read_text()))
