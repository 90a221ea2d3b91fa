"""The README's commands run as written on a fresh clone.

Every command of README.md's ```bash blocks (continuations joined, a trailing `# comment` dropped) has one
decision in `TABLE`: `Run` it verbatim through `bash -c` from the repo root with the repo's .venv, checking its
exit status and its output, or `Skip` it for a stated reason. A README command with no decision fails
`test_every_readme_command_is_classified`.

A `Run` is one of:
- LOCAL: run to its exit.
- SERVER: started as the server (a second process), polled until `GET /health` on :8000 answers 200, then the
  README's commands for a second terminal (CLIENT) run against it, then SIGTERM, and it must exit 0.
- CLIENT: run while its `server` runs.
- RECIPE: a `make` target; `make -n` must print exactly `server`, which runs as a SERVER (make itself would first
  reinstall .venv whenever pyproject.toml is newer than it).
The README's ```python blocks run against the shipped model's server too. The README's ports are fixed
(`PORTS`): a server command is skipped, saying which port, when one is taken on this machine.

The commands that are skipped are still held to the code: their flags must be in their command's `--help`, their
make targets must exist, grpcurl's requests must parse into the API's messages, and every file of the repo a
command reads must be tracked by git, so that a fresh clone has it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PORTS = (50051, 6000, 8000, 9464)  # gRPC, gRPC moved by ATTNSERVE_PORT, HTTP, metrics
HEALTH_URL = "http://127.0.0.1:8000/health"
START_DEADLINE_S = 180.0  # model load, graph choice and warm-up, on 2 busy cores
COMMAND_DEADLINE_S = 300.0
STOP_DEADLINE_S = 60.0  # the drain's grace period is 20 s

LOCAL, SERVER, CLIENT, RECIPE = "local", "server", "client", "recipe"

Check = Callable[[str, str], None]  # (stdout, stderr) of a command that exited 0; raises AssertionError


@dataclass(frozen=True)
class Run:
    how: str  # LOCAL, SERVER, CLIENT or RECIPE (the module docstring says what each does)
    check: Check | None = None  # what its output must show (a SERVER's: its log, after its exit)
    server: str = ""  # CLIENT: the README command of the server it runs against; RECIPE: the recipe's command
    probe: Callable[[], None] | None = None  # SERVER: run while it is healthy
    writes: tuple[str, ...] = ()  # LOCAL: paths it creates, removed afterwards unless they were there before


@dataclass(frozen=True)
class Skip:
    reason: str  # one line: why the test does not run it


# ---- reading the README ----


def without_comment(line: str) -> str:
    """`line` without its trailing `# comment`: a `#` that starts a word, outside quotes."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def commands_of(text: str) -> list[str]:
    """Every command of the ```bash blocks of `text`, `\\` continuations joined with one space."""
    commands = []
    for block in fenced_blocks(text, "bash"):
        pending = ""
        for line in block.splitlines():
            if line.endswith("\\"):
                pending += line[:-1].strip() + " "
                continue
            command = without_comment(pending + line.strip())
            pending = ""
            if command:
                commands.append(command)
    return commands


def readme_commands() -> list[str]:
    return commands_of(README.read_text())


# ---- what each command's output must show ----


def prints_continuation_of(prompt: str) -> Check:
    def check(out: str, err: str) -> None:
        assert out.startswith(prompt) and len(out.strip()) > len(prompt) + 20, out

    return check


def completion_of(model: str, max_tokens: int, text: str = r"(?s).*\S.*") -> Check:
    """A `POST /v1/completions` answer of `model`, within `max_tokens`, its text matching `text`."""

    def check(out: str, err: str) -> None:
        body = json.loads(out)
        assert body["object"] == "text_completion" and body["model"] == model, body
        assert 0 < body["usage"]["completion_tokens"] <= max_tokens, body
        assert re.fullmatch(text, body["choices"][0]["text"]), body

    return check


def streamed_completion(out: str, err: str) -> None:
    events = [line.removeprefix("data: ") for line in out.splitlines() if line]
    assert all(line.startswith("data: ") for line in out.splitlines() if line), out
    assert events[-1] == "[DONE]", out
    chunks = [json.loads(event) for event in events[:-1]]
    assert len(chunks) > 1 and all(chunk["object"] == "text_completion" for chunk in chunks), out
    assert "".join(choice["text"] for chunk in chunks for choice in chunk["choices"]).strip(), out


def metrics_of_the_calls_before(out: str, err: str) -> None:
    """The grep keeps attnserve's own series, and the README's calls before it (a gRPC stream, two HTTP
    completions) are counted in them."""
    lines = out.splitlines()
    assert lines and all(line.startswith("attnserve_") for line in lines), out
    values = {series: float(value) for series, value in (line.rsplit(" ", 1) for line in lines)}
    assert values['attnserve_requests_total{code="OK",method="GenerateStream",protocol="grpc"}'] >= 1, out
    assert values['attnserve_requests_total{code="200",method="/v1/completions",protocol="http"}'] >= 2, out
    assert sum(v for series, v in values.items() if series.startswith("attnserve_generated_tokens_total{")) > 0, out


def three_completions_before_a_stop(out: str, err: str) -> None:
    completions = re.split(r"^--- \d+\n", out, flags=re.M)
    assert completions[0] == "" and len(completions) == 4, out
    assert all(text.startswith("To be") and "." not in text for text in completions[1:]), out


def llama_directory(out: str, err: str) -> None:
    assert out.strip() == "wrote runs/hf", out
    config = json.loads((ROOT / "runs/hf/config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"], config  # as the README's comment says


def server_log(*messages: str, json_lines: bool = False) -> Check:
    """A server's log (stderr) that holds each of `messages` (regular expressions), then its stop."""

    def check(out: str, err: str) -> None:
        lines = err.splitlines()
        if json_lines:
            assert lines, err
            lines = [json.loads(line)["message"] for line in lines]
        for message in (*messages, r"stopped"):
            assert any(re.search(message, line) for line in lines), f"no {message!r} in the log:\n{err}"

    return check


def grpc_health_on(address: str) -> Callable[[], None]:
    def probe() -> None:
        out = run(f".venv/bin/attnserve health --server {address}")
        assert out.returncode == 0 and out.stdout.strip() == f"{address}: SERVING", out

    return probe


# ---- the decisions ----

SHAKESPEARE = ".venv/bin/attnserve serve --bundle models/shakespeare-onnx"
G2P = ".venv/bin/attnserve serve --bundle models/g2p-cmudict-onnx"
NO_GRPCURL = ("grpcurl is in neither Debian's packages nor PyPI (but as an unofficial repackaged binary); "
              "test_grpcurl_requests_match_the_api checks its requests against the API")
TRAINING = "minutes of training on the Shakespeare corpus"
OWN_CHECKPOINT = "needs the user's own checkpoint (path/to/...)"
AFTER_OWN_CHECKPOINT = "reads what the import of the user's own checkpoint above writes"
DOCKER = ("the image's build and run are tests/deploy/test_deploy.py::test_docker_image_builds_serves_and_drains "
          "(marker docker: deploy/docker-smoke.sh)")

TABLE: dict[str, Run | Skip] = {
    "make serve": Run(RECIPE, server=SHAKESPEARE),
    "make test": Skip("it is this suite, then the serving lane and the AVX2 lane"),
    ".venv/bin/attnserve generate \"Rom.\" --stream --temperature 0.8 --max-new-tokens 100 --server localhost:50051":
        Run(CLIENT, prints_continuation_of("Rom."), server=SHAKESPEARE),
    "grpcurl -plaintext localhost:50051 list": Skip(NO_GRPCURL),
    "grpcurl -plaintext -d '{\"prompt\": \"ROMEO:\", \"sampling\": {\"temperature\": 0.8, \"seed\": 1}, "
    "\"stopping\": {\"max_new_tokens\": 40}}' localhost:50051 attnserve.v1.TextGeneration/Generate": Skip(NO_GRPCURL),
    "grpcurl -plaintext -d '{\"prompt\": \"JULIET:\", \"stopping\": {\"max_new_tokens\": 40}}' localhost:50051 "
    "attnserve.v1.TextGeneration/GenerateStream": Skip(NO_GRPCURL),
    "grpcurl -plaintext localhost:50051 grpc.health.v1.Health/Check": Skip(NO_GRPCURL),
    "curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{\"model\": \"shakespeare\", "
    "\"prompt\": \"ROMEO:\", \"max_tokens\": 40, \"temperature\": 0.8, \"seed\": 1}'":
        Run(CLIENT, completion_of("shakespeare", 40), server=SHAKESPEARE),
    "curl -sN localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{\"model\": \"shakespeare\", "
    "\"prompt\": \"JULIET:\", \"max_tokens\": 40, \"stream\": true}'":
        Run(CLIENT, streamed_completion, server=SHAKESPEARE),
    "curl -s localhost:9464/metrics | grep '^attnserve_'": Run(CLIENT, metrics_of_the_calls_before, server=SHAKESPEARE),
    ".venv/bin/attnserve serve --host 0.0.0.0 --max-running 32 --log-format json":
        Run(SERVER, server_log(r"serving shakespeare .*gRPC on 0\.0\.0\.0:50051", r"KV cache: \d+ tokens .* 32 at once",
                               json_lines=True)),
    "ATTNSERVE_PORT=6000 .venv/bin/attnserve serve --config deploy/attnserve.example.toml":
        Run(SERVER, server_log(r"serving shakespeare .*gRPC on 127\.0\.0\.1:6000", json_lines=True),
            probe=grpc_health_on("localhost:6000")),
    "docker build -t attnserve .": Skip(DOCKER),
    "docker run --rm -p 50051:50051 -p 8000:8000 -p 9464:9464 attnserve": Skip(DOCKER),
    SHAKESPEARE: Run(SERVER, server_log(r"serving shakespeare .*gRPC on 127\.0\.0\.1:50051")),
    ".venv/bin/attnserve generate \"ROMEO:\" --server localhost:50051 --stream --seed 1":
        Run(CLIENT, prints_continuation_of("ROMEO:"), server=SHAKESPEARE),
    ".venv/bin/attnserve generate \"ROMEO:\" --max-new-tokens 120 --temperature 0.8 --top-p 0.95 --seed 1":
        Run(LOCAL, prints_continuation_of("ROMEO:")),
    ".venv/bin/attnserve generate \"To be\" -n 3 --stop \".\" --graph static": Run(LOCAL, three_completions_before_a_stop),
    ".venv/bin/attnserve bench engine": Skip("minutes of measurement, and it rewrites docs/BENCHMARKS.md"),
    ".venv/bin/attnserve bench serve --server localhost:50051 --concurrency 1,8,32,64":
        Skip("minutes of load at up to 64 clients, and it rewrites docs/BENCHMARKS.md"),
    "make bench": Skip("hours (every peer's build and runs), and it rewrites docs/BENCHMARKS.md"),
    ".venv/bin/attnserve bench g2p": Skip("needs the peers' virtualenvs (make bench-peers), and it rewrites "
                                          "docs/BENCHMARKS.md"),
    "make soak": Skip("10 minutes of load"),
    "make real-shapes && make bench-llama-cpp": Skip("minutes to hours and gigabytes: random-weight models of "
                                                     "0.5B-1.5B parameters, and llama.cpp built from source"),
    ".venv/bin/attnserve bench compare --real-shapes": Skip("hours of measurement at real shapes, and it rewrites "
                                                           "docs/BENCHMARKS.md"),
    ".venv/bin/attnserve export-hf models/shakespeare -o runs/hf": Run(LOCAL, llama_directory, writes=("runs/hf",)),
    ".venv/bin/attnserve generate-local \"Rom.\" --max-new-tokens 200 --temperature 0.8 --top-k 50 --seed 0":
        Run(LOCAL, prints_continuation_of("Rom.")),
    ".venv/bin/attnserve train --arch llama --out models/shakespeare":
        Skip("about 12 minutes of training, and it replaces the shipped model"),
    ".venv/bin/attnserve train --out runs/small --n-layer 2 --max-steps 300": Skip(TRAINING),
    ".venv/bin/attnserve train --out runs/small --resume": Skip(TRAINING + ", continuing the run above"),
    ".venv/bin/attnserve import-hf path/to/local/gpt2 -o models/gpt2": Skip(OWN_CHECKPOINT),
    ".venv/bin/attnserve import-gguf path/to/model-q4_k_m.gguf -o models/from-gguf": Skip(OWN_CHECKPOINT),
    ".venv/bin/attnserve export models/gpt2 -o models/gpt2-onnx --optimize --int8 --verify": Skip(AFTER_OWN_CHECKPOINT),
    ".venv/bin/attnserve import-hf path/to/SmolLM2-135M -o models/smollm2": Skip(OWN_CHECKPOINT),
    ".venv/bin/attnserve export models/smollm2 -o models/smollm2-onnx --int8 --verify": Skip(AFTER_OWN_CHECKPOINT),
    ".venv/bin/attnserve serve --bundle models/smollm2-onnx": Skip(AFTER_OWN_CHECKPOINT),
    ".venv/bin/attnserve import-gguf path/to/qwen2.5-0.5b-instruct-q8_0.gguf -o models/qwen2.5-0.5b":
        Skip(OWN_CHECKPOINT),
    ".venv/bin/attnserve export models/qwen2.5-0.5b -o models/qwen2.5-0.5b-onnx --int8 --verify":
        Skip(AFTER_OWN_CHECKPOINT),
    G2P: Run(SERVER, server_log(r"serving g2p-cmudict ")),
    "grpcurl -plaintext -d '{\"prompt\": \"transformer\"}' localhost:50051 attnserve.v1.TextGeneration/Generate":
        Skip(NO_GRPCURL),
    "curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{\"model\": \"g2p-cmudict\", "
    "\"prompt\": \"attention\", \"max_tokens\": 30, \"temperature\": 0}'":
        Run(CLIENT, completion_of("g2p-cmudict", 30, text=r"[A-Z]+[012]?( [A-Z]+[012]?)+"), server=G2P),
    ".venv/bin/attnserve import-hf path/to/bart -o models/bart": Skip(OWN_CHECKPOINT),
    ".venv/bin/attnserve export models/bart -o models/bart-onnx --verify": Skip(AFTER_OWN_CHECKPOINT),
    ".venv/bin/attnserve serve --bundle models/bart-onnx": Skip(AFTER_OWN_CHECKPOINT),
}
PYTHON_SERVER = SHAKESPEARE  # the README's ```python blocks call the shipped model's server


def decided(how: str) -> list[str]:
    return [command for command, decision in TABLE.items() if isinstance(decision, Run) and decision.how == how]


# ---- running a command as the README's reader would ----


def readme_env() -> dict[str, str]:
    """The test's environment less ATTNSERVE_* settings, which a fresh shell does not have."""
    return {name: value for name, value in os.environ.items() if not name.startswith("ATTNSERVE_")}


def run(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=ROOT, env=readme_env(), capture_output=True, text=True,
                          timeout=COMMAND_DEADLINE_S)


def run_and_check(command: str, check: Check | None) -> None:
    out = run(command)
    assert out.returncode == 0, f"{command}\nexit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    if check:
        check(out.stdout, out.stderr)


def taken_ports() -> list[int]:
    """Those of `PORTS` another process listens on (a bind as the servers bind, on every address, fails)."""
    families = [(socket.AF_INET, "0.0.0.0")] + [(socket.AF_INET6, "::")] * socket.has_ipv6
    taken = []
    for port in PORTS:
        for family, address in families:
            try:
                with socket.socket(family, socket.SOCK_STREAM) as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    if family == socket.AF_INET6:
                        probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                    probe.bind((address, port))
            except OSError as error:
                if error.errno == errno.EADDRINUSE:  # anything else: a machine without IPv6
                    taken.append(port)
                    break
    return taken


@pytest.fixture
def start_server(tmp_path):
    """start_server(command) -> (process, stdout path, stderr path); the process is killed at the end if alive."""
    started: list[subprocess.Popen] = []

    def start(command: str) -> tuple[subprocess.Popen, Path, Path]:
        taken = taken_ports()
        if taken:
            pytest.skip(f"port(s) {taken} are taken on this machine; the README's commands use fixed ports {PORTS}")
        out_path, err_path = tmp_path / f"server{len(started)}.out", tmp_path / f"server{len(started)}.err"
        with open(out_path, "w") as out, open(err_path, "w") as err:
            # bash execs a lone command, so the signals below reach the server itself
            started.append(subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=readme_env(), stdout=out,
                                            stderr=err, start_new_session=True))
        return started[-1], out_path, err_path

    yield start
    for process in started:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # whatever is left of its process group
        except ProcessLookupError:
            pass
        process.wait()


def wait_until_healthy(process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited ({process.returncode}) before it was healthy:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(HEALTH_URL, timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or 503 until warm
        time.sleep(0.2)  # the poll's interval
    pytest.fail(f"{HEALTH_URL} did not answer 200 within {START_DEADLINE_S} s:\n{log.read_text()[-3000:]}")


# ---- the tests ----


def test_commands_are_read_as_bash_reads_them():
    text = ("```bash\nmake serve       # sets up .venv\ncurl -s x -H 'a: b' \\\n    -d '{\"k\": \"#1\"}'  # c\n\n```\n"
            "```python\nprint('not bash')\n```\n```bash\necho a#b\n```\n")
    assert commands_of(text) == ["make serve", "curl -s x -H 'a: b' -d '{\"k\": \"#1\"}'", "echo a#b"]


def test_every_readme_command_is_classified():
    commands = readme_commands()
    undecided = [command for command in commands if command not in TABLE]
    assert not undecided, ("README commands with no decision: classify each in TABLE of tests/test_readme.py as "
                           "Run (how it is run and checked) or Skip (why not):\n" + "\n".join(undecided))
    gone = [command for command in TABLE if command not in commands]
    assert not gone, "TABLE decides commands the README no longer has; remove them:\n" + "\n".join(gone)
    for command in decided(CLIENT):
        server = TABLE.get(TABLE[command].server)
        assert isinstance(server, Run) and server.how == SERVER, f"{command}: its server is no SERVER of TABLE"


def test_make_targets_run_the_readme_commands():
    """`make serve` is run as its recipe, which must be the README's server command; skipped targets exist."""
    for command in decided(RECIPE):
        target = command.removeprefix("make ")
        out = run(f"make --no-print-directory -n -o .venv/bin/.installed {target}")
        assert out.returncode == 0 and out.stdout == TABLE[command].server + "\n", (command, out)
        assert TABLE[TABLE[command].server].how == SERVER
    g2p_recipe = run("make --no-print-directory -n -o .venv/bin/.installed serve-g2p")
    assert g2p_recipe.stdout == G2P + "\n", g2p_recipe  # the README gives it as the same command
    for command in TABLE:
        if command.startswith("make ") and isinstance(TABLE[command], Skip):
            out = run(f"make -n {command.removeprefix('make ')}")
            assert out.returncode == 0, (command, out.stderr)


def attnserve_help(command: str) -> str:
    """The `--help` of the (sub)command `command` runs: `attnserve train`, `attnserve bench engine`."""
    words = shlex.split(command)
    depth = 3 if words[1] == "bench" else 2
    out = run(shlex.join([*words[:depth], "--help"]))
    assert out.returncode == 0, (command, out.stderr)
    return out.stdout


@pytest.mark.slow
def test_skipped_attnserve_commands_take_their_flags():
    """What is not run still names only flags its command has (each `--help` imports torch: a few seconds)."""
    for command, decision in TABLE.items():
        if isinstance(decision, Skip) and command.startswith(".venv/bin/attnserve "):
            flags = [word.split("=")[0] for word in shlex.split(command) if re.fullmatch(r"--?[a-z][\w-]*(=.*)?", word)]
            usage = attnserve_help(command)
            missing = [flag for flag in flags if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", usage)]
            assert not missing, f"{command}: no {missing} in its --help"


def test_grpcurl_requests_match_the_api():
    """The grpcurl commands name methods the server has and send JSON its request messages parse."""
    from google.protobuf import json_format, message_factory
    from grpc_health.v1 import health_pb2

    from attnserve.v1 import generate_pb2

    services = {**generate_pb2.DESCRIPTOR.services_by_name, **health_pb2.DESCRIPTOR.services_by_name}
    services = {service.full_name: service for service in services.values()}
    grpcurl_commands = [command for command in TABLE if command.startswith("grpcurl ")]
    assert grpcurl_commands
    for command in grpcurl_commands:
        words = shlex.split(command)
        if words[-1] == "list":
            continue
        service_name, method_name = words[-1].rsplit("/", 1)
        method = services[service_name].methods_by_name[method_name]
        request = message_factory.GetMessageClass(method.input_type)()
        if "-d" in words:
            json_format.Parse(words[words.index("-d") + 1], request)  # unknown fields raise
            assert request.prompt, command


def test_readme_reads_only_shipped_files():
    """A file of the repo that a command reads is tracked, so a fresh clone has it (outputs are not read)."""
    listed = run("git ls-files")
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    tracked = set(listed.stdout.splitlines())
    folders = {str(Path(path).parent) for path in tracked} | {str(parent) for path in tracked
                                                             for parent in Path(path).parents}
    for command in TABLE:
        words = [word.split("=", 1)[-1] for word in shlex.split(command)]
        outputs = {after for flag, after in zip(words, words[1:], strict=False) if flag in ("-o", "--out")}
        for word in words:
            if "/" not in word or word in outputs or word.startswith((".venv", "/")) or not (ROOT / word).exists():
                continue
            assert word.rstrip("/") in tracked | folders, f"{command}: {word} is not tracked by git"


@pytest.mark.slow
@pytest.mark.parametrize("command", decided(LOCAL))
def test_local_command(command):
    decision = TABLE[command]
    created = [ROOT / path for path in decision.writes if not (ROOT / path).exists()]
    created_parents = [path.parent for path in created if not path.parent.exists()]
    try:
        run_and_check(command, decision.check)
    finally:
        for path in created:
            subprocess.run(["rm", "-rf", str(path)], check=True)
        for parent in created_parents:
            parent.rmdir()


@pytest.mark.slow
@pytest.mark.parametrize("command", decided(SERVER))
def test_server_command(command, start_server):
    """The server comes up healthy, answers the README's commands for a second terminal, and stops on SIGTERM."""
    decision = TABLE[command]
    process, out_path, err_path = start_server(command)
    wait_until_healthy(process, err_path)
    if decision.probe:
        decision.probe()
    for client in decided(CLIENT):
        if TABLE[client].server == command:
            run_and_check(client, TABLE[client].check)
    if command == PYTHON_SERVER:
        for block in fenced_blocks(README.read_text(), "python"):
            out = subprocess.run([".venv/bin/python", "-c", block], cwd=ROOT, env=readme_env(), capture_output=True,
                                 text=True, timeout=COMMAND_DEADLINE_S)
            assert out.returncode == 0 and len(out.stdout.strip()) > 40, (block, out.stdout, out.stderr)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=STOP_DEADLINE_S)
    assert process.returncode == 0, err_path.read_text()[-3000:]
    decision.check(out_path.read_text(), err_path.read_text())
