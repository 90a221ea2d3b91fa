"""Every `attnserve bench <what>` runs end to end on a tiny bundle, in seconds, and names the machine.

A benchmark registered in `bench.cli.BENCHES` without quick arguments in `QUICK` fails here: each
one must have a form that runs on any bundle, not only on the shipped one.
"""

from __future__ import annotations

import json

import pytest

from bench.cli import BENCHES, main
from bench.machine import describe, machine_line

# placeholders: {bundle} the tiny bundle (every graph variant), {model} its model directory, {out} a temp folder,
# {s2s_model} and {s2s_bundle} a tiny encoder-decoder and its bundle
QUICK = {
    "speculative": ["--bundle", "{bundle}", "--no-gpt2", "--random-prompts", "--rounds", "1", "--prompts", "2",
                    "--new-tokens", "8", "--out", "{out}"],
    "hostile": ["--bundle", "{bundle}", "--connections", "40", "--hold-s", "0.5", "--out", "{out}"],
    "engine": ["--bundle", "{bundle}", "--concurrency", "1,2", "--new-tokens", "4", "--repeats", "1",
               "--contexts", "16,32", "--sampler-vocab", "1000", "--sampler-steps", "4", "--out", "{out}"],
    "serve": ["--bundle", "{bundle}", "--concurrency", "1,2", "--new-tokens", "4", "--requests-per-client", "1",
              "--out", "{out}"],
    "compare": ["--quick", "--sizes", "gpt2-124m", "--systems", "attnserve:fp32", "--work", "{out}/work",
                "--bandwidth-gbps", "20", "--out", "{out}"],
    "soak": ["--bundle", "{bundle}", "--minutes", "0.05", "--interval", "1", "--concurrency", "2", "--out", "{out}"],
    "onnx-variants": ["--bundle", "{bundle}", "--repeats", "1", "--out", "{out}"],  # no --quality: needs the corpus
    "quantization": ["--bundle", "{bundle}", "--quick", "--out", "{out}"],
    "llama-shape": ["--layers", "2", "--hidden", "64", "--intermediate", "96", "--heads", "4", "--kv-heads", "2",
                    "--vocab", "4096", "--context", "64", "--concurrency", "1,2", "--new-tokens", "4", "--repeats", "1",
                    "--out", "{out}"],
    "rotary-placement": ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "96",
                         "--vocab", "4096", "--context", "128", "--steps", "2", "--rounds", "1", "--out", "{out}"],
    "bandwidth": ["--mb", "8", "--rounds", "1", "--out", "{out}"],
    "kv-precision": ["--heads", "4", "--kv-heads", "2", "--d-head", "16", "--batches", "1,2", "--contexts", "32",
                     "--prefill", "16", "--rounds", "1", "--steps", "2", "--bundle", "{bundle}", "--quick",
                     "--windows", "1", "--out", "{out}"],
    "prefix-cache": ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "4096", "--context", "256",
                     "--prefix-tokens", "100", "--rounds", "1", "--out", "{out}"],
    "priority": ["--quick", "--bundle", "{bundle}", "--out", "{out}"],
    "models": ["--quick", "--bundle", "{bundle}", "--bundle", "{s2s_bundle}", "--cores", "--out", "{out}"],
    "structured": ["--vocabs", "300", "--sp-vocab", "400", "--code-chars", "0", "--rounds", "1", "--walks", "2",
                   "--server-rounds", "1", "--streams", "2", "--singles", "1", "--max-tokens", "16", "--no-llama-cpp",
                   "--out", "{out}"],
    "replicas": ["--bundle", "{bundle}", "--replicas", "1,2", "--rounds", "1", "--clients", "2", "--new-tokens", "4",
                 "--measured", "2", "--skip-roll", "--out", "{out}"],  # the roll and the kill: test_replicas.py
    "startup": ["--bundle", "{bundle}", "--rounds", "1", "--max-running", "4", "--warm-up", "--out", "{out}"],
    "memory": ["--quick", "--bundle", "{bundle}", "--out", "{out}"],  # llama.cpp and the 131k model skipped
    "g2p": ["--model", "{s2s_model}", "--bundle", "{s2s_bundle}", "--words", "6", "--rounds", "1", "--beam", "2",
            "--work", "{out}/work", "--out", "{out}"],
}
SLOW = {"engine", "serve", "compare", "soak", "llama-shape", "rotary-placement", "prefix-cache", "g2p", "replicas",
        "startup", "memory", "priority", "models"}  # start a server, or export a graph with torch


@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else [])
                                  for name in BENCHES])
def test_every_bench_runs_quickly_on_a_tiny_bundle(name, tiny_bundle, tiny_model_dir, seq2seq_model_dir,
                                                   lively_seq2seq_bundle, tmp_path, capsys):
    assert name in QUICK, f"bench {name!r} has no quick arguments: add them to QUICK"
    out = tmp_path / "results"
    args = [a.format(bundle=tiny_bundle, model=tiny_model_dir, out=out, s2s_model=seq2seq_model_dir,
                     s2s_bundle=lively_seq2seq_bundle) for a in QUICK[name]]

    assert main([name, *args]) == 0

    assert machine_line(describe()) in capsys.readouterr().out  # the markdown names the CPU and its flags
    results = list(out.glob("*.json"))
    assert results, f"{name} wrote no JSON into {out}"
    assert all(names_machine(json.loads(path.read_text()), describe()) for path in results)


def names_machine(result, machine: dict) -> bool:
    """Whether `machine` is somewhere in the JSON (top level, or per run for results that keep several)."""
    if result == machine:
        return True
    children = result.values() if isinstance(result, dict) else result if isinstance(result, list) else ()
    return any(names_machine(child, machine) for child in children)
