"""Every system `attnserve bench compare` measures, and how to convert for it and run it by the peer protocol.

A `System` is one engine at one precision: `key` is how --systems/--skip name it (the family alone
names every precision of it). Each runs in a process of its own, in the interpreter its users would
have: the peers in their own virtualenvs (`make bench-peers`), never in attnserve's dependencies;
attnserve in-process and over gRPC in children of this project's interpreter
(`bench.peers.attnserve_peer`); llama.cpp through `bench.peers.llama_cpp`, whose programs run as
children. `unavailable()` gives the one-line reason a system is skipped; `convert()` makes its model
once per size (outside the timed rounds); `measure()` runs one round and returns the protocol's result.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "bench" / "peers"
VENVS = {"optimum": ROOT / ".venv-peers", "openvino": ROOT / ".venv-openvino", "ctranslate2": ROOT / ".venv-ct2"}
REFERENCE = "transformers:fp32"  # greedy agreement is counted against this system's tokens
# attnserve's precisions -> the bundle's graph; int8-per-tensor is the former INT8 graph (onnxruntime's dynamic
# quantization, one activation scale per batch: not batch-invariant), measured beside int8 (per row)
GRAPHS = {"fp32": "static", "int8": "static-int8", "int8-per-tensor": "static-int8-per-tensor",
          "int4": "static-int4"}


@dataclass(frozen=True)
class System:
    family: str  # transformers, optimum, ctranslate2, openvino, llama.cpp, llama.cpp-batched, attnserve, attnserve-grpc
    precision: str  # the protocol's precision (fp32, f16, int8, int8-per-tensor, q8_0, q4_0, int4)
    label: str  # the table's name

    @property
    def key(self) -> str:
        return f"{self.family}:{self.precision}"

    @property
    def ours(self) -> bool:
        return self.family.startswith("attnserve")

    @property
    def graph(self) -> str:  # attnserve only
        return GRAPHS[self.precision]


SYSTEMS = (
    System("transformers", "fp32", "transformers"),
    System("optimum", "fp32", "optimum (onnxruntime)"),
    System("ctranslate2", "fp32", "CTranslate2"),
    System("ctranslate2", "int8", "CTranslate2"),
    System("openvino", "fp32", "OpenVINO"),
    System("openvino", "int8", "OpenVINO"),
    *(System("llama.cpp", p, "llama.cpp server") for p in ("fp32", "f16", "q8_0", "q4_0")),
    *(System("llama.cpp-batched", p, "llama.cpp batched-bench") for p in ("fp32", "f16", "q8_0", "q4_0")),
    *(System("attnserve", p, "attnserve in-process") for p in GRAPHS),
    *(System("attnserve-grpc", p, "attnserve gRPC") for p in GRAPHS),
)
LLAMA_TYPES = {"fp32": "f32", "f16": "f16", "q8_0": "q8_0", "q4_0": "q4_0"}


def select(systems: str, skip: str) -> list[System]:
    """The systems named by --systems (all when empty) less those named by --skip; a name is a key or a family."""
    def named(s: System, names: set[str]) -> bool:
        return s.key in names or s.family in names

    want = {n for n in systems.split(",") if n}
    drop = {n for n in skip.split(",") if n}
    unknown = (want | drop) - {s.key for s in SYSTEMS} - {s.family for s in SYSTEMS}
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; known: {[s.key for s in SYSTEMS]}")
    return [s for s in SYSTEMS if (not want or named(s, want)) and not named(s, drop)]


@dataclass(frozen=True)
class Model:
    """One size as every system takes it."""

    hf_dir: Path  # the Hugging Face directory (attnserve export-hf)
    bundle: Path  # the attnserve bundle
    graphs: tuple[str, ...]  # the bundle's graphs
    work: Path  # converted models are kept here, one folder per system


def python_of(system: System) -> Path:
    if system.family == "transformers":
        return Path(sys.executable)
    return VENVS[system.family] / "bin" / "python"


def unavailable(system: System, model: Model) -> str | None:
    """None when the system can run here; else why not, in one line."""
    if system.family in VENVS and not python_of(system).is_file():
        return f"{python_of(system).parent.parent.name} is missing (make bench-peers)"
    if system.family == "transformers" and importlib.util.find_spec("transformers") is None:
        return "transformers is not installed here (make install)"
    if system.family.startswith("llama.cpp"):
        from bench.peers import llama_cpp

        return llama_cpp.available()
    if system.ours and system.graph not in model.graphs:
        return f"the bundle has no {system.graph} graph"
    return None


def converted(system: System, model: Model) -> Path:
    return model.work / f"{system.family}-{system.precision}"


def convert(system: System, model: Model) -> None:
    """Make the system's model from the HF directory, once (kept in model.work)."""
    if system.family in ("optimum", "openvino", "ctranslate2"):
        out = converted(system, model)
        if (out / "done").is_file():
            return
        script = "ctranslate2_peer.py" if system.family == "ctranslate2" else "generate.py"
        backend = [] if system.family == "ctranslate2" else ["--backend", system.family]
        run([str(python_of(system)), str(PEERS / script), *backend, "--precision", system.precision,
             "--hf-dir", str(model.hf_dir), "--model-dir", str(out), "--convert"], system, expect_result=False)
        (out / "done").write_text("")
    elif system.family.startswith("llama.cpp"):
        from bench.peers import llama_cpp

        llama_cpp.convert(model.hf_dir, model.work / "llama.cpp", LLAMA_TYPES[system.precision])


def measure(system: System, model: Model, spec: dict, spec_path: Path) -> dict:
    """One round of the system on the spec: the peer protocol's result."""
    if system.family.startswith("llama.cpp"):
        from bench.peers import llama_cpp

        mode = "server" if system.family == "llama.cpp" else "batched-bench"
        result = llama_cpp.measure(model.hf_dir, model.work / "llama.cpp", LLAMA_TYPES[system.precision], spec, mode)
    elif system.ours:
        mode = "in-process" if system.family == "attnserve" else "grpc"
        result = run([sys.executable, "-m", "bench.peers.attnserve_peer", "--bundle", str(model.bundle),
                      "--graph", system.graph, "--mode", mode, "--spec", str(spec_path)], system)
    elif system.family == "ctranslate2":
        result = run([str(python_of(system)), str(PEERS / "ctranslate2_peer.py"), "--precision", system.precision,
                      "--hf-dir", str(model.hf_dir), "--model-dir", str(converted(system, model)),
                      "--spec", str(spec_path)], system)
    else:
        result = run([str(python_of(system)), str(PEERS / "generate.py"), "--backend", system.family,
                      "--precision", system.precision, "--hf-dir", str(model.hf_dir),
                      "--model-dir", str(converted(system, model)), "--spec", str(spec_path)], system)
    if result["precision"] != system.precision:
        raise RuntimeError(f"{system.key} reported precision {result['precision']}")
    return result


def run(cmd: list[str], system: System, expect_result: bool = True) -> dict | None:
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:  # the first line says why (the last of its error output), then the details
        why = next((line.strip() for line in reversed(done.stderr.splitlines()) if line.strip()), "no error output")
        raise RuntimeError(f"exit status {done.returncode}: {why}\n{' '.join(cmd)}\n{done.stderr[-3000:]}")
    if not expect_result:
        return None
    lines = done.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"{system.key} printed no result; stderr:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])
