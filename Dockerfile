# One image for every rlt service: `rlt service NAME` picks the role (see compose.yaml).
# TORCH_INDEX picks torch's build: cpu (default), or a CUDA one such as cu128 (compose's
# `gpu` profile builds rlt:cuda with it). No secret is baked in: compose's `init` service
# writes them into a volume at run time.
FROM python:3.11-slim

ARG TORCH_INDEX=cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RLT_CACHE_DIR=/data

WORKDIR /app

# dependencies first (torch from the PyTorch index), so code edits reuse this layer
COPY pyproject.toml README.md* ./
RUN mkdir -p services messages kernels \
    && touch services/__init__.py messages/__init__.py kernels/__init__.py \
    && pip install --extra-index-url https://download.pytorch.org/whl/${TORCH_INDEX} '.[disagg]' \
    && pip uninstall -y rlt

COPY messages ./messages
COPY services ./services
COPY kernels ./kernels
# /data (checkpoints) and /secrets are owned by rlt, so the named volumes compose mounts
# there start out writable by the init services (Docker copies the owner into a new volume)
RUN pip install --no-deps --extra-index-url https://download.pytorch.org/whl/${TORCH_INDEX} . \
    && useradd --create-home --uid 10001 rlt \
    && mkdir -p /data /secrets && chown rlt /data /secrets && chmod 700 /secrets
USER rlt
VOLUME ["/data"]

# no ENTRYPOINT: compose gives each service its full `rlt service NAME ...` command
CMD ["rlt", "up", "--host", "0.0.0.0", "--http-host", "0.0.0.0"]
