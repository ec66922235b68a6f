# syntax=docker/dockerfile:1
# The expertmesh image: one image for every pod (operator, router, attention and expert workers).
#
#   docker build -t ghcr.io/expertmesh/expertmesh:0.1.0 .
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:<torch>-cuda<x.y>-cudnn9-runtime ...
#
# The base image brings a CUDA build of PyTorch (and Triton); `pip install .` keeps it, since the
# project accepts torch>=2.4, and adds the rest of the dependencies.
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.9-cudnn9-runtime
FROM ${BASE_IMAGE}

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="expertmesh" \
      org.opencontainers.image.description="Serve a 2.8T-parameter MXFP4 Mixture-of-Experts model (KDA + DSA attention) on Kubernetes: operator, router and workers" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# Only what the package build needs (see .dockerignore): sources change more often than dependencies do.
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY expertmesh/ expertmesh/
COPY kernels/ kernels/
COPY operator/ operator/
COPY router/ router/
COPY worker/ worker/
COPY protos/ protos/
# libibverbs1: what Mooncake's transfer engine loads (the cluster KV tier, `spec.kv.store: mooncake`; TCP without
# RDMA hardware, RDMA where the node has it)
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir '.[gpu,kvstore]' \
    && cd / && rm -rf /src \
    && expertmesh --help >/dev/null

# The tiny synthetic checkpoint (seeded, ~0.5 MB): what the chart's example MoEDeployment loads
# (checkpoint uri /opt/expertmesh/checkpoints/tiny), so trying the operator needs no volume.
RUN expertmesh checkpoint create --preset tiny --seed 0 --out /opt/expertmesh/checkpoints/tiny

# Non-root, numeric (so Kubernetes' runAsNonRoot can verify it); HOME on /tmp, the one writable path
# under a read-only root filesystem (the chart mounts an emptyDir there).
RUN groupadd --system --gid 10001 expertmesh \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
               --shell /usr/sbin/nologin expertmesh
ENV HOME=/tmp
USER 10001:10001
WORKDIR /tmp

ENTRYPOINT ["expertmesh"]
CMD ["--help"]
