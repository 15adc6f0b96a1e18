"""A version's page (``web.version_views``): for a python version its package's files,
requirements and manifest, and for every version its state on each agent with the failure's
detail; the model page links to it, and another tenant's member gets a 404."""

from __future__ import annotations

import pytest
from django.core.cache import cache
from django.test import Client

from fleet.nodes import create_node, record_version_state
from serving_agent.protocol import VersionStatus
from tests.factories import make_member, make_model, make_session, make_version
from tests.test_python_package_summary import python_package

INSTALLER_ERROR = (
    "uv pip install failed: × No solution found when resolving dependencies:\n"
    "╰─▶ Because there is no version of roman==99 and you require roman==99, we can conclude "
    "that your requirements are unsatisfiable. <script>alert(1)</script>"
)


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def page_world(world, onnx_bytes, tmp_path):
    cache.clear()
    artifact = python_package(tmp_path / "scorer", "roman==99\n", "network = false")
    world.scorer = make_version(make_model(world.a, "scorer"), artifact, format="python")
    world.clf = make_version(make_model(world.a, "clf"), onnx_bytes)
    failed, _ = create_node("cpu-1")
    building, _ = create_node("cpu-2")
    status = VersionStatus(version_id=world.scorer.pk, state="failed", detail=INSTALLER_ERROR)
    record_version_state(make_session(failed).pk, status, [])
    progress = "building environment 9c1d: installing 1 requirement(s)"
    status = VersionStatus(version_id=world.scorer.pk, state="loading", detail=progress)
    record_version_state(make_session(building).pk, status, [])
    return world


def test_the_page_shows_the_package_and_the_state_on_each_agent(page_world):
    answer = signed_in(page_world.viewer_a).get("/models/scorer/versions/1/")
    assert answer.status_code == 200
    html = answer.content.decode()
    assert 'id="package"' in html
    assert '<code data-field="entrypoint">model:Model</code>' in html
    assert "1024 MiB memory" in html and "none (the worker opens no connections)" in html
    assert "<li><code>roman==99</code></li>" in html
    for name in ("model.py", "requirements.txt", "switchyard.toml", "weights.json"):
        assert f"<td><code>{name}</code></td>" in html
    assert "extra-1.0-py3-none-any.whl" in html
    assert 'data-node="cpu-1" data-state="failed"' in html
    assert "we can conclude that your requirements are unsatisfiable" in html
    assert "<script>alert(1)</script>" not in html  # the agent's words are escaped
    assert 'data-node="cpu-2" data-state="loading"' in html
    assert "building environment 9c1d: installing 1 requirement(s)" in html


def test_a_version_of_another_format_has_no_package_panel(page_world):
    html = signed_in(page_world.viewer_a).get("/models/clf/versions/1/").content.decode()
    assert 'id="package"' not in html
    assert "No agent holds this version now" in html


def test_the_model_page_links_each_version_to_its_page(page_world):
    html = signed_in(page_world.viewer_a).get("/models/scorer/").content.decode()
    assert 'href="/models/scorer/versions/1/"' in html


def test_other_tenant_gets_404(page_world):
    member_b = make_member(page_world.b, "eng-b", "engineer")
    assert signed_in(member_b).get("/models/scorer/versions/1/").status_code == 404
    assert signed_in(page_world.viewer_a).get("/models/scorer/versions/2/").status_code == 404
