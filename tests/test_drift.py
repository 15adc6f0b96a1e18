"""Drift: PSI and KS on generated data with known shifts, categorical features, data-quality
counts, references (uploaded, a past window, with the version), reports and alerts, the API with
roles and tenant isolation, and the canary guardrail that rolls back a candidate whose scores
drift from the baseline's on the same traffic."""

from __future__ import annotations

import json
import math
import uuid
from datetime import timedelta

import numpy as np
import pytest
from django.core.exceptions import ValidationError
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone
from rest_framework.test import APIClient
from scipy.spatial.distance import jensenshannon
from scipy.stats import ks_2samp

from monitoring import drift
from monitoring.models import Alert, DriftReport, TrafficSample
from monitoring.tasks import detect_drift as detect_drift_task
from monitoring.traffic import Counts
from registry.models import ModelVersion, ReferenceSample
from registry.reference import MIN_ROWS, expected_features, set_reference_upload
from rollouts import actions
from rollouts.approvals import evidence_now, request_promotion
from rollouts.guardrails import evaluate
from rollouts.models import PlanState
from tenants.audit import Actor
from tenants.models import AuditEvent
from tests.factories import make_log, make_model, make_version
from tests.onnx_models import small_onnx

pytestmark = pytest.mark.backends

FEATURES = ["age", "income", "plan", "clicks"]
PLANS = ["free", "pro", "team"]
ACTOR = Actor(None, "test")
RAILS = {"max_error_rate_increase": 0.01, "max_p99_ratio": 2.0, "min_samples": 100}


# Data ------------------------------------------------------------------------------------------


def sample(rng, n: int, *, age_mean=40.0, plan_p=(0.6, 0.3, 0.1), score_a=2.0) -> dict:
    """Columns of ``n`` rows: age ~ N(mean, 10), income lognormal, plan categorical, clicks a
    small count (numbers with few distinct values: categorical), and a score per row."""
    return {
        "columns": {
            "age": rng.normal(age_mean, 10, n).round(2).tolist(),
            "income": rng.lognormal(10, 0.5, n).round(0).tolist(),
            "plan": rng.choice(PLANS, n, p=plan_p).tolist(),
            "clicks": np.minimum(rng.poisson(2, n), 6).tolist(),
        },
        "scores": rng.beta(score_a, 5, n).round(4).tolist(),
    }


def log(version, columns: dict, scores: list, *, at=None, status: int = 200) -> None:
    make_log(
        version,
        uuid.uuid4().hex,
        inputs=columns,
        scores=scores,
        status=status,
        at=at or timezone.now() - timedelta(minutes=5),
    )


def log_rows(version, data: dict, *, per_request: int = 100, at=None) -> None:
    """Log ``data`` as requests of ``per_request`` rows each."""
    n = len(data["scores"])
    for i in range(0, n, per_request):
        part = {name: values[i : i + per_request] for name, values in data["columns"].items()}
        log(version, part, data["scores"][i : i + per_request], at=at)


@pytest.fixture
def version(world, onnx_bytes):
    model = make_model(world.a, "clf")
    return make_version(model, onnx_bytes, feature_names=FEATURES)


@pytest.fixture
def referenced(version, rng):
    """``version`` with an uploaded reference of 2000 rows."""
    set_reference_upload(version, ACTOR, **sample(rng, 2000))
    return version


# The measures ----------------------------------------------------------------------------------


def test_psi_matches_a_hand_checked_case():
    # Deciles of 0..99 put 10k..10k+9 in bin k. The current sample has shares
    # .2 .2 .1 .1 .1 .1 .05 .05 .05 .05 against .1 each:
    # PSI = 2 (.2-.1) ln 2 + 4 (.05-.1) ln .5 = 0.4 ln 2.
    reference = np.arange(100)
    current = [*range(0, 20), *range(0, 20), *range(20, 60)]
    current += [v for k in range(6, 10) for v in range(10 * k, 10 * k + 5)]
    assert drift.psi(reference, current) == pytest.approx(0.4 * math.log(2))
    # Empty bins take the epsilon: all of the current in the lower half.
    half = 5 * 0.1 * math.log(2) + 5 * (1e-4 - 0.1) * math.log(1e-4 / 0.1)
    assert drift.psi(reference, np.arange(50)) == pytest.approx(half)
    assert drift.psi(reference, reference) == 0


def test_bin_edges_are_deduplicated_and_outer_bins_take_values_beyond_the_reference():
    reference = np.array([0, 0, 0, 0, 0, 0, 1, 2, 3, 4], dtype=float)
    edges = drift.bin_edges(reference)
    assert len(edges) == len(set(edges.tolist())) and edges[0] == 0 and edges[-1] == 4
    shares = drift.bin_shares(np.array([-50.0, 100.0]), edges)
    assert shares[0] == 0.5 and shares[-1] == 0.5


def test_ks_matches_scipy(rng):
    a, b = rng.normal(0, 1, 500), rng.normal(0.3, 1, 400)
    expected = ks_2samp(a, b)
    assert drift.ks(a, b) == pytest.approx((expected.statistic, expected.pvalue))


# Reports ---------------------------------------------------------------------------------------


def test_shifted_features_are_flagged_and_steady_ones_are_not(referenced, rng):
    log_rows(referenced, sample(rng, 1000, age_mean=52, plan_p=(0.2, 0.3, 0.5)))
    report = drift.detect_drift(referenced)
    assert report is not None and report.rows_current == 1000 and report.rows_reference == 2000
    assert set(report.flagged) == {"age", "plan"}
    f = report.features
    assert f["age"]["psi"] > 0.5 and f["age"]["ks_pvalue"] < 1e-6
    assert f["income"]["psi"] < 0.05 and not f["income"]["flagged"]
    assert f["clicks"]["kind"] == "categorical" and not f["clicks"]["flagged"]
    assert report.score["psi"] < 0.05 and not report.score["flagged"]
    assert report.max_psi == max(e["psi"] for e in f.values())
    # Histograms for charts: shared edges (or categories) and both sides' shares.
    assert len(f["age"]["edges"]) == len(f["age"]["reference"]) + 1
    assert sum(f["age"]["current"]) == pytest.approx(1)
    assert f["plan"]["categories"] == PLANS and len(f["plan"]["current"]) == 3


def test_report_ks_is_scipy_on_the_valid_values(referenced, rng):
    data = sample(rng, 300, age_mean=45)
    data["columns"]["age"][:10] = [None] * 10
    log_rows(referenced, data)
    report = drift.detect_drift(referenced)
    reference = ReferenceSample.objects.get(version=referenced).columns["age"]
    expected = ks_2samp(reference, data["columns"]["age"][10:])
    assert report.features["age"]["ks"] == pytest.approx(expected.statistic)
    assert report.features["age"]["ks_pvalue"] == pytest.approx(expected.pvalue)
    assert report.quality["age"]["nulls"] == 10


def test_scores_that_drift_are_flagged_as_score(referenced, rng):
    log_rows(referenced, sample(rng, 500, score_a=6.0))
    report = drift.detect_drift(referenced)
    assert report.flagged == ["score"] and report.score["kind"] == "numeric"


def test_categorical_features_use_psi_over_categories_and_jensen_shannon(version, rng):
    reference = {"plan": rng.choice(PLANS, 400, p=(0.5, 0.3, 0.2)).tolist()}
    set_reference_upload(version, ACTOR, columns=reference)
    current = ["free"] * 40 + ["pro"] * 30 + ["enterprise"] * 30  # a plan never seen before
    log(version, {"plan": current}, [])
    entry = drift.detect_drift(version).features["plan"]
    assert entry["kind"] == "categorical"
    assert entry["categories"] == ["free", "pro", "team", drift.UNSEEN]
    r = np.array([reference["plan"].count(p) / 400 for p in PLANS] + [0])
    c = np.array([0.4, 0.3, 0.0, 0.3])
    assert entry["distance"] == pytest.approx(jensenshannon(r, c, base=2))
    assert entry["psi"] == pytest.approx(drift.psi_of_shares(r, c)) and entry["flagged"]


def test_numbers_with_few_distinct_values_are_categorical_and_many_are_numeric():
    assert drift.profile([1, 2, 3, 2, 1, None] * 10).kind == "categorical"
    assert drift.profile(list(range(11))).kind == "numeric"
    assert drift.profile([True, False]).kind == "categorical"
    assert drift.profile([None, None]) is None
    assert drift.category(1.0) == drift.category(1) == "1" and drift.category(True) == "true"


def test_rare_categories_share_other_and_new_ones_share_unseen():
    reference = [f"c{i}" for i in range(drift.MAX_CATEGORIES) for _ in range(3)] + ["rare"] * 2
    names, r, c = drift.category_shares(reference, ["c0", "rare", "new", "newer"])
    assert names[-2:] == [drift.OTHER, drift.UNSEEN] and len(names) == drift.MAX_CATEGORIES + 2
    assert c[0] == c[-2] == 0.25 and c[-1] == 0.5 and r[-2] == pytest.approx(2 / len(reference))
    names, r, c = drift.category_shares(["a", "b"], ["a"])
    assert names == ["a", "b"] and c.tolist() == [1.0, 0.0]


def test_a_feature_with_too_few_values_in_the_window_is_not_judged(version):
    set_reference_upload(version, ACTOR, columns={"age": [float(v) for v in range(40)]})
    log(version, {"age": [None] * 35 + [1.0] * 5}, [])
    entry = drift.detect_drift(version).features["age"]
    assert entry == {"kind": "numeric", "values": 5, "psi": None, "flagged": False}


def test_quality_counts_nulls_out_of_range_and_schema_violations(version):
    set_reference_upload(
        version,
        ACTOR,
        columns={"age": [float(v) for v in range(20, 60)], "plan": ["free", "pro"] * 20},
    )
    log(
        version,
        {
            "age": [None, None, 10.0, 99.0, "forty"] + [30.0] * 35,
            "plan": ["free"] * 38 + ["gold", 7],
            "device": ["ios"] * 40,  # not in the reference
        },
        [],
    )
    log(version, {"plan": ["pro"] * 10}, [])  # a request without "age"
    report = drift.detect_drift(version)
    assert report.rows_current == 50
    assert report.quality["age"] == {"nulls": 2, "out_of_range": 2, "schema": 11}
    assert report.quality["plan"] == {"nulls": 0, "out_of_range": 1, "schema": 1}
    assert report.quality["device"] == {"nulls": 0, "out_of_range": 0, "schema": 40}
    assert "device" not in report.features


def test_no_report_without_a_reference_or_with_too_few_rows(version, rng):
    log_rows(version, sample(rng, 200))
    assert drift.detect_drift(version) is None  # no reference
    other = make_version(version.model, small_onnx(seed=4), alias=None, feature_names=FEATURES)
    set_reference_upload(other, ACTOR, **sample(rng, 500))
    log_rows(other, sample(rng, MIN_ROWS - 1), per_request=MIN_ROWS)
    # Failed requests and rows older than the window do not count.
    log(other, sample(rng, 50)["columns"], [], status=500)
    old = timezone.now() - timedelta(minutes=other.model.drift_window_minutes + 5)
    log_rows(other, sample(rng, 100), at=old)
    assert drift.detect_drift(other) is None
    assert not DriftReport.objects.exists()


def test_drift_raises_an_alert_and_resolves_it_when_the_window_is_steady(referenced, rng):
    now = timezone.now()
    log_rows(referenced, sample(rng, 500, age_mean=55), at=now - timedelta(minutes=10))
    drift.detect_drift(referenced, now)
    alert = Alert.objects.get(kind="drift", resolved_at=None)
    assert alert.key == f"drift:{referenced.pk}" and alert.tenant_id == referenced.model.tenant_id
    assert "age PSI" in alert.message and "threshold 0.2" in alert.message
    # An hour later the window holds only steady traffic.
    later = now + timedelta(minutes=70)
    log_rows(referenced, sample(rng, 500), at=later - timedelta(minutes=5))
    report = drift.detect_drift(referenced, later)
    assert report.flagged == []
    alert.refresh_from_db()
    assert alert.resolved_at is not None


def test_detect_all_reports_every_version_with_a_reference_and_traffic(referenced, rng, world):
    log_rows(referenced, sample(rng, 300, age_mean=60))
    quiet = make_version(referenced.model, small_onnx(seed=5), alias=None, feature_names=FEATURES)
    set_reference_upload(quiet, ACTOR, **sample(rng, 300))  # a reference, no traffic
    unreferenced = make_version(make_model(world.b, "other"), small_onnx(seed=6))
    log(unreferenced, {"x[0]": [1.0] * 50}, [])
    counts = detect_drift_task()
    assert counts == {"versions": 1, "reports": 1, "flagged": 1, "failed": 0}
    assert DriftReport.objects.get().version == referenced


# References ------------------------------------------------------------------------------------


def test_a_past_window_becomes_the_reference_and_is_audited(version, rng):
    start = timezone.now() - timedelta(days=2)
    log_rows(version, sample(rng, 400), at=start + timedelta(hours=1))
    log_rows(version, sample(rng, 100, age_mean=90), at=start + timedelta(days=1, hours=1))
    reference = drift.set_reference_window(version, start, start + timedelta(hours=2), ACTOR)
    assert (reference.source, reference.rows, len(reference.scores)) == ("window", 400, 400)
    assert max(reference.columns["age"]) < 90
    event = AuditEvent.objects.get(action="drift.reference")
    assert event.after["source"] == "window" and event.target == "clf v1"
    log_rows(version, sample(rng, 300))
    report = drift.detect_drift(version)
    assert report.reference_source == "window" and report.flagged == []


def test_a_window_with_too_few_rows_or_backwards_is_refused(version, rng):
    start = timezone.now() - timedelta(hours=3)
    log_rows(version, sample(rng, 10), at=start + timedelta(minutes=5))
    with pytest.raises(ValidationError, match="10 logged rows"):
        drift.set_reference_window(version, start, start + timedelta(hours=1), ACTOR)
    with pytest.raises(ValidationError, match="after window_start"):
        drift.set_reference_window(version, start, start - timedelta(hours=1), ACTOR)


def test_an_upload_with_personal_or_unknown_features_is_refused(version, rng):
    version.personal_fields = {"income": "hash"}
    with pytest.raises(ValidationError, match="personal"):
        set_reference_upload(version, ACTOR, **sample(rng, 50))
    with pytest.raises(ValidationError, match="unknown features"):
        set_reference_upload(version, ACTOR, columns={"agee": [1.0] * 50})


def test_expected_features_follow_the_prediction_log(world, onnx_bytes):
    model = make_model(world.a, "plain")
    plain = make_version(model, onnx_bytes)
    assert expected_features(plain) == ["x[0]", "x[1]", "x[2]", "x[3]"]


# Guardrails and approvals ----------------------------------------------------------------------


@pytest.fixture
def plan(world, onnx_bytes, rng):
    model = make_model(world.a, "clf")
    make_version(model, onnx_bytes, feature_names=FEATURES)
    candidate = make_version(model, small_onnx(seed=2), alias=None, feature_names=FEATURES)
    set_reference_upload(candidate, ACTOR, **sample(rng, 1000))
    return actions.start_plan(
        model, "canary", candidate, RAILS, ACTOR, weight=5, steps=[5, 50, 100], bake_seconds=60
    )


def healthy_traffic(plan) -> None:
    for version_id in (plan.baseline_id, plan.candidate_id):
        counts = Counts()
        for _ in range(500):
            counts.add(0.004, ok=True)
        TrafficSample.objects.create(
            version_id=version_id,
            window_end=timezone.now(),
            requests=500,
            errors=0,
            latency_buckets=counts.buckets,
        )


def test_input_drift_that_hits_both_arms_does_not_roll_the_candidate_back(plan, rng):
    # The traffic itself moved (age +20 years): against its reference the candidate drifted,
    # which the former guardrail rolled back for; against the baseline on the same traffic it
    # behaves the same, so the plan goes on.
    healthy_traffic(plan)
    now = timezone.now()
    log_rows(plan.baseline, sample(rng, 400, age_mean=60), at=now)
    log_rows(plan.candidate, sample(rng, 400, age_mean=60), at=now)
    assert drift.detect_drift(plan.candidate).flagged == ["age"]
    verdict = evaluate(plan)
    assert verdict.action == "hold", verdict.reason  # healthy, baking
    plan.refresh_from_db()
    assert plan.state == PlanState.RUNNING


def test_a_candidate_whose_scores_differ_from_the_baselines_is_rolled_back(plan, rng):
    healthy_traffic(plan)
    now = timezone.now()
    log_rows(plan.baseline, sample(rng, 400), at=now)
    log_rows(plan.candidate, sample(rng, 400, score_a=6.0), at=now)  # same inputs, new scores
    verdict = evaluate(plan)
    assert verdict.action == "rollback"
    assert verdict.reason.startswith("drift: score PSI") and "threshold 0.2" in verdict.reason
    assert "vs the baseline's on the same traffic" in verdict.reason
    plan.refresh_from_db()
    assert plan.state == PlanState.ROLLED_BACK
    assert "score PSI" in AuditEvent.objects.get(action="plan.rollback").reason


def test_the_plans_own_drift_limit_wins_and_null_turns_it_off(plan, rng):
    healthy_traffic(plan)
    now = timezone.now()
    log_rows(plan.baseline, sample(rng, 400), at=now)
    log_rows(plan.candidate, sample(rng, 400, score_a=6.0), at=now)
    measured = drift.compare_arms(plan.baseline_id, plan.candidate_id, plan.created_at, now, 0.2)
    assert measured is not None and measured.score_psi is not None
    plan.guardrails = RAILS | {"max_drift_psi": measured.score_psi + 1}
    assert evaluate(plan).action == "hold"  # healthy, baking
    plan.guardrails = RAILS | {"max_drift_psi": None}
    assert evaluate(plan).action == "hold"
    plan.guardrails = RAILS | {"max_drift_psi": measured.score_psi / 2}
    assert evaluate(plan).action == "rollback"


def test_predictions_from_before_the_plan_do_not_count(plan, rng):
    healthy_traffic(plan)
    before = plan.created_at - timedelta(seconds=1)
    log_rows(plan.baseline, sample(rng, 400), at=before)
    log_rows(plan.candidate, sample(rng, 400, score_a=6.0), at=before)
    assert evaluate(plan).action == "hold"


def test_guardrails_accept_an_optional_drift_limit():
    assert actions.check_guardrails(RAILS | {"max_drift_psi": 0.3})
    assert actions.check_guardrails(RAILS | {"max_drift_psi": None})
    with pytest.raises(ValidationError, match="max_drift_psi"):
        actions.check_guardrails(RAILS | {"max_drift_psi": -1})
    with pytest.raises(ValidationError, match="exactly"):
        actions.check_guardrails({"max_drift_psi": 0.3})


def test_approval_evidence_carries_the_candidates_latest_drift(plan, rng):
    request = request_promotion(plan.model, None, ACTOR, plan=plan)
    assert evidence_now(request)["drift"] is None
    log_rows(plan.candidate, sample(rng, 400, age_mean=60), at=timezone.now())
    report = drift.detect_drift(plan.candidate)
    shown = evidence_now(request)["drift"]
    assert shown["report"] == report.pk and shown["flagged"] == ["age"]
    assert shown["max_psi"] == pytest.approx(report.max_psi, abs=1e-4) and shown["rows"] == 400


# API -------------------------------------------------------------------------------------------


def key_client(key: str) -> APIClient:
    client = APIClient()
    client.default_format = "json"
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


def as_user(user) -> APIClient:
    client = APIClient()
    client.default_format = "json"
    client.force_login(user)
    return client


REFERENCE_URL = "/api/v1/models/clf/versions/1/reference"


def rows_of(data: dict) -> list[dict]:
    columns = data["columns"]
    return [
        dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)
    ]


def test_reference_upload_as_rows_or_columns_and_its_summary(world, version, rng):
    api = key_client(world.key_a)
    assert api.get(REFERENCE_URL).status_code == 404
    data = sample(rng, 100)
    put = api.put(REFERENCE_URL, {"rows": rows_of(data), "scores": data["scores"]})
    assert put.status_code == 200, put.json()
    body = api.get(REFERENCE_URL).json()
    assert (body["source"], body["rows"], body["scores"], body["version"]) == (
        "upload",
        100,
        100,
        1,
    )
    assert body["features"]["age"]["kind"] == "numeric" and body["features"]["age"]["values"] == 100
    assert set(body["features"]["plan"]["categories"]) <= set(PLANS)
    columns = api.put(REFERENCE_URL, {"columns": data["columns"]})
    assert columns.status_code == 200 and columns.json()["scores"] == 0
    assert AuditEvent.objects.filter(action="drift.reference").count() == 2


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({}, "rows' or 'columns"),
        ({"rows": [{"age": 1}], "columns": {"age": [1]}}, "rows' or 'columns"),
        ({"columns": {"age": [1.0] * 40, "plan": ["a"] * 39}}, "columns: columns differ"),
        ({"columns": {"age": [1.0] * 5}}, "columns: needs 30"),
        ({"columns": {"agee": [1.0] * 40}}, "columns: unknown features ['agee']"),
        ({"columns": {"age": [[1, 2]] * 40}}, "columns: age: values must be"),
        ({"rows": ["nope"]}, "rows"),
        ({"columns": {"age": [1.0] * 40}, "scores": [0.5]}, "scores: has 1 values"),
        ({"columns": {"age": [1.0] * 40}, "scores": ["high"] * 40}, "scores"),
    ],
)
def test_a_bad_reference_upload_is_a_400_naming_the_problem(world, version, body, named):
    response = key_client(world.key_a).put(REFERENCE_URL, body)
    assert response.status_code == 400 and named in response.json()["error"], response.json()
    assert not ReferenceSample.objects.exists()


def test_reference_from_a_window_over_the_api(world, version, rng):
    start = timezone.now() - timedelta(hours=5)
    log_rows(version, sample(rng, 200), at=start + timedelta(minutes=30))
    api = key_client(world.key_a)
    window = {"window_start": start.isoformat(), "window_end": (start + timedelta(hours=1))}
    response = api.post(REFERENCE_URL, window)
    assert response.status_code == 200, response.json()
    assert (response.json()["source"], response.json()["rows"]) == ("window", 200)
    backwards = api.post(REFERENCE_URL, {"window_start": window["window_end"], "window_end": start})
    assert backwards.status_code == 400 and "window_end" in backwards.json()["error"]
    missing = api.post(REFERENCE_URL, {"window_start": start.isoformat()})
    assert missing.status_code == 400 and "window_end" in missing.json()["error"]


def test_drift_reports_newest_first_filtered_by_version(world, referenced, rng):
    log_rows(referenced, sample(rng, 200))
    now = timezone.now()
    first = drift.detect_drift(referenced, now - timedelta(minutes=1))
    second = drift.detect_drift(referenced, now)
    api = key_client(world.key_a)
    reports = api.get("/api/v1/models/clf/drift").json()
    assert [r["id"] for r in reports] == [second.pk, first.pk]
    assert reports[0]["version"] == 1 and set(reports[0]["features"]) == set(FEATURES)
    assert reports[0]["quality"]["age"] == {"nulls": 0, "out_of_range": 0, "schema": 0}
    assert len(api.get("/api/v1/models/clf/drift?version=1&limit=1").json()) == 1
    assert api.get("/api/v1/models/clf/drift?version=7").status_code == 404
    bad = api.get("/api/v1/models/clf/drift?limit=0")
    assert bad.status_code == 400 and "limit" in bad.json()["error"]


def test_other_tenant_gets_404_on_every_drift_endpoint(world, referenced, rng):
    log_rows(referenced, sample(rng, 100))
    drift.detect_drift(referenced)
    other = key_client(world.key_b)
    window = {"window_start": "2020-01-01T00:00:00Z", "window_end": "2020-01-01T01:00:00Z"}
    assert other.get(REFERENCE_URL).status_code == 404
    assert other.put(REFERENCE_URL, {"columns": {"age": [1.0] * 40}}).status_code == 404
    assert other.post(REFERENCE_URL, window).status_code == 404
    assert other.get("/api/v1/models/clf/drift").status_code == 404
    assert ReferenceSample.objects.get().source == "upload"


def test_viewer_reads_but_cannot_set_the_reference(world, referenced, rng):
    viewer = as_user(world.viewer_a)
    assert viewer.get(REFERENCE_URL).status_code == 200
    assert viewer.get("/api/v1/models/clf/drift").status_code == 200
    assert viewer.put(REFERENCE_URL, {"columns": {"age": [1.0] * 40}}).status_code == 403
    window = {"window_start": "2020-01-01T00:00:00Z", "window_end": "2020-01-01T01:00:00Z"}
    assert viewer.post(REFERENCE_URL, window).status_code == 403
    assert as_user(world.engineer_a).put(REFERENCE_URL, sample(rng, 40)).status_code == 200


def test_openapi_documents_the_drift_endpoints(world):
    paths = key_client(world.key_a).get("/api/schema/", HTTP_ACCEPT="application/json").json()
    paths = paths["paths"]
    assert {"get", "put", "post"} <= set(
        paths["/api/v1/models/{name}/versions/{version}/reference"]
    )
    assert "get" in paths["/api/v1/models/{name}/drift"]


# The reference with the version's upload -------------------------------------------------------


def upload(api, artifact: bytes, reference) -> object:
    data = {"artifact": SimpleUploadedFile("m.onnx", artifact)}
    data["feature_names"] = json.dumps(FEATURES)
    data["reference"] = reference
    return api.post("/api/v1/models/clf/versions", data, format="multipart")


def test_a_version_uploads_with_its_reference_as_json_or_csv(world, onnx_bytes, rng):
    make_model(world.a, "clf")
    api = key_client(world.key_a)
    data = sample(rng, 60)
    response = upload(api, onnx_bytes, json.dumps(data))
    assert response.status_code == 201, response.json()
    assert ReferenceSample.objects.get(version__version=1).rows == 60
    lines = ["age,plan,_score"] + [f"{30 + i % 20},{PLANS[i % 3]},0.{i % 9}" for i in range(40)]
    lines[1] = "1e400,,0.5"  # non-finite and empty cells are nulls
    csv_file = SimpleUploadedFile("ref.csv", "\n".join(lines).encode(), "text/csv")
    response = upload(api, onnx_bytes, csv_file)
    assert response.status_code == 201, response.json()
    reference = ReferenceSample.objects.get(version__version=2)
    assert reference.columns["age"][:2] == [None, 31] and reference.columns["plan"][0] is None
    assert reference.scores[1] == 0.1 and len(reference.scores) == 40


@pytest.mark.parametrize(
    ("reference", "named"),
    [
        ("{nope", "reference: must be JSON"),
        (json.dumps({"columns": {"age": [1.0] * 3}}), "reference.columns: needs 30"),
        (json.dumps({"columns": {"agee": [1.0] * 40}}), "reference: unknown features"),
    ],
)
def test_a_version_with_a_bad_reference_is_refused_whole(world, onnx_bytes, reference, named):
    make_model(world.a, "clf")
    response = upload(key_client(world.key_a), onnx_bytes, reference)
    assert response.status_code == 400 and named in response.json()["error"], response.json()
    assert not ModelVersion.objects.exists() and not ReferenceSample.objects.exists()


def test_drift_reports_past_their_history_are_purged(referenced, rng, settings):
    from monitoring.drift import purge_reports

    log_rows(referenced, sample(rng, 300))
    report = drift.detect_drift(referenced)
    assert report is not None
    settings.SWITCHYARD_DRIFT_HISTORY_DAYS = 30
    assert purge_reports(timezone.now() + timedelta(days=29)) == 0
    assert purge_reports(timezone.now() + timedelta(days=31)) == 1
    assert not DriftReport.objects.filter(pk=report.pk).exists()
