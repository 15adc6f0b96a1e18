"""Switchyard settings: every value comes from the environment, with embedded defaults.

Unset, the platform runs on one box with nothing to install: SQLite, an in-process channel
layer, an in-process rate limiter and a file-based Celery broker under ``var/``. Set
``DATABASE_URL`` and ``REDIS_URL`` for PostgreSQL and Redis. A secret may come from
``NAME_FILE`` instead of ``NAME``.

One convention: each of Switchyard's own settings is a Django setting named exactly like the
environment variable it comes from (``settings.SWITCHYARD_INFER_TIMEOUT_S`` is
``$SWITCHYARD_INFER_TIMEOUT_S``), read by a typed helper that refuses a value it cannot parse.
"""

import os
import sys
from collections.abc import Callable
from datetime import timedelta
from importlib.util import find_spec
from pathlib import Path
from typing import Any, TypeVar

import dj_database_url
import django_stubs_ext
from django.core.exceptions import ImproperlyConfigured

from platform_site.secret_files import install_secret, private_file

# Generic Django classes (ModelAdmin[Tenant], QuerySet[Model]) subscriptable at run time, as the
# type checker reads them.
django_stubs_ext.monkeypatch()

BASE_DIR = Path(__file__).resolve().parent.parent


def env(name: str, default: str = "") -> str:
    """The variable's value, or the content of the file named by NAME_FILE, or the default."""
    if name in os.environ:
        return os.environ[name]
    path = os.environ.get(f"{name}_FILE")
    if path:
        return Path(path).read_text().strip()
    return default


TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_bool(name: str, default: bool) -> bool:
    """1/true/yes/on or 0/false/no/off (any case), the default when unset or empty; anything
    else stops the start-up."""
    value = env(name, "").strip().lower()
    if value == "":
        return default
    if value not in TRUE + FALSE:
        raise ImproperlyConfigured(f"{name}={value!r}: use one of {', '.join(TRUE + FALSE)}")
    return value in TRUE


def env_int(name: str, default: int) -> int:
    return _parsed(name, default, int)


def env_float(name: str, default: float) -> float:
    return _parsed(name, default, float)


_Number = TypeVar("_Number", int, float)


def _parsed(name: str, default: _Number, kind: Callable[[str], _Number]) -> _Number:
    value = env(name, "")
    if value.strip() == "":
        return default
    try:
        return kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ImproperlyConfigured(f"{name}={value!r} is not {what}") from None


def package_dir(name: str) -> Path:
    """The folder of an installed package (some serve their files as static files)."""
    spec = find_spec(name)
    if spec is None or spec.origin is None:
        raise ImproperlyConfigured(f"the package {name!r} is not installed")
    return Path(spec.origin).parent


SWITCHYARD_VAR_DIR = Path(env("SWITCHYARD_VAR_DIR", str(BASE_DIR / "var")))
SWITCHYARD_VAR_DIR.mkdir(parents=True, exist_ok=True)

# Never a default from the source (that one is public): unset, each install generates its own
# on first start (var/secret_key, 0600), shared by every process that shares var/.
SECRET_KEY = env("SECRET_KEY") or install_secret(SWITCHYARD_VAR_DIR / "secret_key", 50)
DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = [h.strip() for h in env("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]").split(",")]
CSRF_TRUSTED_ORIGINS = [o for o in env("CSRF_TRUSTED_ORIGINS", "").split(",") if o]

INSTALLED_APPS = [
    # daphne's app only gives `runserver` an ASGI server; loading it imports Twisted and installs
    # its reactor (~0.2 s in every process: uvicorn workers, Celery, manage.py), so only there.
    *(["daphne"] if sys.argv[1:2] == ["runserver"] else []),
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI assets served locally: no CDN on closed networks
    "channels",
    "django_celery_beat",
    "axes",  # login throttling (see "Auth and i18n")
    "tenants",
    "registry",
    "monitoring",
    "rollouts",
    "fleet",
    "gateway",
    "batch",
    "web",
    "platform_site",
]

MIDDLEWARE = [
    # First: a view that needs the database while it is unreachable answers 503 + Retry-After.
    "platform_site.db_outage.DatabaseOutageMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Idempotency-Key on the API's state-changing calls (needs the signed-in user).
    "tenants.middleware.IdempotencyMiddleware",
    "axes.middleware.AxesMiddleware",  # last, as django-axes asks: answers a locked-out login
]

ROOT_URLCONF = "platform_site.urls"
ASGI_APPLICATION = "platform_site.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# Database ----------------------------------------------------------------------------------
DATABASES = {
    "default": dj_database_url.parse(
        env("DATABASE_URL", f"sqlite:///{SWITCHYARD_VAR_DIR / 'switchyard.sqlite3'}"),
        conn_max_age=60,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # WAL and IMMEDIATE transactions let the web server, Celery and beat share one file
    # without "database is locked" errors.
    DATABASES["default"]["OPTIONS"] = {
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        "transaction_mode": "IMMEDIATE",
        "timeout": 20,
    }
    # Connections are kept (CONN_MAX_AGE from above), as on PostgreSQL: a new one per query
    # (connect plus the PRAGMAs) was a third of the web process's CPU at rest, every refresh
    # of the gateway opening one (bench/idle_bench.py).
    # The file holds password hashes, sessions and tokens: 0600 before SQLite first opens it
    # (its -wal and -shm files take the database file's mode).
    private_file(Path(DATABASES["default"]["NAME"]))
    DATABASES["default"].setdefault("TEST", {})["NAME"] = str(SWITCHYARD_VAR_DIR / "test.sqlite3")
# A connect to PostgreSQL gives up after this many seconds (libpq's minimum is 2; a
# ``connect_timeout`` in DATABASE_URL wins). After a failed connect a process stops connecting
# for SWITCHYARD_DB_RETRY_S (every request answers 503 with Retry-After at once), then one
# connect probes: no shorter than the connect timeout, so a probe that stalls is not joined by
# a second one (platform_site/postgres).
SWITCHYARD_DB_CONNECT_TIMEOUT_S = env_int("SWITCHYARD_DB_CONNECT_TIMEOUT_S", 3)
SWITCHYARD_DB_RETRY_S = env_float("SWITCHYARD_DB_RETRY_S", 3)
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    DATABASES["default"]["ENGINE"] = "platform_site.postgres"
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault(
        "connect_timeout", SWITCHYARD_DB_CONNECT_TIMEOUT_S
    )
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Redis: channel layer, shared rate-limit store and Celery broker ---------------------------
REDIS_URL = env("REDIS_URL", "")

if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            # channels_redis's layer, except that a receive waits out a Redis outage.
            "BACKEND": "gateway.channel_layer.FailSoftRedisChannelLayer",
            # socket_timeout None: redis-py's 5 s read timeout would otherwise kill an idle
            # consumer blocked in BZPOPMIN (channels-redis 4.3 + redis-py 8).
            "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": None}]},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# Celery (django-celery-beat keeps the schedules in the database) ----------------------------
CELERY_BROKER_URL = env("CELERY_BROKER_URL", REDIS_URL or "filesystem://")
if CELERY_BROKER_URL == "filesystem://":
    _broker_dir = SWITCHYARD_VAR_DIR / "celery-broker"
    for sub in ("queue", "processed", "control"):
        (_broker_dir / sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir / "queue"),
        "data_folder_out": str(_broker_dir / "queue"),
        "processed_folder": str(_broker_dir / "processed"),
        "control_folder": str(_broker_dir / "control"),
        "store_processed": False,
    }
CELERY_TASK_IGNORE_RESULT = True
# django-celery-beat's DatabaseScheduler, refreshing the heartbeat file on every tick.
CELERY_BEAT_SCHEDULER = "platform_site.beat:AliveScheduler"
# A worker, beat or agent refreshes this file every few seconds while it works (its Kubernetes
# probes read it: platform_site/alive.py); empty: no heartbeat file.
SWITCHYARD_ALIVE_FILE = env("SWITCHYARD_ALIVE_FILE", "")
CELERY_TIMEZONE = "UTC"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# How often the control loops run (seconds).
SWITCHYARD_GUARDRAIL_INTERVAL_S = env_float("SWITCHYARD_GUARDRAIL_INTERVAL_S", 5)
SWITCHYARD_AUTOSCALE_INTERVAL_S = env_float("SWITCHYARD_AUTOSCALE_INTERVAL_S", 5)
SWITCHYARD_DRIFT_INTERVAL_S = env_float("SWITCHYARD_DRIFT_INTERVAL_S", 60)
SWITCHYARD_SLO_INTERVAL_S = env_float("SWITCHYARD_SLO_INTERVAL_S", 60)
SWITCHYARD_RETENTION_INTERVAL_S = env_float("SWITCHYARD_RETENTION_INTERVAL_S", 3600)
# Declared here, copied into the database by django-celery-beat, editable in the admin.
CELERY_BEAT_SCHEDULE = {
    "mark-stale-agents-offline": {
        "task": "fleet.tasks.mark_stale_agents_offline",
        "schedule": 15.0,
    },
    "evaluate-rollouts": {
        "task": "rollouts.tasks.evaluate_rollouts",
        "schedule": SWITCHYARD_GUARDRAIL_INTERVAL_S,
    },
    "autoscale": {
        "task": "fleet.tasks.autoscale",
        "schedule": SWITCHYARD_AUTOSCALE_INTERVAL_S,
    },
    "detect-drift": {
        "task": "monitoring.tasks.detect_drift",
        "schedule": SWITCHYARD_DRIFT_INTERVAL_S,
    },
    "evaluate-slos": {
        "task": "monitoring.tasks.evaluate_slos",
        "schedule": SWITCHYARD_SLO_INTERVAL_S,
    },
    "purge-drift-reports": {
        "task": "monitoring.tasks.purge_drift_reports",
        "schedule": SWITCHYARD_RETENTION_INTERVAL_S,
    },
    "purge-prediction-logs": {
        "task": "monitoring.tasks.purge_prediction_logs",
        "schedule": SWITCHYARD_RETENTION_INTERVAL_S,
    },
    "compact-prediction-logs": {
        "task": "monitoring.tasks.compact_prediction_logs",
        "schedule": SWITCHYARD_RETENTION_INTERVAL_S,
    },
    "purge-idempotency-records": {
        "task": "tenants.tasks.purge_idempotency_records",
        "schedule": SWITCHYARD_RETENTION_INTERVAL_S,
    },
}

# Auth and i18n -----------------------------------------------------------------------------
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
# Login throttling (django-axes, on the web UI's and the admin's sign-in): after
# SWITCHYARD_LOGIN_FAILURES failed attempts for one username, from any address, that username is
# locked out for SWITCHYARD_LOGIN_LOCKOUT_MINUTES (429), and the lockout is audited. Keyed on the
# username, not on the address: the address is what the server was told, and a client that sends
# a new X-Forwarded-For on each attempt (through a proxy the server trusts) would never be locked.
# The price: anyone can lock a username out for the cool-off; `manage.py axes_reset_username`
# lifts it. The server believes X-Forwarded-For only from the proxies it is given
# (uvicorn's --forwarded-allow-ips; never "*" in deploy/ or the Helm chart).
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
# Single sign-on -------------------------------------------------------------------------------
# OpenID Connect for the web UI (docs/sso.md), on only when an issuer (or the explicit endpoints)
# and a client id/secret are set; Django passwords stay the default either way.
SWITCHYARD_OIDC_ISSUER = env("SWITCHYARD_OIDC_ISSUER").rstrip("/")
OIDC_RP_CLIENT_ID = env("SWITCHYARD_OIDC_CLIENT_ID")
OIDC_RP_CLIENT_SECRET = env("SWITCHYARD_OIDC_CLIENT_SECRET")
OIDC_OP_AUTHORIZATION_ENDPOINT = env("SWITCHYARD_OIDC_AUTHORIZATION_ENDPOINT")
OIDC_OP_TOKEN_ENDPOINT = env("SWITCHYARD_OIDC_TOKEN_ENDPOINT")
OIDC_OP_USER_ENDPOINT = env("SWITCHYARD_OIDC_USERINFO_ENDPOINT")
OIDC_OP_JWKS_ENDPOINT = env("SWITCHYARD_OIDC_JWKS_ENDPOINT")
OIDC_RP_SIGN_ALGO = "RS256"
OIDC_TIMEOUT = 10  # seconds for each call to the provider (token, userinfo, JWKS)
# A provider whose tokens name no key id (one signing key) needs this off.
OIDC_VERIFY_KID = env_bool("SWITCHYARD_OIDC_VERIFY_KID", True)
OIDC_RP_SCOPES = "openid email profile groups"
SWITCHYARD_OIDC_GROUPS_CLAIM = env("SWITCHYARD_OIDC_GROUPS_CLAIM", "groups")
SWITCHYARD_OIDC_ROLE_MAP = env("SWITCHYARD_OIDC_ROLE_MAP", "{}")
if SWITCHYARD_OIDC_ISSUER and OIDC_RP_CLIENT_ID and not OIDC_OP_AUTHORIZATION_ENDPOINT:
    import httpx  # discovery at startup, bounded: a provider that does not answer fails loudly

    _discovered = httpx.get(
        f"{SWITCHYARD_OIDC_ISSUER}/.well-known/openid-configuration", timeout=5
    ).json()
    OIDC_OP_AUTHORIZATION_ENDPOINT = _discovered["authorization_endpoint"]
    OIDC_OP_TOKEN_ENDPOINT = _discovered["token_endpoint"]
    OIDC_OP_USER_ENDPOINT = _discovered["userinfo_endpoint"]
    OIDC_OP_JWKS_ENDPOINT = _discovered["jwks_uri"]
SSO_ENABLED = bool(
    OIDC_RP_CLIENT_ID
    and OIDC_RP_CLIENT_SECRET
    and OIDC_OP_AUTHORIZATION_ENDPOINT
    and OIDC_OP_TOKEN_ENDPOINT
    and OIDC_OP_JWKS_ENDPOINT
)
if SSO_ENABLED:
    INSTALLED_APPS.append("mozilla_django_oidc")
    AUTHENTICATION_BACKENDS.append("tenants.sso.SwitchyardOIDCBackend")
AXES_FAILURE_LIMIT = env_int("SWITCHYARD_LOGIN_FAILURES", 5)
AXES_COOLOFF_TIME = timedelta(minutes=env_float("SWITCHYARD_LOGIN_LOCKOUT_MINUTES", 15))
AXES_LOCKOUT_PARAMETERS = ["username"]
# axes.W006 asks for the address among the lockout keys. Not here: an address lock is what a
# forged X-Forwarded-For dodges, and behind an ingress that is not named a trusted proxy every
# client has the ingress's address, so five wrong passwords from anyone would lock out everyone.
SILENCED_SYSTEM_CHECKS = ["axes.W006"]
AXES_RESET_ON_SUCCESS = True
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# HTTPS, for `check --deploy` (README, "Production settings"). Off by default: the
# embedded default serves plain HTTP on loopback, and a TLS proxy in front sets X-Forwarded-Proto,
# which uvicorn --proxy-headers turns into the request's scheme.
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", False)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", False)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", False)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)

STATIC_URL = "static/"
STATIC_ROOT = SWITCHYARD_VAR_DIR / "static"
STATIC_ROOT.mkdir(exist_ok=True)
# The web UI's CSS/JS, and Plotly's bundle from the installed package: no CDN on closed networks.
STATICFILES_DIRS = [
    BASE_DIR / "static",
    ("vendor", package_dir("plotly") / "package_data"),
]
MEDIA_ROOT = Path(env("SWITCHYARD_MEDIA_ROOT", str(SWITCHYARD_VAR_DIR / "media")))
MEDIA_URL = "media/"

# --- Artifact storage -------------------------------------------------------------------------
# Local disk (MEDIA_ROOT) is the embedded default. SWITCHYARD_STORAGE=s3 puts artifacts in an
# S3-compatible bucket through django-storages; credentials come from the usual AWS environment
# (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, or the instance's role), never from this file.
# GCS/Azure follow the same pattern: "storages.backends.gcloud.GoogleCloudStorage" or
# "storages.backends.azure_storage.AzureStorage" with their own OPTIONS (docs/storage.md).
SWITCHYARD_STORAGE = env("SWITCHYARD_STORAGE", "local")
if SWITCHYARD_STORAGE not in ("local", "s3"):
    raise ImproperlyConfigured(f"SWITCHYARD_STORAGE={SWITCHYARD_STORAGE!r}: use local or s3")
_DEFAULT_STORAGE: dict[str, Any] = {"BACKEND": "django.core.files.storage.FileSystemStorage"}
if SWITCHYARD_STORAGE == "s3":
    _DEFAULT_STORAGE = {
        "BACKEND": "storages.backends.s3.S3Storage",
        "OPTIONS": {
            "bucket_name": env("SWITCHYARD_S3_BUCKET", ""),
            "endpoint_url": env("SWITCHYARD_S3_ENDPOINT_URL", "") or None,
            "region_name": env("SWITCHYARD_S3_REGION", "") or None,
            # Private objects; agents get short presigned GET URLs straight to the bucket.
            "default_acl": None,
            "querystring_auth": True,
            "querystring_expire": env_int("SWITCHYARD_S3_URL_EXPIRY_S", 3600),
            # SigV4: what every region and MinIO accept (boto3 may otherwise presign with v2).
            "signature_version": "s3v4",
            "file_overwrite": False,
        },
    }
    if not _DEFAULT_STORAGE["OPTIONS"]["bucket_name"]:
        raise ImproperlyConfigured("SWITCHYARD_STORAGE=s3 needs SWITCHYARD_S3_BUCKET")
STORAGES = {
    "default": _DEFAULT_STORAGE,
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}
# Registration by reference (registry.artifact_refs): a version's artifact read from where it
# already lies instead of uploaded. s3:// keys must be in the configured bucket under this
# prefix ("{tenant}" is the tenant's slug, so one tenant cannot register another's objects);
# local paths must lie under one of these directories (comma-separated; empty: refused).
SWITCHYARD_S3_IMPORT_PREFIX = env("SWITCHYARD_S3_IMPORT_PREFIX", "imports/{tenant}/")
SWITCHYARD_ARTIFACT_IMPORT_DIRS = [
    d.strip() for d in env("SWITCHYARD_ARTIFACT_IMPORT_DIRS", "").split(",") if d.strip()
]
# MLflow import (registry.mlflow_import): the tracking server versions come from, and the other
# hosts ("host" or "host:port", comma-separated) a request may name in its tracking_uri. The
# platform connects to the host a request names, so a tenant may not name just any (internal
# services, a cloud's metadata endpoint).
SWITCHYARD_MLFLOW_TRACKING_URI = env("SWITCHYARD_MLFLOW_TRACKING_URI", "")
SWITCHYARD_MLFLOW_ALLOWED_HOSTS = [
    h.strip().lower() for h in env("SWITCHYARD_MLFLOW_ALLOWED_HOSTS", "").split(",") if h.strip()
]
# ----------------------------------------------------------------------------------------------
# Uploads above this are spooled to disk by Django, then hashed, checked and moved into
# storage from there (registry.services.create_version): never held in memory whole.
FILE_UPLOAD_MAX_MEMORY_SIZE = 8 * 1024 * 1024
# Largest model artifact (upload: 413 past it), and largest request body of any kind, checked
# as it arrives (gateway/http_bounds.py): an artifact plus its form fields.
SWITCHYARD_MAX_ARTIFACT_BYTES = env_int("SWITCHYARD_MAX_ARTIFACT_BYTES", 2 * 1024 * 1024 * 1024)
SWITCHYARD_MAX_UPLOAD_BYTES = SWITCHYARD_MAX_ARTIFACT_BYTES + 1024 * 1024
# Largest request body (inference and API); larger ones get 413.
SWITCHYARD_MAX_BODY_BYTES = env_int("SWITCHYARD_MAX_BODY_BYTES", 16 * 1024 * 1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = SWITCHYARD_MAX_BODY_BYTES
# BYTES tensors (text, labels): the largest element, and the most bytes one input may hold in
# all; past them a request gets 400 naming the input (gateway/bytes_tensors.py).
SWITCHYARD_MAX_BYTES_ELEMENT = env_int("SWITCHYARD_MAX_BYTES_ELEMENT", 64 * 1024)
SWITCHYARD_MAX_BYTES_TENSOR = env_int("SWITCHYARD_MAX_BYTES_TENSOR", 4 * 1024 * 1024)
# Half-sent requests (gateway/http_bounds.py): the request line and headers must arrive
# within this long of the connection (or the request) starting, and a body may pause at most
# this long between two pieces; past either, 408 and the connection is closed. Headers larger
# than this get 431.
SWITCHYARD_HEADER_TIMEOUT_S = env_float("SWITCHYARD_HEADER_TIMEOUT_S", 10)
# At shutdown (SIGTERM) an idle keep-alive connection stays open this long, so a request its
# client sent at that instant is answered instead of lost (gateway/drain.py).
SWITCHYARD_DRAIN_IDLE_S = env_float("SWITCHYARD_DRAIN_IDLE_S", 1.0)
SWITCHYARD_MAX_HEADER_BYTES = env_int("SWITCHYARD_MAX_HEADER_BYTES", 64 * 1024)
SWITCHYARD_BODY_TIMEOUT_S = env_float("SWITCHYARD_BODY_TIMEOUT_S", 30)
# A whole body must arrive within this long of its first read, plus a second for every
# SWITCHYARD_BODY_MIN_RATE bytes received (bytes per second; 0: no allowance), else 408: a
# body trickled in a byte at a time is cut off, an upload at least that fast is not.
SWITCHYARD_BODY_DEADLINE_S = env_float("SWITCHYARD_BODY_DEADLINE_S", 30)
SWITCHYARD_BODY_MIN_RATE = env_int("SWITCHYARD_BODY_MIN_RATE", 64 * 1024)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "tenants.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    # JSON through orjson (a body nested too deep is a 400, where DRF's parser raised a 500).
    "DEFAULT_PARSER_CLASSES": [
        "platform_site.parsers.JSONBodyParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_SCHEMA_CLASS": "platform_site.api.ApiSchema",
    "EXCEPTION_HANDLER": "platform_site.errors.api_exception_handler",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Switchyard API",
    "DESCRIPTION": "Control plane and prediction API of the Switchyard inference platform.",
    "VERSION": "0.1.0",
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",  # the default
        "tenants.schema.document_idempotency_key",
    ],
    # Two choice sets are both called "format" (a version's artifact, a batch job's input).
    "ENUM_NAME_OVERRIDES": {
        "ArtifactFormatEnum": "registry.models.ArtifactFormat",
        "InputFormatEnum": "batch.models.InputFormat",
        "AgentKindEnum": "fleet.api.serializers.AGENT_KINDS",
    },
}

# Data path ---------------------------------------------------------------------------------
# How long the first answer to a call with an Idempotency-Key is kept for its retries (the API
# in the database, inference in Redis or in process).
SWITCHYARD_IDEMPOTENCY_RETENTION_S = env_float("SWITCHYARD_IDEMPOTENCY_RETENTION_S", 24 * 3600)
# Inference answers kept in process for Idempotency-Key retries without Redis (per process).
SWITCHYARD_IDEMPOTENCY_CACHE_BYTES = env_int("SWITCHYARD_IDEMPOTENCY_CACHE_BYTES", 64 * 1024 * 1024)
# The largest answer body kept for Idempotency-Key retries. A larger one is sent once with
# Idempotency-Stored: false: on inference its key is freed (a retry computes again); on the API
# the call acted, so a retry gets its status and Location without the body (docs/operations.md).
SWITCHYARD_IDEMPOTENCY_MAX_ANSWER_BYTES = env_int(
    "SWITCHYARD_IDEMPOTENCY_MAX_ANSWER_BYTES", 1024 * 1024
)
# One tenant's kept inference answers together, in Redis (shared by every gateway process) and
# in each process's own cache: past it the tenant's new answers are not kept (Idempotency-Stored:
# false) and other tenants' still are. Redis's maxmemory (deploy/redis.conf) should hold
# tenants x this, besides the queue and the channel layer.
SWITCHYARD_IDEMPOTENCY_TENANT_BYTES = env_int(
    "SWITCHYARD_IDEMPOTENCY_TENANT_BYTES", 16 * 1024 * 1024
)
# Deadline for one inference through an agent; past it the client gets 504.
SWITCHYARD_INFER_TIMEOUT_S = env_float("SWITCHYARD_INFER_TIMEOUT_S", 10)
# Circuit breakers (per agent link and per version): this many consecutive failures open one,
# and for this long nothing is sent there; then one probe request decides (see gateway.breakers).
SWITCHYARD_BREAKER_FAILURES = env_int("SWITCHYARD_BREAKER_FAILURES", 5)
SWITCHYARD_BREAKER_COOLDOWN_S = env_float("SWITCHYARD_BREAKER_COOLDOWN_S", 5)
# An open generation stream (websocket or OpenAI server-sent events) re-checks its API key
# this often: a revoked or expired key's streams stop. (SWITCHYARD_WS_KEY_RECHECK_S, its name
# while only websockets re-checked, is still read.)
SWITCHYARD_STREAM_KEY_RECHECK_S = env_float(
    "SWITCHYARD_STREAM_KEY_RECHECK_S", env_float("SWITCHYARD_WS_KEY_RECHECK_S", 2)
)
# How often each gateway process checks whether keys, routes or agents changed.
SWITCHYARD_REFRESH_INTERVAL_S = env_float("SWITCHYARD_REFRESH_INTERVAL_S", 0.5)
# Rate-limit tokens a gateway process leases from Redis at once (as a share of burst).
SWITCHYARD_RATE_LEASE_FRACTION = env_float("SWITCHYARD_RATE_LEASE_FRACTION", 0.1)
# After an alias moves away from a version, agents keep that version (the last-known-good)
# loaded this long, so a rollback to it needs no cold load; Model.rollback_warm_s overrides it.
SWITCHYARD_ROLLBACK_WARM_S = env_int("SWITCHYARD_ROLLBACK_WARM_S", 3600)
# Agents silent for longer are treated as gone.
SWITCHYARD_AGENT_STALE_S = env_float("SWITCHYARD_AGENT_STALE_S", 30)
SWITCHYARD_AGENT_HEARTBEAT_S = env_float("SWITCHYARD_AGENT_HEARTBEAT_S", 5)
# Several gateway processes (with Redis): each listens on an address of its own for agents'
# data links, so every process reaches every agent in process. LINK_PORT 0 takes a free port
# (several processes on one machine); ADVERTISE is the host agents dial (a pod's IP).
SWITCHYARD_AGENT_LINKS = env_bool("SWITCHYARD_AGENT_LINKS", bool(REDIS_URL))
SWITCHYARD_LINK_HOST = env("SWITCHYARD_LINK_HOST", "127.0.0.1")
SWITCHYARD_LINK_PORT = env_int("SWITCHYARD_LINK_PORT", 0)
SWITCHYARD_LINK_ADVERTISE = env("SWITCHYARD_LINK_ADVERTISE", "")
# The Open Inference Protocol v2 over gRPC (tritonclient.grpc, KServe's gRPC clients): each
# server process serves it on this port too (0: off); several processes share it (SO_REUSEPORT).
SWITCHYARD_GRPC_PORT = env_int("SWITCHYARD_GRPC_PORT", 8001)
SWITCHYARD_GRPC_HOST = env("SWITCHYARD_GRPC_HOST", "0.0.0.0")
# The gateway's database calls run on this many threads (each its own connection; 0: Channels'
# one shared thread), and on PostgreSQL they give up waiting for a lock, or running, after
# these many milliseconds: a locked control-plane table then costs only the requests that
# truly need the database (they answer 503), not every request behind them.
SWITCHYARD_DB_THREADS = env_int("SWITCHYARD_DB_THREADS", 8)
SWITCHYARD_DB_LOCK_TIMEOUT_MS = env_int("SWITCHYARD_DB_LOCK_TIMEOUT_MS", 2000)
SWITCHYARD_DB_STATEMENT_TIMEOUT_MS = env_int("SWITCHYARD_DB_STATEMENT_TIMEOUT_MS", 5000)
# A request for an autoscaled version with no ready replica wakes its deployment and waits this
# long for a replica to start and load; past it the client gets 503 + Retry-After.
SWITCHYARD_COLD_START_HOLD_S = env_float("SWITCHYARD_COLD_START_HOLD_S", 30)
# Prediction log: sampled records wait in a bounded buffer per process (past it they are dropped
# and counted) and are written in batches by a background thread.
# Each flush writes one Parquet file per tenant, model and hour (monitoring.logstore): every
# FLUSH_S seconds, or sooner once BATCH requests wait. A storage that stalls keeps them buffered.
SWITCHYARD_PREDLOG_BUFFER = env_int("SWITCHYARD_PREDLOG_BUFFER", 50_000)
SWITCHYARD_PREDLOG_BATCH = env_int("SWITCHYARD_PREDLOG_BATCH", 5_000)
SWITCHYARD_PREDLOG_FLUSH_S = env_float("SWITCHYARD_PREDLOG_FLUSH_S", 2)
# Where the log datasets live: a directory with local storage (default MEDIA_ROOT/logs), the key
# prefix in SWITCHYARD_S3_BUCKET with SWITCHYARD_STORAGE=s3 (default "logs"). An S3 connection
# not made this long fails, as does a read on Windows and macOS (Linux: the AWS SDK's ~3 s); the
# writer then retries its batch.
SWITCHYARD_LOG_ROOT = env("SWITCHYARD_LOG_ROOT", "")
SWITCHYARD_LOG_S3_TIMEOUT_S = env_float("SWITCHYARD_LOG_S3_TIMEOUT_S", 3)
# Off turns the prediction log off in this process whatever the models' sampling (shedding load
# off a struggling database; the benchmark's baseline).
SWITCHYARD_PREDICTION_LOG = env_bool("SWITCHYARD_PREDICTION_LOG", True)
# Per-request Prometheus metrics on the data path (off: the benchmark's baseline; /metrics still
# serves the fleet's).
SWITCHYARD_REQUEST_METRICS = env_bool("SWITCHYARD_REQUEST_METRICS", True)
# Stage times (switchyard_stage_duration_seconds) from one prediction in this many.
SWITCHYARD_STAGE_SAMPLE = max(1, env_int("SWITCHYARD_STAGE_SAMPLE", 10))
# GET /metrics needs this bearer token (metrics name tenants and models); unset, each install
# generates one (var/metrics-token, 0600). SWITCHYARD_METRICS_PUBLIC=on drops the check, only for
# a server whose port nothing outside can reach.
SWITCHYARD_METRICS_PUBLIC = env_bool("SWITCHYARD_METRICS_PUBLIC", False)
SWITCHYARD_METRICS_TOKEN = (
    ""
    if SWITCHYARD_METRICS_PUBLIC
    else env("SWITCHYARD_METRICS_TOKEN") or install_secret(SWITCHYARD_VAR_DIR / "metrics-token")
)
# Key of the keyed hash (HMAC-SHA256) that replaces personal fields marked "hash".
SWITCHYARD_LOG_HASH_KEY = env("SWITCHYARD_LOG_HASH_KEY", "")

# Fleet -------------------------------------------------------------------------------------
# The URL agents started by the local cluster backend connect to (this platform).
SWITCHYARD_PLATFORM_URL = env(
    "SWITCHYARD_PLATFORM_URL", f"http://127.0.0.1:{env('SWITCHYARD_PORT', '8000')}"
)
# The image of agents the Kubernetes backend starts, unless their pool names one.
SWITCHYARD_AGENT_IMAGE = env("SWITCHYARD_AGENT_IMAGE", "ghcr.io/switchyard/switchyard:0.1.0")
# Where the local backend keeps its replicas' pid files, logs and the pool node tokens.
SWITCHYARD_LOCAL_AGENTS_DIR = Path(
    env("SWITCHYARD_LOCAL_AGENTS_DIR", str(SWITCHYARD_VAR_DIR / "agents"))
)
# Scaling decisions are kept this long (the UI charts them; the stabilisation window reads them).
SWITCHYARD_SCALING_HISTORY_HOURS = env_float("SWITCHYARD_SCALING_HISTORY_HOURS", 24)

# Monitoring --------------------------------------------------------------------------------
# Alert webhooks are retried after this many seconds, doubling each time (five retries).
SWITCHYARD_WEBHOOK_BACKOFF_S = env_float("SWITCHYARD_WEBHOOK_BACKOFF_S", 2)
# Webhooks on loopback or private addresses are refused (a tenant must not make the platform
# call into its own network) unless this is on, e.g. for a receiver inside the cluster.
SWITCHYARD_WEBHOOK_ALLOW_PRIVATE = env_bool("SWITCHYARD_WEBHOOK_ALLOW_PRIVATE", False)
# Drift reports are kept this long (the drift page charts the last day).
SWITCHYARD_DRIFT_HISTORY_DAYS = env_float("SWITCHYARD_DRIFT_HISTORY_DAYS", 30)
# SLIs and error budgets are measured over this many days (monitoring/slo.py).
SWITCHYARD_SLO_WINDOW_DAYS = env_float("SWITCHYARD_SLO_WINDOW_DAYS", 30)
# Burn alerts and the release freeze need at least this many requests in the window they
# judge: one 503 out of a model's first two requests is not a spent budget.
SWITCHYARD_SLO_MIN_EVENTS = env_int("SWITCHYARD_SLO_MIN_EVENTS", 100)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # Records logged while a request is handled carry its request and trace ids.
    "filters": {"trace": {"()": "gateway.tracing.TraceLogFilter"}},
    "formatters": {
        "plain": {
            "format": "%(asctime)s %(levelname)s %(name)s [%(request_id)s %(trace_id)s]: "
            "%(message)s"
        }
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "plain", "filters": ["trace"]}
    },
    "root": {"handlers": ["console"], "level": env("LOG_LEVEL", "INFO")},
    "loggers": {"django.channels.server": {"level": "WARNING"}},
}

# Usage and budgets -------------------------------------------------------------------------
# How often the beat task rolls today's and yesterday's usage up, prices it and evaluates the
# budgets (seconds); and how often each gateway process rereads the tenants whose budget's
# hard stop refuses new work (seconds: a stop or an override takes effect within this).
SWITCHYARD_USAGE_ROLLUP_INTERVAL_S = env_float("SWITCHYARD_USAGE_ROLLUP_INTERVAL_S", 300)
SWITCHYARD_BUDGET_REFRESH_S = env_float("SWITCHYARD_BUDGET_REFRESH_S", 2)
CELERY_BEAT_SCHEDULE["roll-up-usage"] = {
    "task": "monitoring.tasks.roll_up_usage",
    "schedule": SWITCHYARD_USAGE_ROLLUP_INTERVAL_S,
}

# Batch jobs --------------------------------------------------------------------------------
# Rows per chunk (the unit claimed, redone after a worker dies, and written to storage).
SWITCHYARD_BATCH_CHUNK_ROWS = env_int("SWITCHYARD_BATCH_CHUNK_ROWS", 1000)
# Rows per inference request a chunk sends, and how many of its requests are in flight.
SWITCHYARD_BATCH_REQUEST_ROWS = env_int("SWITCHYARD_BATCH_REQUEST_ROWS", 100)
SWITCHYARD_BATCH_IN_FLIGHT = env_int("SWITCHYARD_BATCH_IN_FLIGHT", 2)
# Chunks of one job worked on at once (by as many Celery workers).
SWITCHYARD_BATCH_PARALLEL_CHUNKS = env_int("SWITCHYARD_BATCH_PARALLEL_CHUNKS", 1)
# A running chunk's worker renews its lease after each round of requests; a chunk whose lease
# runs out (its worker died) is claimed again and redone.
SWITCHYARD_BATCH_LEASE_S = env_float("SWITCHYARD_BATCH_LEASE_S", 60)
SWITCHYARD_BATCH_MAX_ATTEMPTS = env_int("SWITCHYARD_BATCH_MAX_ATTEMPTS", 5)
# Retries of one request through 429/5xx and connection errors before the chunk is given back.
SWITCHYARD_BATCH_RETRIES = env_int("SWITCHYARD_BATCH_RETRIES", 8)
SWITCHYARD_BATCH_REQUEST_TIMEOUT_S = env_float("SWITCHYARD_BATCH_REQUEST_TIMEOUT_S", 120)
# The largest input (413 past it) and the most rows (400 past it).
SWITCHYARD_BATCH_MAX_INPUT_BYTES = env_int("SWITCHYARD_BATCH_MAX_INPUT_BYTES", 512 * 1024 * 1024)
SWITCHYARD_BATCH_MAX_ROWS = env_int("SWITCHYARD_BATCH_MAX_ROWS", 10_000_000)
# Where in storage a tenant's inputs given by name must lie ({tenant}: its slug).
SWITCHYARD_BATCH_INPUT_PREFIX = env("SWITCHYARD_BATCH_INPUT_PREFIX", "batch-inputs/{tenant}/")
SWITCHYARD_BATCH_REAP_INTERVAL_S = env_float("SWITCHYARD_BATCH_REAP_INTERVAL_S", 10)
CELERY_BEAT_SCHEDULE["reap-stalled-batch-jobs"] = {
    "task": "batch.tasks.reap_stalled_jobs",
    "schedule": SWITCHYARD_BATCH_REAP_INTERVAL_S,
}
