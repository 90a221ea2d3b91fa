"""The `attnserve` entry point dispatches to subcommands without importing what it does not need."""

from __future__ import annotations

import subprocess
import sys

import pytest

from attnserve.cli import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_unknown_command_exits_2(capsys):
    assert main(["fly"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_a_mistyped_command_is_answered_with_the_command_meant(capsys):
    assert main(["serv"]) == 2
    assert capsys.readouterr().err.startswith("attnserve: unknown command 'serv' (did you mean 'serve'?)\n")


def test_serve_answers_a_mistyped_flag_with_the_flag_meant():
    """The error is the last line, under a one-line usage (not forty flags), and names the flag meant."""
    out = subprocess.run([sys.executable, "-m", "attnserve", "serve", "--bundel", "x"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == ["usage: attnserve serve [options]",
                                       "attnserve serve: error: unrecognized arguments: --bundel x (did you mean --bundle?)"]


def test_help_does_not_import_torch():
    code = "import sys; from attnserve.cli import main; main(['--help']); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.mark.needs_torch(reason="train, import-hf and generate-local are training tools, which import torch")
def test_subcommand_help_runs():
    for name in ("train", "import-hf", "generate-local"):
        out = subprocess.run([sys.executable, "-m", "attnserve", name, "--help"], capture_output=True, text=True)
        assert out.returncode == 0 and "usage:" in out.stdout, name


def test_a_training_command_without_its_extra_says_what_to_install():
    """The serving install has no torch: `attnserve train` then ends in one line, not a traceback."""
    code = ("import sys; sys.modules['torch'] = None; from attnserve.cli import main; "
            "raise SystemExit(main(['train', '--help']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "attnserve train: needs torch, which this install lacks (the serving install leaves it out); "
        "install the extra: pip install 'attnserve[train]'"]


@pytest.mark.parametrize("command", ["generate", "health"])
def test_commands_that_reach_a_server_take_its_address_as_server(command):
    out = subprocess.run([sys.executable, "-m", "attnserve", command, "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--server HOST:PORT" in out.stdout, out.stderr


@pytest.mark.parametrize(("argv", "meant"), [
    (["generate", "x", "--temprature", "1"], "--temperature"),
    (["health", "--servr", "localhost:1"], "--server"),
    pytest.param(["export", "m", "-o", "out", "--verfy"], "--verify",
                 marks=pytest.mark.needs_torch(reason="attnserve export needs the export extra")),
    (["bench", "serve", "--concurency", "1"], "--concurrency"),
])
def test_every_command_answers_a_mistyped_flag_with_the_flag_meant(argv, meant, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and f"(did you mean {meant}?)" in capsys.readouterr().err
