# Switchyard platform image: web (uvicorn), Celery worker and beat, migrations.
# Used by deploy/ as ghcr.io/switchyard/switchyard:TAG. Build: docker build -t IMAGE .
# Layered so a code change does not reinstall dependencies: the dependencies are installed into a
# virtualenv from pyproject.toml alone, the code is copied last. Agents on nodes use the lighter
# agent images (agent/Dockerfile, agent/Dockerfile.cuda; docs/agent.md).
FROM python:3.11-slim AS deps
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, pinned to the CPU wheel (as the Makefile does), so `torch>=2.6` is satisfied.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml constraints.txt /src/
# The roles this image serves (pyproject.toml's extras; the default is every role but dev):
# build with --build-arg EXTRAS="s3 kubernetes" for a platform without agents, MLflow or SSO.
ARG EXTRAS="agent mlflow s3 sso kubernetes"
# The [project] dependencies and those extras', read from pyproject.toml, at the versions of
# constraints.txt (`make lock`): this layer changes when they do.
RUN python -c "import sys, tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + [d for e in sys.argv[1:] for d in p['optional-dependencies'][e]]))" $EXTRAS > /src/requirements.txt \
    && pip install -c /src/constraints.txt -r /src/requirements.txt

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app \
    SWITCHYARD_VAR_DIR=/app/var
WORKDIR /app
RUN groupadd --gid 10001 switchyard \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /app --shell /usr/sbin/nologin switchyard \
    && mkdir -p /app/var \
    && chown 10001:10001 /app/var
COPY --from=deps /opt/venv /opt/venv
# The code runs from /app (settings.py finds templates/ and static/ next to platform_site/).
COPY . /app

USER 10001:10001
# 8000: HTTP (UI, API, OIP v2 REST, agents); 8001: OIP v2 over gRPC (SWITCHYARD_GRPC_PORT)
EXPOSE 8000 8001

CMD ["python", "-m", "platform_site.serve", "platform_site.asgi:application", "--host", "0.0.0.0", "--port", "8000", "--no-access-log", "--http", "gateway.http_bounds:BoundedHttpProtocol"]
