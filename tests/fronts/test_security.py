"""TLS, mutual TLS and the bearer token, against a real server, with CAs made in the test."""

from __future__ import annotations

import pickle
import ssl
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytest.importorskip("cryptography")

from service.client import (
    Client,  # noqa: E402
    channel_credentials,  # noqa: E402
)
from service.client.health_probe import check  # noqa: E402
from service.settings import SettingsError, load_settings  # noqa: E402
from tests.fronts.certs import CA  # noqa: E402
from tests.fronts.server_harness import ServerThread, free_port, settings  # noqa: E402

TOKEN = "s3cr3t-token-for-tests"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, other = CA(d, "test"), CA(d, "other")
    return {"ca": ca, "other": other, "server": ca.issue("server", server=True),
            "client": ca.issue("client", server=False), "stranger": other.issue("stranger", server=False)}


def generate(address, **client_kwargs):
    with Client(address, timeout_s=30, **client_kwargs) as c:
        return c.generate("Rom.", max_new_tokens=4, temperature=0.0)


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()


@pytest.fixture(scope="module")
def tls_server(engine_bundle, pki):
    s = settings(engine_bundle, tls_cert_file=pki["server"].cert, tls_key_file=pki["server"].key,
                 http_port=free_port())
    with ServerThread(s) as srv:
        yield srv


def test_tls_serves_clients_that_trust_its_ca_and_nobody_in_plaintext(tls_server, pki):
    ok = generate(tls_server.address, credentials=channel_credentials(pki["ca"].cert_file))
    assert len(ok.completions[0].token_ids) == 4
    assert code_of(lambda: generate(tls_server.address)) is grpc.StatusCode.UNAVAILABLE  # plaintext
    untrusting = channel_credentials(pki["other"].cert_file)
    assert code_of(lambda: generate(tls_server.address, credentials=untrusting)) is grpc.StatusCode.UNAVAILABLE
    assert check(tls_server.address, credentials=channel_credentials(pki["ca"].cert_file)) == "SERVING"


@pytest.fixture(scope="module")
def mtls_server(engine_bundle, pki):
    s = settings(engine_bundle, tls_cert_file=pki["server"].cert, tls_key_file=pki["server"].key,
                 tls_client_ca_file=pki["ca"].cert_file, http_port=free_port())
    with ServerThread(s) as srv:
        yield srv


def test_mutual_tls_needs_a_client_certificate_from_the_ca(mtls_server, pki):
    ca = pki["ca"].cert_file
    mine = channel_credentials(ca, pki["client"].cert, pki["client"].key)
    assert len(generate(mtls_server.address, credentials=mine).completions[0].token_ids) == 4
    assert code_of(lambda: generate(mtls_server.address, credentials=channel_credentials(ca))) is \
        grpc.StatusCode.UNAVAILABLE  # no client certificate
    stranger = channel_credentials(ca, pki["stranger"].cert, pki["stranger"].key)
    assert code_of(lambda: generate(mtls_server.address, credentials=stranger)) is grpc.StatusCode.UNAVAILABLE


def https_completion(srv: ServerThread, ca, pair=None, scheme: str = "https") -> int:
    """Completion tokens of a request over the HTTP front with the openai client, trusting `ca` and
    presenting `pair` (a client certificate) if given."""
    openai = pytest.importorskip("openai")
    httpx2 = pytest.importorskip("httpx2")
    context = ssl.create_default_context(cafile=str(ca.cert_file))
    if pair is not None:
        context.load_cert_chain(pair.cert, pair.key)
    with httpx2.Client(verify=context) as http, openai.OpenAI(
            base_url=f"{scheme}://127.0.0.1:{srv.server.http_port}/v1", api_key="x", http_client=http,
            max_retries=0, timeout=30) as api:
        return api.completions.create(model="", prompt="Rom.", max_tokens=4, temperature=0).usage.completion_tokens


def test_tls_covers_the_http_port_too(tls_server, mtls_server, pki):
    openai = pytest.importorskip("openai")
    assert https_completion(tls_server, pki["ca"]) == 4
    for refused in (lambda: https_completion(tls_server, pki["ca"], scheme="http"),  # plaintext
                    lambda: https_completion(tls_server, pki["other"]),  # a CA the client does not trust
                    lambda: https_completion(mtls_server, pki["ca"]),  # no client certificate
                    lambda: https_completion(mtls_server, pki["ca"], pki["stranger"])):
        with pytest.raises(openai.APIConnectionError):
            refused()
    assert https_completion(mtls_server, pki["ca"], pki["client"]) == 4


@pytest.fixture(scope="module")
def token_server(engine_bundle):
    with ServerThread(settings(engine_bundle, auth_token=TOKEN)) as srv:
        yield srv


def test_bearer_token_required_on_every_rpc_but_health(token_server):
    address = token_server.address
    assert len(generate(address, token=TOKEN).completions[0].token_ids) == 4
    for token in (None, "wrong", TOKEN + "x", ""):
        assert code_of(lambda t=token: generate(address, token=t)) is grpc.StatusCode.UNAUTHENTICATED
    with Client(address, timeout_s=30, token="wrong") as c:
        err = pytest.raises(grpc.RpcError, lambda: list(c.stream("Rom.", max_new_tokens=4))).value
        assert err.code() is grpc.StatusCode.UNAUTHENTICATED and "bearer token" in err.details()
        for rpc in (lambda: c.tokenize("x"), c.model_info, c.server_info):
            assert code_of(rpc) is grpc.StatusCode.UNAUTHENTICATED
    with Client(address, timeout_s=30, metadata=[("authorization", f"Basic {TOKEN}")]) as c:
        assert code_of(c.model_info) is grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(address) as ch:  # probes need no secret
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_cli_generate_with_token_and_tls(tls_server, token_server, pki):
    run = lambda *args: subprocess.run([sys.executable, "-m", "attnserve.cli", "generate", "Rom.",  # noqa: E731
                                        "--max-new-tokens", "4", *args], capture_output=True, text=True, timeout=120)
    assert run("--server", token_server.address, "--token", TOKEN).returncode == 0
    refused = run("--server", token_server.address, "--token", "nope")
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr
    assert run("--server", tls_server.address, "--tls-ca", str(pki["ca"].cert_file)).returncode == 0
    health = subprocess.run([sys.executable, "-m", "attnserve.cli", "health", "--server", tls_server.address,
                             "--tls-ca", str(pki["ca"].cert_file)], capture_output=True, text=True, timeout=60)
    assert health.returncode == 0 and "SERVING" in health.stdout


def test_security_settings_that_do_not_fit_are_refused(tmp_path, pki):
    cert = str(pki["server"].cert)
    cases = {
        "tls_cert_file and tls_key_file go together": {"tls_cert_file": cert},
        "needs TLS": {"tls_client_ca_file": str(pki["ca"].cert_file)},
        "not a readable file": {"tls_cert_file": cert, "tls_key_file": str(tmp_path / "missing.key")},
        "not both": {"auth_token": TOKEN, "auth_token_file": cert},
        "auth_token is empty": {"auth_token": "  "},
    }
    for message, values in cases.items():
        with pytest.raises(SettingsError, match=message):
            load_settings(values)
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(SettingsError, match="is empty"):
        load_settings({"auth_token_file": str(empty)})
    empty.write_text(f"{TOKEN}\n")
    assert load_settings({"auth_token_file": str(empty)}).bearer_token() == TOKEN
    assert TOKEN not in repr(load_settings({"auth_token": TOKEN}))  # a secret, not logged


def test_a_key_that_is_not_pem_stops_start_up(engine_bundle, tmp_path, pki):
    junk = tmp_path / "junk.key"
    junk.write_text("not a key")
    s = settings(engine_bundle, tls_cert_file=pki["server"].cert, tls_key_file=junk)
    with pytest.raises(ValueError, match="not PEM"):
        ServerThread(s)


@pytest.mark.needs_torch(reason="imports a checkpoint with torch")
def test_pickled_checkpoints_are_refused(tiny_tokenizer, tmp_path):
    """`.bin` weights load with weights_only=True: a pickle that would run code is refused, unrun."""
    from model.hf.import_hf import import_hf
    from tests.model.test_import_hf import save_random_gpt2

    src = tmp_path / "hf"
    save_random_gpt2(src, tiny_tokenizer, safe_serialization=False)
    tiny_tokenizer.save(src / "tokenizer.json")
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (src / "pytorch_model.bin").write_bytes(pickle.dumps({"transformer.wte.weight": Payload()}))
    with pytest.raises(pickle.UnpicklingError):
        import_hf(src, tmp_path / "ours")
    assert not marker.exists()
