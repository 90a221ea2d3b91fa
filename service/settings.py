"""The server's settings: one pydantic object, built once at start-up and passed in.

`ServerSettings` is the engine's `EngineConfig` plus the fronts' own options; `bundle` is a list here (the
models served: `--bundle A --bundle B`, or every bundle in `models_dir`), each model's engine configured by
`engine_config(bundle)`. It reads them,
highest priority first, from CLI flags, `ATTNSERVE_*` environment variables and an optional TOML
or JSON config file (`--config` or `ATTNSERVE_CONFIG`). Nothing is read from the environment at
import time: `load_settings` does it, once.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    NoDecode,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from attnserve.arguments import HintingParser
from service.engine.config import DEFAULT_BUNDLE, EngineConfig
from service.runtime.bundle import MANIFEST_FILE

ENV_PREFIX = "ATTNSERVE_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
CONFIG_SUFFIXES = {".toml": "toml_file", ".json": "json_file"}
# other flags a setting answers to: vLLM's names, for commands written for `vllm serve`
FLAG_ALIASES = {"bundle": ("--model",)}


class SettingsError(ValueError):
    """A setting is invalid; the message says which, where it came from, and what is allowed."""


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/attnserve`, else `~/.cache/attnserve` (read when the settings are built)."""
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "attnserve"
    try:
        return Path.home() / ".cache" / "attnserve"
    except RuntimeError:  # no home: a user id without a passwd entry, as containers run
        return Path(tempfile.gettempdir()) / "attnserve-cache"


class ServerSettings(BaseSettings, EngineConfig):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", use_attribute_docstrings=True)

    bundle: Annotated[list[Path], NoDecode] = [DEFAULT_BUNDLE]
    """ONNX bundle directory (attnserve export); repeat the flag to serve several models, the first the default
    (env and config file: a path, or a JSON list of them)"""
    models_dir: Path | None = None
    """serve every bundle directly under this folder (each a folder holding bundle.json), in name order, after those
    bundle names (the shipped model is then served only if bundle names it)"""
    served_model_name: Annotated[list[Annotated[str, Field(min_length=1)]], NoDecode] = []
    """name clients know the model by: HTTP /v1/models and each request's and response's model, gRPC model fields;
    unset = the bundle's name (attnserve export --name, else the exported folder's). With several bundles, give it
    once per bundle, in their order, or not at all"""
    preload: Literal["all", "default", "none"] = "all"
    """models loaded at start-up, in order, while the memory budget holds them: all, the default (first) only, or
    none; the others are loaded on their first request (which waits for it)"""
    keep_alive_s: float = Field(0.0, ge=0)
    """a model no request has used for this long is unloaded, and loaded again on its next request (0 = never)"""
    max_loaded_models: int = Field(0, ge=0)
    """most models loaded at once; loading another unloads the least recently used idle one (0 = as many as the
    memory budget holds)"""
    step_turns: bool = True
    """with several models, their engines take turns at the cores, a model step at a time, each step using every
    core; off: engines step at once, their onnxruntime threads sharing the cores"""
    host: str = "127.0.0.1"
    """address the gRPC, HTTP and metrics ports bind to (0.0.0.0 = all interfaces)"""
    port: int = Field(50051, ge=0, le=65535)
    """gRPC port (0 = any free port)"""
    http_port: int = Field(8000, ge=0, le=65535)
    """OpenAI-compatible HTTP port on the same host, the same engine (0 = no HTTP front)"""
    metrics_port: int = Field(9464, ge=0, le=65535)
    """Prometheus /metrics HTTP port on the same host (0 = no metrics server)"""
    max_receive_message_bytes: int = Field(4 * 2**20, ge=1024)
    """largest request message (gRPC) or body (HTTP) accepted"""
    max_send_message_bytes: int = Field(16 * 2**20, ge=1024)
    """largest response message sent"""
    max_connections: int = Field(1000, ge=1)
    """connections each front (gRPC, HTTP) serves at once; beyond it gRPC refuses new connections and HTTP answers
    503 (GET /health is still answered on a few more)"""
    header_timeout_s: float = Field(10.0, gt=0)
    """a new connection must send its request headers (HTTP) or finish its handshake (gRPC) within this long, or it
    is closed"""
    body_timeout_s: float = Field(60.0, gt=0)
    """an HTTP body must arrive within this long of its headers (408 beyond)"""
    idle_timeout_s: float = Field(30.0, gt=0)
    """a connection with no request in progress is closed after this long (HTTP keep-alive; gRPC
    max_connection_idle, sent as GOAWAY)"""
    write_timeout_s: float = Field(30.0, gt=0)
    """a response the client has not read for this long, with output waiting for it, is ended and its connection
    (HTTP) or stream (gRPC) closed"""
    max_connection_age_s: float = Field(0.0, ge=0)
    """gRPC: a connection is asked to go (GOAWAY) after this long, its calls given grace_period_s to finish, so that
    clients spread over new replicas (0 = never)"""
    stream_interval_ms: float = Field(5.0, ge=0, le=1000)
    """a stream message waits until its oldest token is this old (the first token goes at once); 0 = no wait"""
    stream_tokens: int = Field(0, ge=0, le=64)
    """... and until it holds this many tokens: 0 = adaptive (1 while at most 8 sequences run, then about 8 messages
    per model step in all)"""
    stream_max_delay_ms: float = Field(50.0, ge=0, le=1000)
    """longest a token waits for a message whatever the above (can be late by one model step)"""
    grace_period_s: float = Field(20.0, ge=0)
    """on SIGTERM/SIGINT, how long in-flight requests may finish"""
    warmup: bool = True
    """run decode at the largest batch size and a few requests before reporting SERVING"""
    cache_dir: Path = Field(default_factory=default_cache_dir)
    """folder where start-up keeps what it measured about a bundle on this kind of CPU (the self-check's verdict
    and the graph choice), so that a restart serves the same graph without measuring again; a folder that cannot
    be written only costs that"""
    recheck: bool = False
    """ignore what cache_dir holds for this bundle: self-check (and with graph auto, time) the graphs again, and
    keep the new outcome"""
    tls_cert_file: Path | None = None
    """PEM certificate chain of the server; with tls_key_file, the gRPC and HTTP ports speak TLS only"""
    tls_key_file: Path | None = None
    """PEM private key of tls_cert_file"""
    tls_client_ca_file: Path | None = None
    """PEM CA certificate(s); when set, clients must present a certificate it signed (mutual TLS)"""
    auth_token: SecretStr | None = None
    """static bearer token every call but health must carry as 'authorization: Bearer <token>'"""
    auth_token_file: Path | None = None
    """file holding the bearer token (instead of auth_token)"""
    log_format: Literal["text", "json"] = "text"
    """log lines as text or as one JSON object each"""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """least severe level logged"""

    @field_validator("bundle", "served_model_name", mode="before")
    @classmethod
    def _one_or_a_list(cls, value: object) -> object:
        """A list setting given once (a flag's single value, an env var, a TOML string) is a list of one; an env
        var may hold a JSON list."""
        if isinstance(value, str) and value.startswith("["):
            try:
                return json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"is not a JSON list: {e}") from None
        return [value] if isinstance(value, (str, Path)) else value

    @model_validator(mode="after")
    def _models_are_named_once(self) -> ServerSettings:
        if self.models_dir is not None:
            if not self.models_dir.is_dir():
                raise ValueError(f"models_dir: {self.models_dir} is not a folder")
            found = sorted(p for p in self.models_dir.iterdir() if (p / MANIFEST_FILE).is_file())
            if not found:
                raise ValueError(f"models_dir: {self.models_dir} holds no bundle (a folder with {MANIFEST_FILE})")
            self.bundle = (self.bundle if "bundle" in self.model_fields_set else []) + found
        if not self.bundle:
            raise ValueError("bundle: name at least one bundle")
        if self.served_model_name and len(self.served_model_name) != len(self.bundle):
            raise ValueError(f"served_model_name: {len(self.served_model_name)} name(s) for {len(self.bundle)} "
                             "bundles; give one per bundle, in their order, or none (each is then known by its "
                             "bundle's name)")
        return self

    @model_validator(mode="after")
    def _security_settings_fit_together(self) -> ServerSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: set both for TLS, or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file (mutual TLS) needs TLS: set tls_cert_file and tls_key_file")
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_token_file"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"{name}: {path} is not a readable file")
        if self.auth_token is not None and self.auth_token_file is not None:
            raise ValueError("set auth_token or auth_token_file, not both")
        if self.auth_token is not None and not self.auth_token.get_secret_value().strip():
            raise ValueError("auth_token is empty")
        if self.auth_token_file is not None and not self.auth_token_file.read_text().strip():
            raise ValueError(f"auth_token_file: {self.auth_token_file} is empty")
        return self

    def bearer_token(self) -> str | None:
        """The token calls must carry, or None when authentication is off."""
        if self.auth_token_file is not None:
            return self.auth_token_file.read_text().strip()
        return self.auth_token.get_secret_value().strip() if self.auth_token is not None else None

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        files = TomlConfigSettingsSource(settings_cls), JsonConfigSettingsSource(settings_cls)
        return init_settings, env_settings, *files

    def engine_config(self, bundle: Path | None = None) -> EngineConfig:
        """The engine settings of `bundle` (default: the first, the default model's)."""
        values = {name: getattr(self, name) for name in EngineConfig.model_fields if name != "bundle"}
        return EngineConfig(bundle=self.bundle[0] if bundle is None else bundle, **values)


def load_settings(overrides: dict[str, Any] | None = None, config_file: Path | str | None = None) -> ServerSettings:
    """CLI values (`overrides`) > `ATTNSERVE_*` env > config file > defaults; raises `SettingsError`."""
    config_file = config_file or os.environ.get(CONFIG_ENV) or None
    cls = ServerSettings
    if config_file is not None:
        path = Path(config_file)
        if path.suffix not in CONFIG_SUFFIXES:
            raise SettingsError(f"config file {path}: use a .toml or .json file")
        if not path.is_file():
            raise SettingsError(f"config file {path} does not exist")
        cls = type("ServerSettings", (ServerSettings,),
                   {"model_config": {**ServerSettings.model_config, CONFIG_SUFFIXES[path.suffix]: path}})
    try:
        return cls(**(overrides or {}))
    except ValidationError as e:
        raise SettingsError(describe_errors(e)) from None
    except ValueError as e:  # an unreadable config file
        raise SettingsError(f"config file {config_file}: {e}") from None


def flag_and_env(name: str) -> tuple[str, str]:
    """A setting's command-line flag and environment variable: `--http-port`, `ATTNSERVE_HTTP_PORT`."""
    return "--" + name.replace("_", "-"), ENV_PREFIX + name.upper()


def describe_errors(error: ValidationError) -> str:
    """One line per bad setting: its name, the env var that sets it, the value and what is allowed."""
    lines = []
    for err in error.errors():
        name = str(err["loc"][0]) if err["loc"] else "settings"
        flag, env = flag_and_env(name)
        where = f" ({flag} / {env})" if err["loc"] else ""
        item = "".join(f"[{p}]" for p in err["loc"][1:])  # a list setting's item
        got = f"; got {err['input']!r}" if err["type"] != "missing" and not isinstance(err["input"], dict) else ""
        lines.append(f"{name}{where}: {'item ' + item + ': ' if item else ''}{err['msg'].removeprefix('Value error, ')}"
                     f"{got}")
    return "\n".join(lines)


def settings_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A flag per `ServerSettings` field (and its `FLAG_ALIASES`), its help showing the default and the env var;
    an unknown flag is answered with the closest known ones. Flags not given are left out of the parsed
    namespace, so env and config file values are not overridden."""
    # the usage line names no flag: forty of them would bury the error argparse prints under it
    p = HintingParser(prog=prog, usage=f"{prog} [options]", description=description,
                      argument_default=argparse.SUPPRESS)
    p.add_argument("--config", type=Path, help=f"TOML or JSON settings file (env {CONFIG_ENV}); flags and env "
                                               "variables override it")
    for name, info in ServerSettings.model_fields.items():
        flag, env = flag_and_env(name)
        flags = (flag, *FLAG_ALIASES.get(name, ()))
        default = info.get_default(call_default_factory=True)
        listed = get_origin(info.annotation) is list
        shown = "unset" if default in (None, []) else " ".join(map(str, default)) if listed else str(default)
        help_ = f"{' '.join(info.description.split())} [default: {shown}; env {env}]"
        choices = get_args(info.annotation) if get_origin(info.annotation) is Literal else None
        if info.annotation is bool:
            p.add_argument(*flags, action=argparse.BooleanOptionalAction, help=help_)
        else:
            p.add_argument(*flags, dest=name, choices=choices, metavar=name.upper() if not choices else None,
                           action="append" if listed else "store", help=help_)
    return p
