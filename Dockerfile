# attnserve: the server (gRPC and an OpenAI-compatible HTTP API) and the shipped model, without torch.
#
#   docker build -t attnserve .                                   # CPU image, python:3.11-slim
#   docker run --rm -p 50051:50051 -p 8000:8000 -p 9464:9464 attnserve
#
#   docker build -t attnserve:gpu --build-arg VARIANT=gpu \
#       --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 .   # GPU image (see docs/deploy.md)
#
# Offline builds: fill wheelhouse/ first (deploy/build-wheelhouse.sh) and nothing is fetched from a
# registry. Any base with Python >= 3.11 (or apt to install it) works: --build-arg BASE_IMAGE=...
ARG BASE_IMAGE=python:3.11-slim

# ---- base: Python, and nothing else ---------------------------------------------------------------
FROM ${BASE_IMAGE} AS base
SHELL ["/bin/sh", "-eu", "-c"]
# CUDA bases ship without Python; python:3.11-slim and Debian bases with python3 skip this.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates && \
        rm -rf /var/lib/apt/lists/*; \
    fi

# ---- build: a virtualenv with attnserve and its serving dependencies ------------------------------
FROM base AS build
ARG VARIANT=cpu
WORKDIR /src
COPY wheelhouse/ /wheelhouse/
COPY pyproject.toml README.md ./
COPY attnserve/ attnserve/
COPY service/ service/
COPY model/ model/
COPY export/ export/
COPY bench/ bench/
# Versions are those of pyproject.toml (registry) or of the wheelhouse (offline). Removed afterwards:
# pip, and the Hugging Face Hub client that tokenizers declares for from_pretrained() downloads, which a
# server that reads only its local bundle never makes (30 MB, and no downloader in the image).
# hadolint ignore=DL3013,DL3042
RUN python3 -m venv /opt/attnserve && \
    if ls /wheelhouse/*.whl >/dev/null 2>&1; then \
        pip_install="/opt/attnserve/bin/pip install --no-cache-dir --no-index --find-links /wheelhouse"; \
        $pip_install attnserve; \
    else \
        pip_install="/opt/attnserve/bin/pip install --no-cache-dir"; \
        $pip_install /src; \
    fi && \
    if [ "$VARIANT" = gpu ]; then \
        /opt/attnserve/bin/pip uninstall -y onnxruntime && $pip_install onnxruntime-gpu; \
    fi && \
    /opt/attnserve/bin/pip uninstall -y pip setuptools \
        huggingface_hub hf_xet fsspec pyyaml httpx2 httpcore2 tqdm filelock truststore

# ---- runtime ------------------------------------------------------------------------------------
FROM base AS runtime
LABEL org.opencontainers.image.title="attnserve" \
      org.opencontainers.image.description="gRPC and OpenAI-compatible HTTP inference server for Transformer language models on ONNX Runtime" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/attnserve /opt/attnserve
COPY models/shakespeare-onnx/ /models/shakespeare-onnx/
# Settings are ATTNSERVE_* variables (attnserve serve --help). Mount your own bundle, for instance at
# /models/custom, and set ATTNSERVE_BUNDLE=/models/custom.
ENV PATH=/opt/attnserve/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    ATTNSERVE_BUNDLE=/models/shakespeare-onnx \
    ATTNSERVE_HOST=0.0.0.0 \
    ATTNSERVE_PORT=50051 \
    ATTNSERVE_HTTP_PORT=8000 \
    ATTNSERVE_METRICS_PORT=9464 \
    ATTNSERVE_LOG_FORMAT=json \
    ATTNSERVE_PROVIDERS=auto \
    ATTNSERVE_CACHE_DIR=/tmp/attnserve-cache
USER 10001:10001
EXPOSE 50051 8000 9464
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 CMD ["attnserve", "health"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["attnserve"]
CMD ["serve"]
