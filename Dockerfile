# Switchyard platform image: web (uvicorn), Celery worker and beat, migrations, serving agent.
# Used by deploy/ as ghcr.io/switchyard/switchyard:TAG. Build: docker build -t IMAGE .
# The CPU torch wheel keeps the image small; GPU agents need an image with the CUDA libraries
# onnxruntime-gpu loads (e.g. built FROM an nvidia/cuda runtime base).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app \
    SWITCHYARD_VAR_DIR=/app/var

WORKDIR /app

# torch first, pinned to the CPU wheel (as the Makefile does), so `torch>=2.6` is satisfied.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY . /app
# Dependencies from pyproject.toml; the code runs from /app (settings.py finds templates/ and
# static/ next to platform_site/).
RUN pip install . \
    && groupadd --gid 10001 switchyard \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /app --shell /usr/sbin/nologin switchyard \
    && mkdir -p /app/var \
    && chown -R 10001:10001 /app/var

USER 10001:10001
# 8000: HTTP (UI, API, OIP v2 REST, agents); 8001: OIP v2 over gRPC (SWITCHYARD_GRPC_PORT)
EXPOSE 8000 8001

CMD ["uvicorn", "platform_site.asgi:application", "--host", "0.0.0.0", "--port", "8000", "--no-access-log", "--http", "gateway.http_bounds:BoundedHttpProtocol"]
