"""Where a version is on the agents (``GET /api/v1/models/{name}/versions/{v}/placements``,
``fleet.deployments.version_placements``): each agent's load state with the detail that
explains it, a failure's detail long enough for an installer's error, and never another
tenant's version or an agent outside the tenant's scope."""

from __future__ import annotations

import pytest

from fleet.models import AgentSession
from fleet.nodes import DETAIL_CHARS, FAILED_DETAIL_CHARS, create_node, record_version_state
from serving_agent.protocol import VersionStatus
from tests.factories import key_client, make_model, make_session, make_version

INSTALLER_ERROR = "uv pip install failed: " + "x" * 1500 + " No solution found for roman==99"


@pytest.fixture
def placed(world, onnx_bytes):
    """A's ``clf`` v1 failed on the shared node ``cpu-1`` and loading on A's own ``a-box``;
    B's ``secret`` v1 ready on ``cpu-1`` and on B's own ``b-box``."""
    world.v1 = make_version(make_model(world.a, "clf"), onnx_bytes)
    world.secret = make_version(make_model(world.b, "secret"), onnx_bytes)
    shared, _ = create_node("cpu-1")
    a_box, _ = create_node("a-box", tenant=world.a)
    b_box, _ = create_node("b-box", tenant=world.b)
    world.shared = make_session(shared)
    world.a_box = make_session(a_box)
    world.b_box = make_session(b_box)
    failed = VersionStatus(version_id=world.v1.pk, state="failed", detail=INSTALLER_ERROR)
    record_version_state(world.shared.pk, failed, [])
    ready = VersionStatus(version_id=world.secret.pk, state="ready", provider="cpu", memory_bytes=9)
    record_version_state(world.shared.pk, ready, [world.secret.pk])
    progress = "building environment 3f2a: installing 1 requirement(s)"
    loading = VersionStatus(version_id=world.v1.pk, state="loading", detail=progress)
    record_version_state(world.a_box.pk, loading, [])
    ready_b = VersionStatus(version_id=world.secret.pk, state="ready")
    record_version_state(world.b_box.pk, ready_b, [world.secret.pk])
    return world


def test_a_failure_keeps_the_installers_error_and_progress_stays_short(placed):
    stored = AgentSession.objects.get(pk=placed.shared.pk).version_states[str(placed.v1.pk)]
    assert stored["detail"] == INSTALLER_ERROR  # 1,554 characters, past the old 300
    long = "y" * 5000
    record_version_state(
        placed.a_box.pk, VersionStatus(version_id=placed.v1.pk, state="failed", detail=long), []
    )
    record_version_state(
        placed.b_box.pk,
        VersionStatus(version_id=placed.secret.pk, state="loading", detail=long),
        [],
    )
    kept_failed = AgentSession.objects.get(pk=placed.a_box.pk).version_states[str(placed.v1.pk)]
    kept_loading = AgentSession.objects.get(pk=placed.b_box.pk).version_states[
        str(placed.secret.pk)
    ]
    assert len(kept_failed["detail"]) == FAILED_DETAIL_CHARS == 2000
    assert len(kept_loading["detail"]) == DETAIL_CHARS == 300


def test_the_placements_show_each_agents_state_and_detail(placed):
    answer = key_client(placed.key_a).get("/api/v1/models/clf/versions/1/placements")
    assert answer.status_code == 200, answer.content
    by_node = {p["node"]: p for p in answer.json()}
    assert sorted(by_node) == ["a-box", "cpu-1"]
    assert by_node["cpu-1"]["state"] == "failed"
    assert by_node["cpu-1"]["detail"] == INSTALLER_ERROR
    assert by_node["a-box"]["state"] == "loading"
    assert by_node["a-box"]["detail"].startswith("building environment 3f2a")
    assert by_node["a-box"]["kind"] == "node" and by_node["a-box"]["health"] == "healthy"


def test_the_placements_name_no_other_tenants_version_or_node(placed):
    answer = key_client(placed.key_b).get("/api/v1/models/secret/versions/1/placements").json()
    assert {p["node"]: p["state"] for p in answer} == {"b-box": "ready", "cpu-1": "ready"}
    assert answer[1]["provider"] == "cpu" and answer[1]["memory_bytes"] == 9
    text = key_client(placed.key_b).get("/api/v1/models/secret/versions/1/placements").content
    assert b"a-box" not in text and b"uv pip" not in text


@pytest.mark.parametrize("path", ["/api/v1/models/clf/versions/1/placements"])
def test_other_tenant_gets_404(placed, path):
    assert key_client(placed.key_b).get(path).status_code == 404
    assert (
        key_client(placed.key_a).get("/api/v1/models/clf/versions/9/placements").status_code == 404
    )


def test_an_unloaded_version_and_a_gone_agent_are_not_placements(placed):
    record_version_state(
        placed.a_box.pk, VersionStatus(version_id=placed.v1.pk, state="unloaded"), []
    )
    AgentSession.objects.filter(pk=placed.shared.pk).update(disconnected_at=placed.v1.created_at)
    answer = key_client(placed.key_a).get("/api/v1/models/clf/versions/1/placements").json()
    assert answer == []
