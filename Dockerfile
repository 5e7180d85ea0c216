# One image for every rlt service: `rlt service NAME` picks the role (see compose.yaml).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RLT_CACHE_DIR=/data

WORKDIR /app

# dependencies first (CPU torch from the PyTorch index), so code edits reuse this layer
COPY pyproject.toml README.md* ./
RUN mkdir -p services messages kernels \
    && touch services/__init__.py messages/__init__.py kernels/__init__.py \
    && pip install --extra-index-url https://download.pytorch.org/whl/cpu . \
    && pip uninstall -y rlt

COPY messages ./messages
COPY services ./services
COPY kernels ./kernels
RUN pip install --no-deps --extra-index-url https://download.pytorch.org/whl/cpu . \
    && useradd --create-home --uid 10001 rlt \
    && mkdir -p /data && chown rlt /data
USER rlt
VOLUME ["/data"]

# no ENTRYPOINT: compose gives each service its full `rlt service NAME ...` command
CMD ["rlt", "up", "--host", "0.0.0.0", "--http-host", "0.0.0.0"]
