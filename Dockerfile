# The study in a container, on a CUDA GPU or the CPU (README: "In a container"):
#   docker build -t accum-study .
#   docker run --rm --gpus all -v "$PWD":/work -u "$(id -u):$(id -g)" accum-study
# Plain Debian, not a CUDA base: the torch wheels carry their own CUDA libraries (the nvidia-* wheels), so a
# CUDA runtime base would be a second copy torch never loads; the NVIDIA container toolkit mounts the driver
# and nvidia-smi from the host under --gpus. BASE is a build argument so that a machine with no registry can
# build on a local copy of the same distribution (scripts/container_check.sh).
ARG BASE=debian:bookworm-slim
FROM ${BASE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/study \
    PATH=/opt/venv/bin:$PATH \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# Python 3.11, as the lock file was resolved with; git for DVC; tini forwards signals to the whole process group.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv git ca-certificates tini \
    && rm -rf /var/lib/apt/lists/*

# The same lock file as the venv that `make` builds: torch 2.14.1 with its CUDA 13.0 wheels, timm, dvc, ...
# Behind a TLS proxy, --build-arg PIP_CERT=/etc/ssl/certs/ca-certificates.crt makes pip trust the system's CAs.
ARG PIP_CERT
COPY requirements.lock /opt/requirements.lock
RUN python3.11 -m venv /opt/venv \
    && pip install --no-cache-dir -r /opt/requirements.lock

# A non-root user (any -u uid works: its HOME is writable); the mounted checkout belongs to the host user, so git (and DVC) must trust it.
RUN useradd --create-home --uid 1000 study \
    && chmod 1777 /home/study \
    && git config --system --add safe.directory /work \
    && git config --system user.name "accum-study container" \
    && git config --system user.email "study@localhost"
COPY scripts/container_entrypoint.sh /usr/local/bin/study-entrypoint
USER 1000:1000
WORKDIR /work

ENTRYPOINT ["tini", "-g", "--", "study-entrypoint"]
CMD ["dvc", "repro"]
