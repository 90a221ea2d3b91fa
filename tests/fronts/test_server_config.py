"""Server settings: flags > ATTNSERVE_* env > config file > defaults, with readable errors;
structured logs carry the request id."""

from __future__ import annotations

import io
import json
import logging
import re
import tomllib
from pathlib import Path

import pytest

from service import logs
from service.engine.config import DEFAULT_BUNDLE
from service.settings import ServerSettings, SettingsError, load_settings, settings_parser

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in [*(f"ATTNSERVE_{f.upper()}" for f in ServerSettings.model_fields), "ATTNSERVE_CONFIG"]:
        monkeypatch.delenv(name, raising=False)


def parse(*argv: str) -> ServerSettings:
    args = vars(settings_parser("serve", "").parse_args(list(argv)))
    return load_settings(args, args.pop("config", None))


def test_defaults():
    s = parse()
    assert (s.host, s.port, s.metrics_port, s.max_running, s.max_waiting, s.max_batch_tokens) == \
        ("127.0.0.1", 50051, 9464, 64, 256, 512)
    assert s.log_format == "text" and s.warmup is True and s.providers == "cpu"
    assert s.engine_config().max_running == 64


def test_precedence_flag_over_env_over_file(tmp_path, monkeypatch):
    config = tmp_path / "attnserve.toml"
    config.write_text('port = 6000\nmax_running = 4\nmax_batch_tokens = 100\nlog_format = "json"\n')
    monkeypatch.setenv("ATTNSERVE_MAX_RUNNING", "8")
    s = parse("--config", str(config), "--port", "7000", "--no-warmup")
    assert s.port == 7000  # flag beats file
    assert s.max_running == 8  # env beats file
    assert s.max_batch_tokens == 100 and s.log_format == "json"  # file beats defaults
    assert s.warmup is False
    monkeypatch.setenv("ATTNSERVE_CONFIG", str(config))
    assert parse().port == 6000


def test_the_graph_choice_cache_lives_under_xdg_cache_home_unless_told(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert parse().cache_dir == tmp_path / "xdg" / "attnserve" and parse().recheck is False
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert parse().cache_dir == Path.home() / ".cache" / "attnserve"
    monkeypatch.setenv("ATTNSERVE_CACHE_DIR", str(tmp_path / "mine"))
    assert parse("--recheck").cache_dir == tmp_path / "mine" and parse("--recheck").recheck is True
    assert parse("--cache-dir", str(tmp_path / "flag")).cache_dir == tmp_path / "flag"


def test_json_config_file(tmp_path):
    config = tmp_path / "attnserve.json"
    config.write_text(json.dumps({"threads": 2, "metrics_port": 0, "providers": "auto"}))
    s = parse("--config", str(config))
    assert (s.threads, s.metrics_port, s.providers) == (2, 0, "auto")


@pytest.mark.parametrize("argv,env,words", [
    (["--max-running", "0"], {}, ["max_running", "--max-running", "ATTNSERVE_MAX_RUNNING", "greater than or equal"]),
    (["--port", "70000"], {}, ["port", "65535"]),
    ([], {"ATTNSERVE_MAX_WAITING": "many"}, ["max_waiting", "'many'"]),
    (["--max-running", "64", "--max-batch-tokens", "64"], {}, ["max_batch_tokens (64) must exceed max_running"]),
])
def test_invalid_settings_name_the_setting(monkeypatch, argv, env, words):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SettingsError) as e:
        parse(*argv)
    for w in words:
        assert w in str(e.value)


def test_bad_config_files(tmp_path):
    with pytest.raises(SettingsError, match="does not exist"):
        parse("--config", str(tmp_path / "missing.toml"))
    yaml = tmp_path / "c.yaml"
    yaml.write_text("port: 1")
    with pytest.raises(SettingsError, match="toml or .json"):
        parse("--config", str(yaml))
    unknown = tmp_path / "c.toml"
    unknown.write_text("prot = 5\n")
    with pytest.raises(SettingsError, match="prot"):
        parse("--config", str(unknown))
    broken = tmp_path / "b.toml"
    broken.write_text("port = = 5\n")
    with pytest.raises(SettingsError, match="b.toml"):
        parse("--config", str(broken))


def test_choices_are_enforced_by_the_flags():
    with pytest.raises(SystemExit):
        settings_parser("serve", "").parse_args(["--log-format", "xml"])


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_log_lines_carry_the_request_id(fmt):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    logs.setup_logging(fmt, "info")
    stream = io.StringIO()
    handler = logging.getLogger().handlers[0]
    handler.setStream(stream)
    try:
        token = logs.request_id.set("req-42")
        logging.getLogger("attnserve.server").info("Generate OK", extra={"completion_tokens": 7})
        logs.request_id.reset(token)
        logging.getLogger("attnserve.server").info("idle")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    first, second = stream.getvalue().splitlines()
    if fmt == "json":
        a, b = json.loads(first), json.loads(second)
        assert (a["request_id"], a["message"], a["completion_tokens"], a["level"]) == ("req-42", "Generate OK", 7,
                                                                                       "info")
        assert b["request_id"] == "-"
    else:
        assert "[req-42] Generate OK completion_tokens=7" in first and "[-] idle" in second


def test_model_is_another_name_for_bundle():
    """vLLM's flag name: a `vllm serve --model ...` command line carries over."""
    assert parse("--model", "my-bundle").bundle == [Path("my-bundle")]
    assert "--bundle BUNDLE, --model BUNDLE" in settings_parser("serve", "").format_help()


def test_served_model_name_from_a_flag_or_the_environment(monkeypatch):
    assert parse().served_model_name == []
    assert parse("--served-model-name", "poet-7b").served_model_name == ["poet-7b"]
    monkeypatch.setenv("ATTNSERVE_SERVED_MODEL_NAME", "from-env")
    assert parse().served_model_name == ["from-env"]
    with pytest.raises(SettingsError, match=r"served_model_name \(--served-model-name / ATTNSERVE_SERVED_MODEL_NAME\)"):
        parse("--served-model-name", "")


def test_an_unknown_flag_is_answered_with_the_closest_one(capsys):
    with pytest.raises(SystemExit) as e:
        parse("--bundel", "x")
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        "serve: error: unrecognized arguments: --bundel x (did you mean --bundle?)"
    with pytest.raises(SystemExit):
        parse("--max-runing=4", "--prot", "5", "--colour", "--xyzzy")
    assert capsys.readouterr().err.splitlines()[-1] == (
        "serve: error: unrecognized arguments: --max-runing=4 --prot 5 --colour --xyzzy "
        "(--max-runing: did you mean --max-running?; --prot: did you mean --port?)")


EXAMPLE_CONFIG = ROOT / "deploy" / "attnserve.example.toml"
# a commented-out setting: '# name = value', not a comment's continuation
COMMENTED_SETTING = re.compile(r"# ?([a-z_]+) = ")


def test_the_example_config_file_is_what_serve_reads():
    """deploy/attnserve.example.toml, as `attnserve serve --config` reads it: it serves the shipped model, and
    every setting it sets holds the value it writes."""
    s = parse("--config", str(EXAMPLE_CONFIG))
    assert s.bundle == [DEFAULT_BUNDLE]  # the shipped model (in the serving lane, where the installed copy expects it)
    written = tomllib.loads(EXAMPLE_CONFIG.read_text())
    assert written and {name: getattr(s, name) for name in written} == written


def test_the_example_configs_commented_out_settings_are_settings(tmp_path):
    """Uncommented, each suggestion is a setting with a value of its type (those naming a file are left out:
    the files do not exist here)."""
    lines, suggested = [], []
    for line in EXAMPLE_CONFIG.read_text().splitlines():
        setting = COMMENTED_SETTING.match(line)
        if setting:
            suggested.append(setting[1])
            if not setting[1].endswith("_file"):
                line = line[setting.start(1):]
        lines.append(line)
    assert "served_model_name" in suggested and set(suggested) <= set(ServerSettings.model_fields)
    uncommented = tmp_path / "uncommented.toml"
    uncommented.write_text("\n".join(lines))
    s = parse("--config", str(uncommented))
    assert s.served_model_name == ["shakespeare"] and s.speculative == "ngram"
