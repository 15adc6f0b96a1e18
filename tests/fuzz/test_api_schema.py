"""Schemathesis over the OpenAPI schema at ``/api/schema/``: every operation, with bodies,
parameters and paths generated from the schema (and outside it), by a tenant engineer's API key.

No answer is a server error, and every answer is one the schema documents: its status
(``status_code_conformance``) and its body (``response_schema_conformance``)."""

from __future__ import annotations

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.factories import make_key, make_model, make_tenant

# Loaded from the application itself at collection (the schema needs no database). The
# prediction API is served before Django by its lean ASGI app: test_fuzz_predict.py fuzzes it
# there, against the statuses this schema documents for it.
schema = schemathesis.openapi.from_wsgi("/api/schema/", get_wsgi_application()).exclude(
    path_regex="/predict$"
)


@pytest.fixture(autouse=True)
def _keep_the_test_connection():
    """As Django's test client does: the handler must not close the connection that holds the
    test's transaction when a request starts or ends."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def key(db) -> str:
    tenant = make_tenant("alpha")
    make_model(tenant, "clf")
    return make_key(tenant)[1]


@schema.parametrize()
@settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_every_answer_is_documented_and_none_is_a_server_error(case, key):
    case.call_and_validate(
        headers={"Authorization": f"Bearer {key}"},
        checks=[not_a_server_error, status_code_conformance, response_schema_conformance],
    )
