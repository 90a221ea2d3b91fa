"""What start-up measured about a bundle on this kind of machine, kept so that a restart need not measure it again.

    cache = ChoiceCache.of(bundle, cache_dir, settings)   # settings: what the choice was made under
    cached = cache.load(recheck)                         # a CachedChoice, or None (the log says why)
    cache.store(CachedChoice(served="static-int8", checked={...}, refused={...}, step_ms={...}))

The self-check and the graph choice (`graph_choice.py`) give the same answer for the same graphs on the same
kind of CPU, so their outcome is kept in one JSON file per bundle, CPU and settings, under `cache_dir`
(`attnserve serve`: `$XDG_CACHE_HOME/attnserve`, else `~/.cache/attnserve`; `--cache-dir` or
`ATTNSERVE_CACHE_DIR`). An entry serves a start only if all of these match what it was measured under:
- the bundle: its manifest's sha256 and every serving graph file's (encoders and the weights kept beside a
  graph included), so an entry never outlives a re-export. Rereading gigabytes of graphs at every start
  would cost seconds, so a file whose size, inode and modification and change times are those its digest
  was taken at keeps that digest (a write changes its ctime, which no one can set back); and a start that
  finds no entry takes the digests on a thread of its own while the graphs load and are checked;
- the CPU: its model name, the instruction-set flags onnxruntime picks its kernels by, its cores; the machine
  type and onnxruntime's version;
- the settings the outcome depends on (the graph asked for, provider, threads, the timing batch, ...), and the
  self-check's own code (a hash of the modules that measure and decide), so that a changed check is never
  skipped.
Only a start that served a graph is kept; a failed check is measured again next time. A file that cannot be
read, does not parse or holds another key is ignored (and replaced by the next store); a cache directory that
cannot be written is a warning, never a failed start.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import platform
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnxruntime as ort

from service.runtime.bundle import MANIFEST_FILE, Manifest, read_manifest, sha256_file
from service.runtime.cpu import cpu_info
from service.runtime.probes import Agreement, Invariance
from service.runtime.self_check import SelfCheck

log = logging.getLogger(__name__)

FORMAT = 1  # of the entry files; another format is ignored
CHOICE_DIR = "graph-choice"  # the entries' folder inside the cache directory
# the modules whose code decides a verdict: a change to any of them makes every entry stale
CHECK_MODULES = ("graph_choice.py", "self_check.py", "probes.py", "seq2seq_check.py")


@dataclass
class CachedChoice:
    """The outcome of a start: the graph served and what was measured to choose it."""

    served: str  # the graph served
    checked: dict[str, SelfCheck]  # what the self-check measured on each graph it passed (the one served among them)
    refused: dict[str, str] = field(default_factory=dict)  # graph -> why it is not served
    step_ms: dict[str, dict[int, float]] = field(default_factory=dict)  # graph -> batch size -> decode step (ms)
    checked_at: str = ""  # when it was measured, UTC

    def to_json(self) -> dict:
        return {"served": self.served, "checked": {name: asdict(v) for name, v in self.checked.items()},
                "refused": self.refused, "step_ms": {g: {str(b): ms for b, ms in t.items()} for g, t in
                                                     self.step_ms.items()},
                "checked_at": self.checked_at or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    @classmethod
    def from_json(cls, data: dict) -> CachedChoice:
        """The choice `to_json` wrote; ValueError, KeyError or TypeError for anything else."""
        checked = {str(name): SelfCheck(_agreement(v["agreement"]) if v["agreement"] is not None else None,
                                        _invariance(v["invariance"])) for name, v in data["checked"].items()}
        if data["served"] not in checked:
            raise ValueError(f"the graph served, {data['served']!r}, has no verdict")
        step_ms = {g: {int(b): float(ms) for b, ms in t.items()} for g, t in data["step_ms"].items()}
        return cls(str(data["served"]), checked, {str(g): str(why) for g, why in data["refused"].items()}, step_ms,
                   str(data["checked_at"]))


def _agreement(data: dict) -> Agreement:
    return Agreement(float(data["top1"]), int(data["positions"]), float(data["max_abs_diff"]), float(data["scale"]))


def _invariance(data: dict) -> Invariance:
    if not isinstance(data["identical"], bool):
        raise ValueError("a batch invariance verdict that is neither true nor false")
    return Invariance(data["identical"], int(data["rows"]), int(data["batch"]), float(data["max_abs_diff"]))


class ChoiceCache:
    """The cache entry of one bundle under one CPU and one set of settings (see the module docstring)."""

    def __init__(self, bundle: Path, path: Path, key: dict):
        self.bundle = bundle
        self.path = path  # the entry's file
        self.key = key  # everything but the bundle's contents that the outcome depends on
        self._files: dict = {}  # the bundle's identity as `load` found it, whose digests `store` reuses
        self._digests: Future | None = None  # the bundle's identity, taken on a thread of its own after a miss

    @classmethod
    def of(cls, bundle: Path, cache_dir: Path, settings: dict) -> ChoiceCache:
        """The entry for `bundle` served with `settings` (JSON values) on this machine."""
        bundle = Path(bundle).resolve()
        key = {"bundle": str(bundle), "settings": settings, "cpu": cpu_fingerprint(),
               "check_code": check_code_sha256()}
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return cls(bundle, Path(cache_dir) / CHOICE_DIR / f"{name}.json", key)

    def load(self, recheck: bool = False) -> CachedChoice | None:
        """The cached outcome, if the entry exists, is readable and was measured on this very bundle (and
        `recheck` does not ask to measure again); otherwise None, with a log line saying why."""
        choice = self._read(recheck)
        if choice is None and not self._files:
            self._digest_in_background()
        return choice

    def _read(self, recheck: bool) -> CachedChoice | None:
        if recheck:
            log.info("graph choice: checking again, as asked (recheck), and replacing %s", self.path)
            return None
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            log.info("graph choice: nothing cached for this bundle, CPU and settings in %s yet", self.path.parent)
            return None
        except OSError as e:
            log.warning("graph choice: cannot read the cache file %s (%s); checking again", self.path, e)
            return None
        try:
            data = json.loads(raw)
            if data.get("format") != FORMAT or data.get("key") != self.key:
                raise ValueError("it was written for another key or format")
            choice = CachedChoice.from_json(data["choice"])
            spec = read_manifest(self.bundle).graphs.get(choice.served)
            if spec is None or spec.cache != "static":
                raise ValueError(f"it names {choice.served!r}, which is not a serving graph of the bundle")
            stale = self._changed_files(data["bundle"])
        except OSError as e:  # a graph file gone or unreadable: opening the bundle reports it
            log.info("graph choice: the bundle's files cannot be compared with the cached ones (%s)", e)
            return None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("graph choice: ignoring the cache file %s, which cannot be used (%s: %s); checking again",
                        self.path, type(e).__name__, e)
            return None
        if stale:
            log.info("graph choice: the bundle changed since it was checked (%s); checking again", stale)
            return None
        return choice

    def store(self, choice: CachedChoice) -> None:
        """Write the entry (atomically: a reader sees the old file or the new one), or warn that it cannot."""
        try:
            files = self._digests.result() if self._digests is not None else self._identity(self._files)
            data = {"format": FORMAT, "key": self.key, "bundle": files, "choice": choice.to_json()}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as f:
                json.dump(data, f, indent=1)
            os.replace(f.name, self.path)
        except OSError as e:
            log.warning("graph choice: cannot write the cache file %s (%s): the next start checks again; set "
                        "--cache-dir or ATTNSERVE_CACHE_DIR to a writable folder to keep it", self.path, e)
            return
        log.info("graph choice: cached in %s; a restart on this CPU serves it without checking (--recheck "
                 "checks again)", self.path)

    def _digest_in_background(self) -> None:
        """Take the bundle's digests on a daemon thread while its graphs load and are checked, which leave a
        core idle for much of the time: reading gigabytes would otherwise hold up the first start by seconds.
        `store` waits for them."""
        digests = self._digests = Future()

        def run() -> None:
            try:
                digests.set_result(self._identity({}))
            except BaseException as e:
                digests.set_exception(e)

        threading.Thread(target=run, name="attnserve-bundle-digests", daemon=True).start()

    def _changed_files(self, stored: dict) -> str | None:
        """Which of the bundle's files differ from those the entry was measured on, or None."""
        current = self._files = self._identity(stored)
        if current["manifest_sha256"] != stored["manifest_sha256"]:
            return MANIFEST_FILE
        changed = sorted(set(current["files"]) ^ set(stored["files"]) | {
            name for name, f in current["files"].items()
            if name in stored["files"] and f["sha256"] != stored["files"][name]["sha256"]})
        return ", ".join(changed) or None

    def _identity(self, stored: dict) -> dict:
        """The manifest's sha256 and each serving graph file's, reusing a digest of `stored` whose file is
        unchanged on disk (the module docstring says why)."""
        manifest_path = self.bundle / MANIFEST_FILE
        files = {}
        for name in graph_files(self.bundle, read_manifest(self.bundle)):
            path = self.bundle / name
            st = path.stat()
            stat = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}
            known = stored.get("files", {}).get(name)
            same = known is not None and all(known.get(k) == v for k, v in stat.items())
            files[name] = {**stat, "sha256": known["sha256"] if same else sha256_file(path)}
        return {"manifest_sha256": sha256_file(manifest_path), "files": files}


def graph_files(bundle: Path, manifest: Manifest) -> list[str]:
    """The files of every graph `--graph auto` could serve or check against: the static-cache graphs, their
    encoders, and the weights a graph keeps beside it (ONNX external data, `<file>.data`)."""
    names = set()
    for graph, spec in manifest.graphs.items():
        if spec.cache == "static":
            encoder = manifest.encoder_for(graph)
            for file in [spec.file] + ([encoder.file] if encoder is not None else []):
                names |= {file} | {beside.name for beside in bundle.glob(glob.escape(file) + ".*")}
    return sorted(names)


def cpu_fingerprint() -> dict:
    """What decides how onnxruntime computes here: the CPU's model, kernel flags and cores, the machine type,
    onnxruntime's version."""
    return {**cpu_info().as_dict(), "machine": platform.machine(), "onnxruntime": ort.__version__}


def check_code_sha256() -> str:
    """One digest of the modules whose code measures a graph and decides its verdict (`CHECK_MODULES`)."""
    h = hashlib.sha256()
    for name in CHECK_MODULES:
        h.update((Path(__file__).parent / name).read_bytes())
    return h.hexdigest()
