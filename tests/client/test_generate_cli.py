"""`attnserve generate`: the engine from the command line, without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from attnserve.cli import main; rc = main(sys.argv[1:]); "
                           "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_generate_streams_text_without_torch(engine_bundle):
    out = run("generate", "Juliet is", "--bundle", str(engine_bundle), "--max-new-tokens", "12", "--temperature", "0",
              "--ignore-eos")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Juliet is") and len(out.stdout) > len("Juliet is")
    assert "[length]" in out.stderr


def test_generate_n_completions_reproducible_with_a_seed(engine_bundle):
    args = ("generate", "To be", "--bundle", str(engine_bundle), "--graph", "static", "-n", "3", "--max-new-tokens", "10",
            "--temperature", "1.0", "--seed", "5", "--ignore-eos")
    first, second = run(*args), run(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout and first.stdout.count("--- ") == 3


def test_generate_reports_a_bad_parameter(engine_bundle):
    out = run("generate", "x", "--bundle", str(engine_bundle), "--top-p", "0")
    assert out.returncode == 2 and "sampling.top_p" in out.stderr and out.stdout == ""


def test_an_encoder_decoders_target_is_printed_alone_and_echo_chooses(seq2seq_bundle, engine_bundle):
    word = "transformer"
    # one graph for both runs: under auto, two start-ups could choose the fp32 pair and the INT8 one
    fp32 = ("--bundle", str(seq2seq_bundle), "--graph", "static", "--max-new-tokens", "8", "--temperature", "0")
    alone = run("generate", word, *fp32)
    echoed = run("generate", word, *fp32, "--echo")
    assert alone.returncode == 0 and echoed.returncode == 0, alone.stderr + echoed.stderr
    assert not alone.stdout.startswith(word) and alone.stdout.strip()
    assert echoed.stdout == word + alone.stdout  # the same target, after the prompt
    plain = run("generate", "To be", "--bundle", str(engine_bundle), "--max-new-tokens", "6", "--temperature", "0",
                "--ignore-eos", "--no-echo")
    assert plain.returncode == 0 and not plain.stdout.startswith("To be") and plain.stdout
