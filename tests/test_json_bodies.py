"""Every JSON body of the API is read by one parser (platform_site.api.JSONBodyParser): a body
nested past orjson's depth limit, which the stdlib's parser recursed on until RecursionError (a
500), is a 400 in the API's error shape on every app's endpoints."""

from __future__ import annotations

import pytest

from tests.factories import as_user, make_member, make_model, make_tenant

DEEP = b"[" * 100_000 + b"]" * 100_000

ENDPOINTS = [
    "/api/v1/models",  # registry
    "/api/v1/models/clf/rollouts",  # rollouts
    "/api/v1/keys",  # tenants
    "/api/v1/feedback",  # monitoring
    "/api/v1/budget",  # monitoring (usage and budgets)
    "/api/v1/jobs",  # batch
]


@pytest.mark.django_db
@pytest.mark.parametrize("path", ENDPOINTS)
def test_a_body_nested_too_deep_is_a_400_not_a_500(path):
    tenant = make_tenant("alpha")
    make_model(tenant, "clf")
    client = as_user(make_member(tenant, "approver-a", "approver"))
    method = client.put if path.endswith("budget") else client.post
    response = method(path, DEEP, content_type="application/json")
    assert response.status_code == 400, (path, response.status_code, response.content[:200])
    assert "JSON" in response.json()["error"]
