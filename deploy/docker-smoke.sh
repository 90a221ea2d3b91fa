#!/usr/bin/env bash
# Build the CPU image, run it, and check it end to end from the host:
#   1. use the Docker engine at $DOCKER_HOST, or start a private one (installing docker.io if needed)
#   2. use BASE_IMAGE if set; else python:3.11-slim if it can be pulled; else a local Debian bookworm
#      base with Python 3.11 (mmdebstrap, cached in ~/.cache/attnserve/)
#   3. build the image offline from a host wheelhouse (deploy/build-wheelhouse.sh)
#   4. run it (host network, loopback, `--memory 6g`) and wait for the gRPC health service to say SERVING,
#      and for Docker's HEALTHCHECK to say healthy; its log must plan memory from the container's limit
#   5. generate text over gRPC from the host, and over HTTP (GET /health, POST /v1/completions)
#   6. stop it with SIGTERM and check that it exited 0 after draining
#   7. print the image size
#   8. remove what it started: the container, the image, and the private engine (by pid)
# Exit status: 0 passed, 1 failed, 77 no Docker engine could be started here (one loud line says so).
#   deploy/docker-smoke.sh      env: PYTHON (host python with attnserve), KEEP_IMAGE=1, BASE_IMAGE,
#                               VARIANT=gpu (the GPU variant on this base: onnxruntime-gpu, run on the CPU here)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
TAG=attnserve:smoke-$$
NAME=attnserve-smoke-$$
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/attnserve
WORK=$(mktemp -d /tmp/attnserve-smoke.XXXXXX)
DOCKERD_PID=
CONTAINER=

say() { printf '[docker-smoke] %s\n' "$*" >&2; }
skip() { printf '\n[docker-smoke] SKIPPED: NO DOCKER ENGINE COULD BE STARTED HERE (%s)\n\n' "$*" >&2; exit 77; }

cleanup() {
    set +e
    if [ -n "$CONTAINER" ]; then docker rm -f "$CONTAINER" >/dev/null 2>&1; fi
    if [ -z "${KEEP_IMAGE:-}" ]; then docker rmi -f "$TAG" >/dev/null 2>&1; fi
    if [ -n "$DOCKERD_PID" ]; then
        kill "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 50); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.2; done
        kill -9 "$DOCKERD_PID" 2>/dev/null
        say "stopped the private Docker engine (pid $DOCKERD_PID)"
    fi
    # the private engine's data root holds vfs layers owned by root; remove them whole
    rm -rf "$WORK" 2>/dev/null
}
trap cleanup EXIT

# ---- 1. an engine --------------------------------------------------------------------------------
start_engine() {
    if ! command -v dockerd >/dev/null; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            say "installing docker.io"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null 2>&1 ||
                skip "apt-get install docker.io failed"
        else
            skip "dockerd is not installed and cannot be installed without root and apt-get"
        fi
    fi
    [ "$(id -u)" = 0 ] || skip "starting dockerd needs root"
    mkdir -p "$WORK/data" "$WORK/exec"
    dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver=vfs \
        --data-root="$WORK/data" --exec-root="$WORK/exec" -H "unix://$WORK/docker.sock" \
        --pidfile="$WORK/dockerd.pid" >"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    export DOCKER_HOST="unix://$WORK/docker.sock"
    for _ in $(seq 100); do
        docker info >/dev/null 2>&1 && { say "started a private Docker engine (pid $DOCKERD_PID)"; return; }
        kill -0 "$DOCKERD_PID" 2>/dev/null || break
        sleep 0.3
    done
    tail -5 "$WORK/dockerd.log" >&2
    skip "dockerd did not start"
}
command -v docker >/dev/null || skip "no docker client"
if docker info >/dev/null 2>&1; then say "using the running Docker engine"; else start_engine; fi

# ---- 2. a base image -----------------------------------------------------------------------------
local_base() {
    local image=local/python:3.11
    if docker image inspect "$image" >/dev/null 2>&1; then echo "$image"; return; fi
    mkdir -p "$CACHE"
    if [ ! -s "$CACHE/bookworm-python3.tar" ]; then
        command -v mmdebstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >/dev/null 2>&1 ||
            { say "FAILED: mmdebstrap is missing and cannot be installed"; exit 1; }
        say "building a Debian bookworm base with Python 3.11 (mmdebstrap; cached in $CACHE)"
        # merged /usr by hook (not the usrmerge package, which pulls in perl); no docs, man pages or locales
        mmdebstrap --quiet --format=tar --variant=minbase --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
            --include=python3,python3-venv,ca-certificates \
            --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
            --dpkgopt='path-exclude=/usr/share/info/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
            --dpkgopt='path-include=/usr/share/locale/locale.alias' \
            bookworm "$CACHE/bookworm-python3.tar.partial" >"$WORK/mmdebstrap.log" 2>&1 ||
            { tail -20 "$WORK/mmdebstrap.log" >&2; return 1; }
        mv "$CACHE/bookworm-python3.tar.partial" "$CACHE/bookworm-python3.tar"
    fi
    docker import "$CACHE/bookworm-python3.tar" "$image" >/dev/null || return 1
    echo "$image"
}
if [ -z "${BASE_IMAGE:-}" ]; then
    if timeout 30 docker pull -q python:3.11-slim >/dev/null 2>&1; then BASE_IMAGE=python:3.11-slim
    else
        say "python:3.11-slim cannot be pulled; using a local base"
        BASE_IMAGE=$(local_base) || { say "FAILED: no local base image"; exit 1; }
    fi
fi
say "base image: $BASE_IMAGE"

# ---- 3. build ------------------------------------------------------------------------------------
VARIANT=${VARIANT:-cpu}
PYTHON=$PYTHON deploy/build-wheelhouse.sh "$VARIANT" >&2
start=$(date +%s)
docker build --network=host --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg VARIANT="$VARIANT" -t "$TAG" . \
    >"$WORK/build.log" 2>&1 ||
    { tail -30 "$WORK/build.log" >&2; say "FAILED: docker build"; exit 1; }
say "built $TAG in $(( $(date +%s) - start )) s"

# ---- 4. run and wait for SERVING -----------------------------------------------------------------
port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
hport=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mport=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# read-only root file system, as deploy/k8s runs it
MEMORY=${MEMORY:-6g}
CONTAINER=$(docker run -d --network=host --read-only --tmpfs /tmp --memory "$MEMORY" --name "$NAME" \
    -e ATTNSERVE_HOST=127.0.0.1 -e ATTNSERVE_PORT="$port" -e ATTNSERVE_HTTP_PORT="$hport" -e ATTNSERVE_METRICS_PORT="$mport" "$TAG")
address=127.0.0.1:$port
for i in $(seq 120); do
    if "$PYTHON" -m service.client.health_probe --server "$address" >/dev/null 2>&1; then break; fi
    if [ "$(docker inspect -f '{{.State.Running}}' "$CONTAINER")" != true ]; then
        docker logs "$CONTAINER" >&2; say "FAILED: the container exited before SERVING"; exit 1
    fi
    [ "$i" = 120 ] && { docker logs "$CONTAINER" >&2; say "FAILED: not SERVING after 60 s"; exit 1; }
    sleep 0.5
done
say "health: $("$PYTHON" -m service.client.health_probe --server "$address")"
budget=$(docker logs "$CONTAINER" 2>&1 | grep -o 'memory budget [^"]*' | head -1 || true)
grep -q 'the cgroup limit' <<<"$budget" ||
    { docker logs "$CONTAINER" >&2; say "FAILED: memory not planned from the container's limit: $budget"; exit 1; }
say "--memory $MEMORY: $budget"
for i in $(seq 90); do
    status=$(docker inspect -f '{{.State.Health.Status}}' "$CONTAINER")
    [ "$status" = healthy ] && break
    [ "$i" = 90 ] && { say "FAILED: Docker HEALTHCHECK still '$status' after 90 s"; exit 1; }
    sleep 1
done
say "docker HEALTHCHECK: $status; user in the container: $(docker exec "$CONTAINER" id -u)"
[ "$(docker exec "$CONTAINER" id -u)" != 0 ] || { say "FAILED: the container runs as root"; exit 1; }
if docker exec "$CONTAINER" python3 -c 'import torch' 2>/dev/null; then say "FAILED: torch is in the image"; exit 1; fi

# ---- 5. generate over gRPC and HTTP from the host ------------------------------------------------
text=$("$PYTHON" -m attnserve generate "ROMEO:" --server "$address" --stream --max-new-tokens 60 \
    --temperature 0.8 --seed 1 --timeout 60)
printf '%s\n' "--- generated over gRPC from the container:" "$text" "---"
[ ${#text} -gt 10 ] || { say "FAILED: no text generated"; exit 1; }
http=http://127.0.0.1:$hport
code=$(curl -s -o /dev/null -w '%{http_code}' "$http/health" || true)
[ "$code" = 200 ] || { say "FAILED: GET /health on :$hport answered $code, not 200"; exit 1; }
body=$(curl -s --max-time 60 -H 'Content-Type: application/json' "$http/v1/completions" \
    -d '{"prompt": "ROMEO:", "max_tokens": 8, "temperature": 0}') ||
    { say "FAILED: POST /v1/completions on :$hport: no answer"; exit 1; }
completion=$(printf '%s' "$body" | "$PYTHON" -c '
import json, sys
body = json.load(sys.stdin)
try:
    text, tokens = body["choices"][0]["text"], body["usage"]["completion_tokens"]
except (KeyError, IndexError, TypeError):
    sys.exit(f"not a completion: {body}")
if not text or tokens != 8:
    sys.exit(f"want choices[0].text non-empty and usage.completion_tokens == 8: {body}")
print(repr(text))') || { say "FAILED: POST /v1/completions on :$hport"; exit 1; }
say "HTTP: /health 200; /v1/completions, 8 tokens: $completion"
# read whole, then search: with pipefail, `grep -q` closing the pipe early would fail curl (SIGPIPE)
metrics=$(curl -sf "http://127.0.0.1:$mport/metrics" || true)
grep -q '^attnserve_generated_tokens_total' <<<"$metrics" || { say "FAILED: no metrics on :$mport"; exit 1; }

# ---- 6. SIGTERM: drain and exit 0 ----------------------------------------------------------------
docker stop --time 30 "$CONTAINER" >/dev/null
code=$(docker inspect -f '{{.State.ExitCode}}' "$CONTAINER")
logs=$(docker logs "$CONTAINER" 2>&1 || true)
grep -q '"message": "stopped"' <<<"$logs" || { printf '%s\n' "$logs" >&2; say "FAILED: no drain"; exit 1; }
[ "$code" = 0 ] || { docker logs "$CONTAINER" >&2; say "FAILED: exit code $code after SIGTERM"; exit 1; }
say "SIGTERM: drained and exited 0"

# ---- 7. size -------------------------------------------------------------------------------------
size=$(docker image inspect -f '{{.Size}}' "$TAG")
say "image size: $(( size / 1000000 )) MB ($size bytes; $VARIANT variant, base $BASE_IMAGE)"
say "PASSED"
