# The study on a CUDA GPU: `docker build -t accum-study .` then
# `docker run --rm --gpus all -v "$PWD":/work -u "$(id -u):$(id -g)" accum-study` runs `dvc repro` on this checkout.
FROM nvidia/cuda:13.0.1-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/study \
    PATH=/opt/venv/bin:$PATH

# Python 3.11, as the lock file was resolved with; git for DVC. Versions come from the pinned base image.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv git ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# The same lock file as the venv that `make` builds: torch 2.14.1 with its CUDA 13.0 wheels, timm, dvc, ...
COPY requirements.lock /opt/requirements.lock
RUN python3.11 -m venv /opt/venv \
    && pip install --no-cache-dir -r /opt/requirements.lock

# A non-root user (any -u uid works: its HOME is writable); the mounted checkout belongs to the host user, so git (and DVC) must trust it.
RUN useradd --create-home --uid 1000 study \
    && chmod 1777 /home/study \
    && git config --system --add safe.directory /work \
    && git config --system user.name "accum-study container" \
    && git config --system user.email "study@localhost"
USER 1000:1000
WORKDIR /work

CMD ["dvc", "repro"]
