"""The prediction log page: sign-in, the tenant's model only, filters, paging, labels and the
quality chart's series."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from django.contrib.staticfiles import finders
from django.test import Client
from django.utils import timezone

from tests.factories import make_model, make_version
from tests.onnx_models import small_onnx
from tests.test_feedback import label, make_log
from web.prediction_views import PAGE_SIZE

pytestmark = pytest.mark.backends


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_the_page_needs_sign_in_and_shows_only_the_tenants_models(world, onnx_bytes):
    make_version(make_model(world.a, "clf"), onnx_bytes)
    make_version(make_model(world.b, "secret-b"), onnx_bytes)
    anonymous = Client().get("/models/clf/predictions/")
    assert anonymous.status_code == 302 and anonymous["Location"].startswith("/login/")
    viewer = signed_in(world.viewer_a)
    assert viewer.get("/models/clf/predictions/").status_code == 200
    assert viewer.get("/models/secret-b/predictions/").status_code == 404
    assert signed_in(world.outsider).get("/models/clf/predictions/").status_code == 403


def test_the_page_lists_labelled_predictions_with_filters_paging_and_a_quality_chart(
    world, onnx_bytes
):
    model = make_model(world.a, "clf")
    v1 = make_version(model, onnx_bytes)
    v2 = make_version(model, small_onnx(seed=3), alias=None)
    # Every log in one hourly bucket of the chart (the middle of the last hour): from timezone.now()
    # the logs spanned two buckets whenever the test ran in the first ~2 minutes of an hour.
    now = timezone.now().replace(minute=30, second=0, microsecond=0) - timedelta(hours=1)
    for i in range(PAGE_SIZE + 5):
        make_log(v1, f"r{i}", [0.8], arm="baseline", at=now - timedelta(seconds=100 + i))
    make_log(v2, "newest", [0.3, 0.6], arm="candidate", at=now - timedelta(seconds=1))
    label(world.a, "newest", [0, 1])
    label(world.a, "r0", 0)
    client = signed_in(world.engineer_a)

    first = client.get("/models/clf/predictions/")
    rows = first.context["rows"]
    assert len(rows) == PAGE_SIZE and first.context["page_obj"].paginator.count == PAGE_SIZE + 6
    assert rows[0]["log"].request_id == "newest" and rows[0]["label"] == "[0, 1]"
    assert rows[0]["scores"] == "0.3, 0.6" and rows[0]["rows"] == 2
    assert b"Older" in first.content and b'data-request="newest"' in first.content

    second = client.get("/models/clf/predictions/", {"page": 2})
    assert [r["log"].request_id for r in second.context["rows"]][-1] == f"r{PAGE_SIZE + 4}"

    only_v2 = client.get("/models/clf/predictions/", {"version": "2"})
    assert [r["log"].request_id for r in only_v2.context["rows"]] == ["newest"]
    by_id = client.get("/models/clf/predictions/", {"request_id": "r0"})
    assert [(r["log"].request_id, r["label"]) for r in by_id.context["rows"]] == [("r0", "0")]
    nothing = client.get("/models/clf/predictions/", {"status": "500"})
    assert nothing.context["rows"] == [] and b"match these filters" in nothing.content

    embedded = re.search(
        rb'<script id="quality" type="application/json">(.*?)</script>', first.content
    )
    chart = json.loads(embedded.group(1))  # what the page's script draws
    assert chart["task"] == "classifier" and chart["metrics"] == ["accuracy", "auc"]
    lines = {line["name"]: line for line in chart["lines"]}
    assert set(lines) == {"v1 · baseline", "v2 · candidate"}
    assert lines["v2 · candidate"]["accuracy"] == [1.0]  # 0.3 → 0 and 0.6 → 1, both right
    assert lines["v1 · baseline"]["accuracy"] == [0.0]  # r0: 0.8 → 1, labelled 0
    assert b"plotly.min.js" in first.content
    totals = {(t["version"], t["arm"]): t for t in first.context["totals"]}
    assert totals[(1, "baseline")]["logged"] == PAGE_SIZE + 5
    assert (totals[(2, "candidate")]["labelled"], totals[(2, "candidate")]["labelled_rows"]) == (
        1,
        2,
    )
    assert finders.find("ui/predictions.js")


def test_the_model_page_links_to_its_predictions(world, onnx_bytes):
    make_version(make_model(world.a, "clf"), onnx_bytes)
    page = signed_in(world.engineer_a).get("/models/clf/")
    assert b'href="/models/clf/predictions/"' in page.content
