"""Feedback, the prediction log over the API and online quality: labels stored and replaced,
late arrivals joined, bad items named, roles and tenants kept apart, and the metrics checked
against values worked out by hand."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from monitoring.models import Feedback
from monitoring.quality import auc, online_quality, quality_by_version
from registry.models import TaskKind
from tests import factories
from tests.factories import make_model, make_version
from tests.onnx_models import small_onnx

pytestmark = pytest.mark.backends


def key_client(key: str) -> APIClient:
    client = APIClient()
    client.default_format = "json"
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


def session_client(user) -> APIClient:
    client = APIClient()
    client.default_format = "json"
    client.force_login(user)
    return client


def make_log(
    version,
    request_id: str,
    scores: list,
    *,
    outputs: dict | None = None,
    arm: str = "",
    status: int = 200,
    at: datetime | None = None,
) -> dict:
    """A logged prediction of ``version``; outputs default to binary probabilities."""
    if outputs is None:
        outputs = {"y": [[1 - s, s] for s in scores]}
    return factories.make_log(
        version,
        request_id,
        arm=arm,
        inputs={"x[0]": [0.0] * len(scores)},
        outputs=outputs,
        scores=scores,
        status=status,
        at=at or timezone.now(),
    )


def label(tenant, request_id: str, value) -> Feedback:
    return Feedback.objects.create(
        tenant=tenant, request_id=request_id, label=value, received_at=timezone.now()
    )


@pytest.fixture
def logged(world, onnx_bytes):
    """Tenant A: classifier ``clf`` v1 and v2; tenant B: ``secret-b``, which logged the same
    request id ``shared`` as A did."""
    world.clf = make_model(world.a, "clf")
    world.v1 = make_version(world.clf, onnx_bytes)
    world.v2 = make_version(world.clf, small_onnx(seed=3), alias=None)
    world.secret = make_version(make_model(world.b, "secret-b"), onnx_bytes)
    make_log(world.v1, "shared", [0.9])
    make_log(world.secret, "shared", [0.2])
    world.api_a = key_client(world.key_a)
    world.api_b = key_client(world.key_b)
    return world


# Feedback ------------------------------------------------------------------------------------


def test_one_label_is_stored_and_matched_to_its_logged_prediction(logged):
    response = logged.api_a.post("/api/v1/feedback", {"request_id": "shared", "label": 1})
    assert response.status_code == 200, response.json()
    assert response.json() == {"accepted": 1, "matched": 1}
    stored = Feedback.objects.get(tenant=logged.a, request_id="shared")
    assert stored.label == 1


def test_bulk_labels_are_stored_and_counted_against_the_log(logged):
    make_log(logged.v1, "two-rows", [0.3, 0.6])
    items = [
        {"request_id": "shared", "label": 1},
        {"request_id": "two-rows", "label": [0, 1]},
        {"request_id": "not-logged-yet", "label": 0.5},
    ]
    response = logged.api_a.post("/api/v1/feedback", {"items": items})
    assert response.json() == {"accepted": 3, "matched": 2}
    labels = dict(Feedback.objects.filter(tenant=logged.a).values_list("request_id", "label"))
    assert labels == {"shared": 1, "two-rows": [0, 1], "not-logged-yet": 0.5}


def test_a_label_sent_again_replaces_the_old_one(logged):
    logged.api_a.post("/api/v1/feedback", {"request_id": "shared", "label": 0})
    items = [{"request_id": "shared", "label": 1}, {"request_id": "shared", "label": 2}]
    response = logged.api_a.post("/api/v1/feedback", {"items": items})
    assert response.json() == {"accepted": 1, "matched": 1}  # the last one in a batch wins
    assert list(Feedback.objects.filter(tenant=logged.a).values_list("label", flat=True)) == [2]


def test_a_label_that_arrives_before_its_prediction_joins_once_it_is_logged(logged):
    early = logged.api_a.post("/api/v1/feedback", {"request_id": "early", "label": 1})
    assert early.json() == {"accepted": 1, "matched": 0}
    listed = logged.api_a.get("/api/v1/models/clf/predictions", {"request_id": "early"})
    assert listed.json() == {"count": 0, "results": []}

    make_log(logged.v1, "early", [0.7], at=timezone.now())  # the writer catches up
    rows = logged.api_a.get("/api/v1/models/clf/predictions", {"request_id": "early"}).json()
    assert rows["count"] == 1 and rows["results"][0]["label"] == 1
    quality = logged.api_a.get("/api/v1/models/clf/quality").json()
    assert sum(p["labelled"] for p in quality["series"]) == 1


def test_a_label_days_after_the_prediction_still_counts(logged):
    make_log(logged.v1, "old", [0.2], at=timezone.now() - timedelta(days=5))
    logged.api_a.post("/api/v1/feedback", {"request_id": "old", "label": 0})
    week = (timezone.now() - timedelta(days=7)).isoformat()
    series = logged.api_a.get(
        "/api/v1/models/clf/quality", {"bucket": "day", "since": week}
    ).json()["series"]
    assert [(p["labelled"], p["accuracy"]) for p in series if p["labelled"]] == [(1, 1.0)]


@pytest.mark.parametrize(
    "body, error",
    [
        ({"label": 1}, "request_id: This field is required."),
        ({"request_id": "r"}, "label: This field is required."),
        ({"request_id": "r", "label": "cat"}, "label: must be a number"),
        ({"request_id": "r", "label": []}, "label: must be a number"),
        ({"request_id": "r" * 129, "label": 1}, "request_id: Ensure this field has no more"),
        (
            {"items": [{"request_id": "a", "label": 1}, {"request_id": "b", "label": {"x": 1}}]},
            "items[1].label: must be a number",
        ),
        (
            {"items": [{"request_id": "a", "label": 1}, {"label": 1}, 7]},
            "items[1].request_id: This field is required.",
        ),
        ({"items": [{"request_id": "a", "label": 1}, 7]}, "items[1]: Invalid data"),
        ({"items": []}, "items: "),
        ({"items": [{"request_id": "a", "label": 1}], "label": 1}, "items: send either items"),
        ([{"request_id": "a", "label": 1}], "body: must be a JSON object"),
    ],
)
def test_bad_feedback_is_a_400_naming_the_item_and_field(logged, body, error):
    response = logged.api_a.post("/api/v1/feedback", body)
    assert response.status_code == 400
    assert error in response.json()["error"]
    assert not Feedback.objects.exists()  # nothing of a bad batch is stored


def test_bulk_feedback_takes_ten_thousand_items_and_no_more(logged):
    items = [{"request_id": f"r{i}", "label": i % 2} for i in range(10_000)]
    ok = logged.api_a.post("/api/v1/feedback", {"items": items})
    assert ok.json() == {"accepted": 10_000, "matched": 0}
    items.append({"request_id": "one-more", "label": 0})
    too_many = logged.api_a.post("/api/v1/feedback", {"items": items})
    assert too_many.status_code == 400
    assert too_many.json()["error"].startswith("items: Ensure this field has no more than 10000")


def test_feedback_only_ever_touches_the_callers_tenant(logged):
    response = logged.api_b.post("/api/v1/feedback", {"request_id": "shared", "label": 0})
    assert response.json() == {"accepted": 1, "matched": 1}  # B's own log row
    assert not Feedback.objects.filter(tenant=logged.a).exists()
    logged.api_a.post("/api/v1/feedback", {"request_id": "shared", "label": 1})
    a_rows = logged.api_a.get("/api/v1/models/clf/predictions").json()["results"]
    assert [r["label"] for r in a_rows] == [1]
    b_rows = logged.api_b.get("/api/v1/models/secret-b/predictions").json()["results"]
    assert [r["label"] for r in b_rows] == [0]


def test_viewers_cannot_send_feedback_but_can_read(logged):
    viewer = session_client(logged.viewer_a)
    refused = viewer.post("/api/v1/feedback", {"request_id": "shared", "label": 1})
    assert refused.status_code == 403
    assert not Feedback.objects.exists()
    assert viewer.get("/api/v1/models/clf/predictions").status_code == 200
    assert viewer.get("/api/v1/models/clf/quality").status_code == 200
    engineer = session_client(logged.engineer_a)
    sent = engineer.post("/api/v1/feedback", {"request_id": "shared", "label": 1})
    assert sent.status_code == 200


@pytest.mark.parametrize(
    "method, url",
    [
        ("post", "/api/v1/feedback"),
        ("get", "/api/v1/models/clf/predictions"),
        ("get", "/api/v1/models/clf/quality"),
    ],
)
def test_anonymous_callers_and_outsiders_are_refused(logged, method, url):
    assert getattr(APIClient(), method)(url).status_code in (401, 403)
    assert getattr(session_client(logged.outsider), method)(url).status_code == 403


@pytest.mark.parametrize(
    "url", ["/api/v1/models/secret-b/predictions", "/api/v1/models/secret-b/quality"]
)
def test_another_tenants_model_is_404(logged, url):
    assert logged.api_a.get(url).status_code == 404
    assert logged.api_b.get(url).status_code == 200
    assert logged.api_a.get(url.replace("secret-b", "nope")).status_code == 404


# The log over the API ------------------------------------------------------------------------


def test_the_log_lists_newest_first_with_filters_and_paging(logged):
    now = timezone.now()
    make_log(logged.v1, "a", [0.1], at=now - timedelta(minutes=3))
    make_log(logged.v2, "b", [0.2], at=now - timedelta(minutes=2), arm="candidate")
    make_log(logged.v2, "c", [], status=503, outputs={}, at=now - timedelta(minutes=1))
    api = logged.api_a
    everything = api.get("/api/v1/models/clf/predictions").json()
    assert [r["request_id"] for r in everything["results"]] == ["shared", "c", "b", "a"]
    assert everything["count"] == 4
    b = everything["results"][2]
    assert (b["version"], b["arm"], b["status"], b["scores"], b["label"]) == (
        2,
        "candidate",
        200,
        [0.2],
        None,
    )
    v2 = api.get("/api/v1/models/clf/predictions", {"version": 2}).json()
    assert [r["request_id"] for r in v2["results"]] == ["c", "b"]
    errors = api.get("/api/v1/models/clf/predictions", {"status": 503}).json()
    assert [r["request_id"] for r in errors["results"]] == ["c"]
    paged = api.get("/api/v1/models/clf/predictions", {"limit": 2, "offset": 1}).json()
    assert paged["count"] == 4 and [r["request_id"] for r in paged["results"]] == ["c", "b"]
    bad = api.get("/api/v1/models/clf/predictions", {"limit": 0})
    assert bad.status_code == 400 and bad.json()["error"].startswith("limit:")


def test_quality_parameters_are_checked(logged):
    bad = logged.api_a.get("/api/v1/models/clf/quality", {"bucket": "week"})
    assert bad.status_code == 400 and bad.json()["error"].startswith("bucket:")
    worse = logged.api_a.get("/api/v1/models/clf/quality", {"since": "yesterday"})
    assert worse.status_code == 400 and worse.json()["error"].startswith("since:")


# Metrics against hand-checked values ---------------------------------------------------------


def test_auc_is_the_share_of_positive_negative_pairs_ranked_right():
    # Positives 0.35 and 0.8, negatives 0.1 and 0.4: 0.35 beats 0.1, 0.8 beats both: 3 of 4.
    assert auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auc([0.5, 0.5], [0, 1]) == pytest.approx(0.5)  # a tie counts one half
    assert auc([0.9, 0.1], [0, 1]) == pytest.approx(0.0)
    assert auc([0.2, 0.3], [1, 1]) is None  # one class only


def hour_ago(hours: int, minutes: int = 5) -> datetime:
    start = timezone.now().astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    return start - timedelta(hours=hours) + timedelta(minutes=minutes)


def test_binary_accuracy_and_auc_per_version_arm_and_hour(logged):
    Feedback.objects.all().delete()
    factories.clear_log()
    v1, v2, a = logged.v1, logged.v2, logged.a
    # v1 (baseline), two hours ago: one request of four rows, labels 0 0 1 1: predicted
    # (score ≥ 0.5) 0 0 0 1, so accuracy 3/4; AUC 3/4 (see above).
    make_log(v1, "batch", [0.1, 0.4, 0.35, 0.8], arm="baseline", at=hour_ago(2))
    label(a, "batch", [0, 0, 1, 1])
    # v1, an hour ago: one right, one wrong; a label list with a null row; a scalar label for
    # two rows (cannot be paired: left out); an unlabelled row; an error (not counted).
    make_log(v1, "right", [0.9], arm="baseline", at=hour_ago(1))
    label(a, "right", 1)
    make_log(v1, "wrong", [0.2], arm="baseline", at=hour_ago(1))
    label(a, "wrong", True)
    make_log(v1, "partial", [0.6, 0.3], arm="baseline", at=hour_ago(1))
    label(a, "partial", [None, 0])
    make_log(v1, "mismatch", [0.6, 0.3], arm="baseline", at=hour_ago(1))
    label(a, "mismatch", 1)
    make_log(v1, "unlabelled", [0.6], arm="baseline", at=hour_ago(1))
    make_log(v1, "failed", [], outputs={}, status=500, arm="baseline", at=hour_ago(1))
    # v2 (candidate), an hour ago: both right.
    make_log(v2, "c1", [0.7], arm="candidate", at=hour_ago(1, 30))
    label(a, "c1", 1)
    make_log(v2, "c2", [0.45], arm="candidate", at=hour_ago(1, 40))
    label(a, "c2", 0)

    series = online_quality(a.pk, logged.clf, hour_ago(3), "hour")
    got = [
        (
            p["bucket_start"],
            p["version"],
            p["arm"],
            p["logged"],
            p["labelled"],
            p["labelled_rows"],
            p["accuracy"],
            p["auc"],
        )
        for p in series
    ]
    two, one = hour_ago(2, 0), hour_ago(1, 0)
    assert got == [
        (two, 1, "baseline", 1, 1, 4, 0.75, pytest.approx(0.75)),
        # Five requests logged, three labelled so they pair (not "mismatch"), covering the
        # rows right (1 vs 1), wrong (0 vs 1) and partial's second (0 vs 0): accuracy 2/3;
        # AUC: positives 0.9, 0.2 against the negative 0.3: 1 of 2 pairs.
        (one, 1, "baseline", 5, 3, 3, pytest.approx(2 / 3), pytest.approx(0.5)),
        (one, 2, "candidate", 2, 2, 2, 1.0, 1.0),
    ]
    over_api = logged.api_a.get(
        "/api/v1/models/clf/quality", {"since": hour_ago(3).isoformat()}
    ).json()
    assert over_api["task"] == "classifier" and over_api["bucket"] == "hour"
    assert [p["accuracy"] for p in over_api["series"]] == [0.75, pytest.approx(2 / 3), 1.0]

    by_version = quality_by_version([v1.pk, v2.pk], hour_ago(3))
    # v1 over both hours: 7 labelled rows, 5 right; positives 0.35 0.8 0.9 0.2 against
    # negatives 0.1 0.4 0.3: 0.35 beats 2, 0.8 and 0.9 beat 3, 0.2 beats 1 → 9 of 12.
    assert by_version[v1.pk] == {
        "logged": 6,
        "labelled": 4,
        "labelled_rows": 7,
        "accuracy": pytest.approx(5 / 7),
        "auc": pytest.approx(0.75),
    }
    assert by_version[v2.pk]["accuracy"] == 1.0


def test_a_daily_bucket_gathers_the_hours(logged):
    Feedback.objects.all().delete()
    factories.clear_log()
    today = timezone.now().astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    for i, (score, y) in enumerate([(0.9, 1), (0.1, 1), (0.2, 0)]):
        make_log(logged.v1, f"d{i}", [score], at=today + timedelta(minutes=5 + 60 * i))
        label(logged.a, f"d{i}", y)
    series = online_quality(logged.a.pk, logged.clf, today, "day")
    assert [(p["bucket_start"], p["labelled_rows"], p["accuracy"]) for p in series] == [
        (today, 3, pytest.approx(2 / 3))
    ]


def test_multiclass_accuracy_takes_the_top_class_and_has_no_auc(world):
    model = make_model(world.a, "species")
    version = make_version(model, small_onnx(n_out=3))
    rows = [[0.1, 0.2, 0.7], [0.5, 0.3, 0.2], [0.2, 0.5, 0.3]]
    make_log(version, "m", [0.7, 0.5, 0.5], outputs={"y": rows})
    label(world.a, "m", [2, 1, 1])  # predicted 2, 0, 1: two right
    (point,) = online_quality(world.a.pk, model, timezone.now() - timedelta(hours=1))
    assert point["accuracy"] == pytest.approx(2 / 3) and point["auc"] is None


def test_regressor_quality_is_the_mean_absolute_error(world):
    model = make_model(world.a, "price", task=TaskKind.REGRESSOR)
    version = make_version(model, small_onnx(n_out=1))
    make_log(version, "p", [1.0, 2.0, 4.0], outputs={"y": [[1.0], [2.0], [4.0]]})
    label(world.a, "p", [1.5, 2.0, 2.0])  # errors 0.5, 0, 2
    make_log(version, "q", [10.0], outputs={"y": [[10.0]]})
    label(world.a, "q", 9.0)  # error 1
    (point,) = online_quality(world.a.pk, model, timezone.now() - timedelta(hours=1))
    assert (point["labelled"], point["labelled_rows"]) == (2, 4)
    assert point["mae"] == pytest.approx(3.5 / 4)
    assert "accuracy" not in point
    by_version = quality_by_version([version.pk], timezone.now() - timedelta(hours=1))
    assert by_version[version.pk]["mae"] == pytest.approx(3.5 / 4)
