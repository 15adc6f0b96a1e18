"""Batch jobs (batch.jobs, batch.api): submission and its checks in each format, chunk planning,
the chunk loop with exactly-once output (leases that run out, stale workers), bad rows,
budgets, pause/resume/cancel, progress and the deadline verdict, the job's derived key, roles,
scopes, tenant isolation and audit events, and hostile submissions.

The chunks' requests go to ``FrontDoor``, an httpx transport that answers the OIP v2 infer
route as the gateway does (the job's key checked with ``identify_key``, the rows run through
ONNX Runtime in process); the e2e module sends them to the real platform and agents.
"""

from __future__ import annotations

import io
import json
import re
from datetime import timedelta

import httpx
import numpy as np
import onnxruntime as ort
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from django.core.files.storage import default_storage
from django.utils import timezone

from batch import jobs
from batch.models import Chunk, ChunkState, Job, JobState
from monitoring.models import Budget
from tenants.keys import derive_raw_key, identify_key
from tenants.models import ApiKey, AuditEvent, KeyPriority
from tests.factories import as_user, key_client, make_key, make_member, make_model, make_version
from tests.onnx_models import small_onnx

FEATURES = ["a", "b", "c", "d"]
POISON = 666.0  # a value the front door refuses with a 400, as a model's own check would


class FrontDoor:
    """The platform's OIP v2 infer route, in process: checks the bearer key as the gateway
    does, answers ``script`` first (status, body) pairs, then runs the rows through ONNX
    Runtime. Every request body is kept."""

    def __init__(
        self, artifact: bytes, script: list[tuple[int, dict]] | None = None, check_key: bool = True
    ) -> None:
        self.check_key = check_key
        self.session = ort.InferenceSession(artifact, providers=["CPUExecutionProvider"])
        self.script = list(script or [])
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        raw = request.headers["authorization"].removeprefix("Bearer ")
        if self.check_key and identify_key(raw) is None:
            return httpx.Response(401, json={"error": "invalid API key"})
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.script:
            status, payload = self.script.pop(0)
            return httpx.Response(status, json=payload, headers={"retry-after": "0"})
        (tensor,) = body["inputs"]
        x = np.asarray(tensor["data"], np.float32).reshape(tensor["shape"])
        if (x == POISON).any():
            return httpx.Response(400, json={"error": "inputs.x: a poisoned value"})
        (y,) = self.session.run(None, {"x": x})
        out = {"name": "y", "shape": list(y.shape), "datatype": "FP32", "data": y.ravel().tolist()}
        return httpx.Response(200, json={"outputs": [out]})

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(self))


@pytest.fixture
def batch_settings(settings, tmp_path):
    settings.SWITCHYARD_BATCH_CHUNK_ROWS = 10
    settings.SWITCHYARD_BATCH_REQUEST_ROWS = 4
    # One request at a time: the front door checks the key in the test's transaction, which
    # the runner's threads (two or more in flight) would not see.
    settings.SWITCHYARD_BATCH_IN_FLIGHT = 1
    settings.SWITCHYARD_BATCH_RETRIES = 3
    settings.STORAGES = {
        **settings.STORAGES,
        "default": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(tmp_path)},
        },
    }
    return settings


@pytest.fixture
def clf(world, batch_settings):
    artifact = small_onnx()
    make_version(make_model(world.a, "clf"), artifact, feature_names=FEATURES)
    return artifact


def _rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 4)).astype(np.float32)


def _jsonl(x: np.ndarray) -> bytes:
    return b"".join(
        json.dumps(dict(zip(FEATURES, map(float, r), strict=True))).encode() + b"\n" for r in x
    )


def _csv(x: np.ndarray) -> bytes:
    lines = [",".join(FEATURES)] + [",".join(repr(float(v)) for v in r) for r in x]
    return ("\n".join(lines) + "\n").encode()


def _parquet(x: np.ndarray) -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.table({f: x[:, i] for i, f in enumerate(FEATURES)}), out)
    return out.getvalue()


ENCODE = {"jsonl": _jsonl, "csv": _csv, "parquet": _parquet}


def _submit(client, data: bytes, fmt: str = "jsonl", **fields):
    upload = io.BytesIO(data)
    upload.name = f"input.{fmt}"
    body = {"model": "clf", "format": fmt, "file": upload, **fields}
    return client.post("/api/v1/jobs", body, format="multipart")


def _run(job_id: int, door: FrontDoor) -> int:
    """Run the job's chunk loop to its end in this thread, as the Celery tasks would."""
    ran = 0
    while (chunk := jobs.claim_chunk(job_id)) is not None:
        jobs.run_chunk(chunk, door.client())
        ran += 1
    jobs.finish_job(job_id)
    return ran


def _expected(artifact: bytes, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(artifact, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _output(client, job_id: int) -> list[dict]:
    response = client.get(f"/api/v1/jobs/{job_id}/output")
    assert response.status_code == 200, response.content
    return [json.loads(line) for line in b"".join(response.streaming_content).splitlines()]


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_a_job_in_each_format_answers_every_row_as_onnxruntime_does(world, clf, fmt):
    x = _rows(25)
    client = key_client(world.key_a)
    response = _submit(client, ENCODE[fmt](x), fmt)
    assert response.status_code == 201, response.json()
    body = response.json()
    assert (body["state"], body["rows_total"], body["version"], body["alias"]) == (
        "queued",
        25,
        1,
        "production",
    )
    door = FrontDoor(clf)
    assert _run(body["id"], door) == 3  # chunks of 10, 10 and 5 rows

    status = client.get(f"/api/v1/jobs/{body['id']}").json()
    assert (status["state"], status["rows_done"], status["rows_failed"]) == ("succeeded", 25, 0)
    assert status["progress"]["percent"] == 100.0 and status["progress"]["eta_s"] == 0.0
    lines = _output(client, body["id"])
    assert [line["row"] for line in lines] == list(range(25))
    got = np.array([line["outputs"]["y"] for line in lines], np.float32)
    np.testing.assert_allclose(got, _expected(clf, x), rtol=1e-5, atol=1e-6)
    # Requests of at most 4 rows at the batch priority class.
    assert all(b["parameters"] == {"priority": "batch"} for b in door.bodies)
    assert max(b["inputs"][0]["shape"][0] for b in door.bodies) == 4


def test_requests_of_a_chunk_go_several_at_once(world, clf, batch_settings):
    batch_settings.SWITCHYARD_BATCH_IN_FLIGHT = 3
    client = key_client(world.key_a)
    x = _rows(10)
    job_id = _submit(client, _jsonl(x)).json()["id"]
    door = FrontDoor(clf, check_key=False)
    _run(job_id, door)
    got = np.array([line["outputs"]["y"] for line in _output(client, job_id)], np.float32)
    np.testing.assert_allclose(got, _expected(clf, x), rtol=1e-5, atol=1e-6)
    assert sorted(b["inputs"][0]["shape"][0] for b in door.bodies) == [2, 4, 4]


def test_chunks_cover_the_input_once_in_order(world, clf, batch_settings):
    batch_settings.SWITCHYARD_BATCH_CHUNK_ROWS = 7
    job_id = _submit(key_client(world.key_a), _jsonl(_rows(23))).json()["id"]
    ranges = list(Chunk.objects.filter(job_id=job_id).values_list("index", "start_row", "end_row"))
    assert ranges == [(0, 0, 7), (1, 7, 14), (2, 14, 21), (3, 21, 23)]
    # Each chunk starts reading at its own first row, never reading the rows before it.
    data = _jsonl(_rows(23))
    starts = Chunk.objects.filter(job_id=job_id).values_list("start_byte", flat=True)
    assert list(starts) == [
        len(b"".join(data.splitlines(keepends=True)[:n])) for n in (0, 7, 14, 21)
    ]


def test_parquet_row_groups_and_csv_quoted_newlines_split_into_chunks_exactly(
    world, clf, batch_settings
):
    batch_settings.SWITCHYARD_BATCH_CHUNK_ROWS = 4
    x = _rows(11)
    out = io.BytesIO()
    pq.write_table(pa.table({f: x[:, i] for i, f in enumerate(FEATURES)}), out, row_group_size=3)
    client = key_client(world.key_a)
    job_id = _submit(client, out.getvalue(), "parquet").json()["id"]
    _run(job_id, FrontDoor(clf))
    got = np.array([line["outputs"]["y"] for line in _output(client, job_id)], np.float32)
    np.testing.assert_allclose(got, _expected(clf, x), rtol=1e-5, atol=1e-6)

    # A quoted cell holding a newline is one field of one row (and fails as a number).
    lines = _csv(x).decode().splitlines()
    lines[5] = '"1\n2",0,0,0'
    job_id = _submit(client, ("\n".join(lines) + "\n").encode(), "csv").json()["id"]
    _run(job_id, FrontDoor(clf))
    job = Job.objects.get(pk=job_id)
    assert (job.rows_total, job.rows_done, job.rows_failed) == (11, 11, 1)
    errors = client.get(f"/api/v1/jobs/{job_id}/errors").json()["errors"]
    assert [e["row"] for e in errors] == [4] and errors[0]["error"].startswith("a: '1\\n2'")
    assert [line["row"] for line in _output(client, job_id)] == [r for r in range(11) if r != 4]


def test_bad_rows_are_reported_and_the_job_still_succeeds(world, clf):
    good = _jsonl(_rows(3)).splitlines()
    lines = [
        good[0],
        b'{"a": 1, "b": "x", "c": 3, "d": 4}',  # wrong type
        b'{"a": 1, "b": 2, "c": 3}',  # missing feature
        b"{not json",
        good[1],
        json.dumps({"a": POISON, "b": 0, "c": 0, "d": 0}).encode(),  # refused by the model
        b'{"a": 1, "b": 2, "c": 3, "d": 4, "zz": 5}',  # unknown feature
        good[2],
    ]
    client = key_client(world.key_a)
    job_id = _submit(client, b"\n".join(lines) + b"\n").json()["id"]
    _run(job_id, FrontDoor(clf))
    job = Job.objects.get(pk=job_id)
    assert (job.state, job.rows_done, job.rows_failed) == ("succeeded", 8, 5)
    errors = client.get(f"/api/v1/jobs/{job_id}/errors").json()
    assert errors["rows_failed"] == 5
    by_row = {e["row"]: e["error"] for e in errors["errors"]}
    assert sorted(by_row) == [1, 2, 3, 5, 6]
    assert by_row[1].startswith("b: must be a number")
    assert by_row[2] == "d: missing feature"
    assert by_row[3].startswith("not JSON")
    assert "poisoned" in by_row[5]
    assert by_row[6] == "zz: unknown feature"
    assert [line["row"] for line in _output(client, job_id)] == [0, 4, 7]


def test_a_bad_csv_cell_fails_its_row_only(world, clf):
    data = b"a,b,c,d\n1,2,3,4\n1,two,3,4\n1,2,3\n"
    client = key_client(world.key_a)
    job_id = _submit(client, data, "csv").json()["id"]
    _run(job_id, FrontDoor(clf))
    errors = client.get(f"/api/v1/jobs/{job_id}/errors").json()["errors"]
    assert [(e["row"], e["error"][:10]) for e in errors] == [(1, "b: 'two' i"), (2, "has 3 fiel")]
    assert Job.objects.get(pk=job_id).state == JobState.SUCCEEDED


BAD_SUBMISSIONS = [
    ({"format": "xml"}, _jsonl(_rows(1)), 400, "format"),
    ({"format": "csv"}, b"a,b,c\n1,2,3\n", 400, "lack the feature(s) ['d']"),
    ({"format": "csv"}, b"a,b,c,d,e\n1,2,3,4,5\n", 400, "unknown feature(s) ['e']"),
    ({"format": "csv"}, b"", 400, "empty"),
    ({"format": "csv"}, b"a,b,c,d\n", 400, "no rows"),
    ({"format": "jsonl"}, b"", 400, "no rows"),
    ({"format": "parquet"}, b"PAR1 but not really", 400, "not a Parquet file"),
    ({"format": "csv"}, b"a,b,c,d\n" + b"1" * 200_000 + b",1,1,1\n", 400, "not a readable CSV"),
    ({"version": 9}, _jsonl(_rows(1)), 404, "no version 9"),
    ({"alias": "staging"}, _jsonl(_rows(1)), 404, "no alias"),
    ({"alias": "production", "version": 1}, _jsonl(_rows(1)), 400, "not both"),
    ({"model": "nope"}, _jsonl(_rows(1)), 404, "not found"),
    ({"deadline": "2001-01-01T00:00:00Z"}, _jsonl(_rows(1)), 400, "deadline"),
    ({"deadline": "tomorrow"}, _jsonl(_rows(1)), 400, "deadline"),
    ({"input": "batch-inputs/alpha/x.jsonl"}, _jsonl(_rows(1)), 400, "not both"),
]


@pytest.mark.parametrize(("fields", "data", "status", "says"), BAD_SUBMISSIONS)
def test_a_bad_submission_is_refused_naming_the_problem(world, clf, fields, data, status, says):
    fmt = fields.pop("format", "jsonl")
    response = _submit(key_client(world.key_a), data, fmt, **fields)
    assert response.status_code == status, response.json()
    assert says in response.json()["error"]
    assert not Job.objects.exists()


def test_an_input_past_the_size_limit_is_413(world, clf, batch_settings):
    batch_settings.SWITCHYARD_BATCH_MAX_INPUT_BYTES = 100
    response = _submit(key_client(world.key_a), _jsonl(_rows(10)))
    assert response.status_code == 413 and "larger than 100 bytes" in response.json()["error"]


def test_an_input_in_storage_is_run_by_name_and_only_under_the_tenants_prefix(world, clf):
    x = _rows(12)
    default_storage.save("batch-inputs/alpha/rows.csv", io.BytesIO(_csv(x)))
    default_storage.save("batch-inputs/beta/rows.csv", io.BytesIO(_csv(x)))
    client = key_client(world.key_a)
    by_name = {"model": "clf", "format": "csv"}
    for name, says in [
        ("batch-inputs/beta/rows.csv", "under 'batch-inputs/alpha/'"),
        ("batch-inputs/alpha/../beta/rows.csv", "under"),
        ("batch-inputs/alpha/missing.csv", "no file"),
        ("artifacts/1/x.onnx", "under"),
    ]:
        response = client.post("/api/v1/jobs", {**by_name, "input": name})
        assert response.status_code == 400 and says in response.json()["error"], name
    response = client.post("/api/v1/jobs", {**by_name, "input": "batch-inputs/alpha/rows.csv"})
    assert response.status_code == 201, response.json()
    _run(response.json()["id"], FrontDoor(clf))
    assert len(_output(client, response.json()["id"])) == 12


def test_a_worker_that_died_has_its_chunk_redone_and_no_row_is_lost_or_doubled(world, clf):
    client = key_client(world.key_a)
    job_id = _submit(client, _jsonl(_rows(25))).json()["id"]
    door = FrontDoor(clf)
    first = jobs.claim_chunk(job_id)
    assert first is not None and first.index == 0
    # Its worker dies: while the lease holds, the chunk is nobody else's (one chunk at once).
    assert jobs.claim_chunk(job_id) is None
    later = timezone.now() + timedelta(seconds=61)
    again = jobs.claim_chunk(job_id, now=later)
    assert again is not None and (again.index, again.attempts) == (0, 2)
    assert jobs.reap_stalled(now=later) == 0  # a chunk is at work again
    jobs.run_chunk(again, door.client())
    # The first worker comes back to life and finishes late: its result is not counted.
    assert jobs.complete_chunk(first, []) is False
    _run(job_id, door)
    lines = _output(client, job_id)
    assert [line["row"] for line in lines] == list(range(25))
    assert Job.objects.get(pk=job_id).rows_done == 25


def test_a_stalled_job_is_restarted_by_the_reaper(world, clf, django_capture_on_commit_callbacks):
    job_id = _submit(key_client(world.key_a), _jsonl(_rows(5))).json()["id"]
    assert jobs.claim_chunk(job_id) is not None
    assert jobs.reap_stalled() == 0
    with django_capture_on_commit_callbacks() as queued:
        assert jobs.reap_stalled(now=timezone.now() + timedelta(seconds=61)) == 1
    assert len(queued) == 1


def test_unavailable_answers_are_retried_and_a_budget_refusal_pauses_the_job(world, clf):
    client = key_client(world.key_a)
    job_id = _submit(client, _jsonl(_rows(5))).json()["id"]
    door = FrontDoor(clf, [(503, {"error": "no replica"}), (429, {"error": "rate limited"})])
    _run(job_id, door)
    assert Job.objects.get(pk=job_id).state == JobState.SUCCEEDED
    assert len(door.bodies) == 4  # two refused, then two requests of 4 and 1 rows

    job_id = _submit(client, _jsonl(_rows(25))).json()["id"]
    budget = {"error": "the tenant's monthly budget of 100.00 is spent"}
    door = FrontDoor(clf, [(429, budget)])
    _run(job_id, door)
    job = Job.objects.get(pk=job_id)
    assert (job.state, job.rows_done) == ("paused", 0)
    assert "budget" in job.pause_reason
    assert Chunk.objects.filter(job=job, state=ChunkState.PENDING).count() == 3
    assert AuditEvent.objects.filter(action="job.pause", reason__contains="budget").exists()
    # An approver lifts the budget; the job resumes where it was.
    assert client.post(f"/api/v1/jobs/{job_id}/resume").status_code == 200
    _run(job_id, door)
    assert Job.objects.get(pk=job_id).state == JobState.SUCCEEDED


def test_a_spent_budget_refuses_new_jobs_and_resumes_until_an_override(world, clf):
    client = key_client(world.key_a)
    job_id = _submit(client, _jsonl(_rows(5))).json()["id"]
    assert client.post(f"/api/v1/jobs/{job_id}/pause").status_code == 200
    Budget.objects.create(tenant=world.a, monthly_limit=10, spent=12, hard_stop=True, stopped=True)
    refused = _submit(client, _jsonl(_rows(5)))
    assert refused.status_code == 429 and refused["Retry-After"] == "3600"
    assert "monthly budget of 10.00 USD spent" in refused.json()["error"]
    assert client.post(f"/api/v1/jobs/{job_id}/resume").status_code == 429
    assert Job.objects.count() == 1  # nothing was made by the refused submission
    Budget.objects.update(override_until=timezone.now() + timedelta(hours=1))
    assert _submit(client, _jsonl(_rows(5))).status_code == 201
    assert client.post(f"/api/v1/jobs/{job_id}/resume").status_code == 200


def test_a_job_its_key_cannot_serve_fails_and_the_front_door_giving_up_retries_later(world, clf):
    client = key_client(world.key_a)
    job_id = _submit(client, _jsonl(_rows(5))).json()["id"]
    door = FrontDoor(clf, [(503, {"error": "down"})] * 4)
    chunk = jobs.claim_chunk(job_id)
    jobs.run_chunk(chunk, door.client())  # four refusals: the retries (3) are spent
    chunk.refresh_from_db()
    assert (chunk.state, Job.objects.get(pk=job_id).state) == ("pending", "running")
    door = FrontDoor(clf, [(404, {"error": "model 'clf' has no version 1"})])
    jobs.run_chunk(jobs.claim_chunk(job_id), door.client())
    job = Job.objects.get(pk=job_id)
    assert job.state == JobState.FAILED and "404" in job.error
    assert ApiKey.objects.get(pk=job.api_key_id).revoked_at is not None


def test_pause_resume_and_cancel(world, clf):
    client = as_user(world.engineer_a)
    job_id = _submit(client, _jsonl(_rows(25))).json()["id"]
    door = FrontDoor(clf)
    jobs.run_chunk(jobs.claim_chunk(job_id), door.client())
    running = jobs.claim_chunk(job_id)  # the second chunk is at work when the pause comes
    response = client.post(f"/api/v1/jobs/{job_id}/pause")
    assert response.status_code == 200 and response.json()["state"] == "paused"
    assert jobs.claim_chunk(job_id) is None  # no new chunk starts
    jobs.run_chunk(running, door.client())  # the running one finishes
    assert Job.objects.get(pk=job_id).rows_done == 20
    assert client.post(f"/api/v1/jobs/{job_id}/pause").status_code == 409
    assert client.get(f"/api/v1/jobs/{job_id}/output").status_code == 409

    assert client.post(f"/api/v1/jobs/{job_id}/resume").json()["state"] == "running"
    asked = len(door.bodies)
    _run(job_id, door)
    assert len(door.bodies) - asked == 2  # only the last chunk's 5 rows were sent
    assert [line["row"] for line in _output(client, job_id)] == list(range(25))

    job_id = _submit(client, _jsonl(_rows(25))).json()["id"]
    jobs.run_chunk(jobs.claim_chunk(job_id), door.client())
    response = client.post(f"/api/v1/jobs/{job_id}/cancel")
    assert response.status_code == 200 and response.json()["state"] == "cancelled"
    assert jobs.claim_chunk(job_id) is None
    for action in ("pause", "resume", "cancel"):
        assert client.post(f"/api/v1/jobs/{job_id}/{action}").status_code == 409
    job = Job.objects.get(pk=job_id)
    assert job.rows_done == 10 and ApiKey.objects.get(pk=job.api_key_id).revoked_at is not None
    actions = list(
        AuditEvent.objects.filter(action__startswith="job.").values_list("action", flat=True)
    )
    assert sorted(set(actions)) == [
        "job.cancel",
        "job.finish",
        "job.pause",
        "job.resume",
        "job.submit",
    ]


def test_a_cancelled_chunk_stops_at_its_next_round_and_is_not_counted(world, clf, batch_settings):
    batch_settings.SWITCHYARD_BATCH_IN_FLIGHT = 1
    job_id = _submit(key_client(world.key_a), _jsonl(_rows(10))).json()["id"]
    chunk = jobs.claim_chunk(job_id)

    class CancelMidway(FrontDoor):
        def __call__(self, request: httpx.Request) -> httpx.Response:
            answer = super().__call__(request)
            jobs.cancel_job(Job.objects.get(pk=job_id), jobs.SYSTEM)
            return answer

    door = CancelMidway(clf)
    jobs.run_chunk(chunk, door.client())
    assert len(door.bodies) == 1  # one round of one request, then it stopped
    assert Job.objects.get(pk=job_id).rows_done == 0


def test_the_derived_key_is_stored_as_a_hash_rederived_and_revoked_at_the_end(world, clf):
    job_id = _submit(key_client(world.key_a), _jsonl(_rows(3))).json()["id"]
    job = Job.objects.select_related("api_key").get(pk=job_id)
    key = job.api_key
    assert (key.name, key.priority, key.scopes) == (
        f"batch job {job_id}",
        KeyPriority.BATCH,
        ["predict"],
    )
    raw = derive_raw_key(key, jobs.key_context(job_id))
    assert raw == derive_raw_key(key, jobs.key_context(job_id))  # re-derived equal
    assert raw.startswith(f"sy_{key.prefix}_") and raw[len(key.prefix) + 4 :] not in key.key_hash
    assert key.key_hash != raw and len(key.key_hash) == 64  # only the hash is stored
    assert derive_raw_key(key, jobs.key_context(job_id + 1)) != raw  # bound to its job
    identity = identify_key(raw)
    assert identity is not None and identity.priority == KeyPriority.BATCH
    assert identity.created_by_id == key.created_by_id  # acts as the submitter
    event = AuditEvent.objects.get(action="key.create", target__contains=f"batch job {job_id}")
    assert event.reason == "derived secret" and raw not in json.dumps(event.after)
    _run(job_id, FrontDoor(clf))
    assert identify_key(raw) is None  # revoked once the job ended
    assert AuditEvent.objects.filter(action="key.revoke", target__contains=f"batch job {job_id}")


def test_rate_eta_and_the_deadline_verdict(world, clf, django_assert_max_num_queries):
    deadline = timezone.now() + timedelta(minutes=10)
    job_id = _submit(
        key_client(world.key_a), _jsonl(_rows(100)), deadline=deadline.isoformat()
    ).json()["id"]
    job = Job.objects.get(pk=job_id)
    assert jobs.progress(job).on_time is None  # no rate yet
    now = timezone.now()
    # Two chunks of 10 rows done in 4 s: 5 rows/s, 80 rows left: 16 s.
    for index in (0, 1):
        Chunk.objects.filter(job=job, index=index).update(
            state=ChunkState.DONE,
            claimed_at=now - timedelta(seconds=4 - 2 * index),
            finished_at=now - timedelta(seconds=2 - 2 * index),
        )
    Job.objects.filter(pk=job_id).update(state=JobState.RUNNING, rows_done=20)
    job.refresh_from_db()
    p = jobs.progress(job, now)
    assert (p.percent, p.rows_per_s, p.eta_s, p.on_time) == (20.0, 5.0, 16.0, True)
    job.deadline = now + timedelta(seconds=10)  # 16 s more will not make it
    assert jobs.progress(job, now).on_time is False
    job.deadline = now - timedelta(seconds=1)
    assert jobs.deadline_verdict(job, 16.0, now) is False
    job.state = JobState.PAUSED  # a paused job has no ETA
    assert jobs.progress(job, now).eta_s is None
    body = key_client(world.key_a).get(f"/api/v1/jobs/{job_id}").json()
    assert body["progress"]["rows_per_s"] is not None and body["deadline"]
    # The list reads every job's progress in one query, whatever the number of jobs.
    _submit(key_client(world.key_a), _jsonl(_rows(3)))
    with django_assert_max_num_queries(8):
        listed = key_client(world.key_a).get("/api/v1/jobs").json()
    assert [j["progress"]["rows_per_s"] for j in listed] == [None, 5.0]


def test_roles_and_scopes(world, clf):
    data = _jsonl(_rows(3))
    viewer = as_user(world.viewer_a)
    assert _submit(viewer, data).status_code == 403
    predict_only = key_client(make_key(world.a, "predict", scopes=("predict",))[1])
    assert _submit(predict_only, data).status_code == 403
    job_id = _submit(as_user(world.engineer_a), data).json()["id"]
    for client in (viewer, predict_only):
        assert client.get("/api/v1/jobs").json()[0]["id"] == job_id
        assert client.get(f"/api/v1/jobs/{job_id}").status_code == 200
        for action in ("pause", "resume", "cancel"):
            assert client.post(f"/api/v1/jobs/{job_id}/{action}").status_code == 403
    assert as_user(world.outsider).get("/api/v1/jobs").status_code in (403, 404)
    assert key_client("sy_nope_nope").get("/api/v1/jobs").status_code == 401


def test_another_tenants_job_is_a_404_on_every_endpoint(world, clf):
    job_id = _submit(key_client(world.key_a), _jsonl(_rows(3))).json()["id"]
    other = key_client(world.key_b)
    assert other.get("/api/v1/jobs").json() == []
    for path in ("", "/output", "/errors"):
        assert other.get(f"/api/v1/jobs/{job_id}{path}").status_code == 404, path
    for action in ("pause", "resume", "cancel"):
        assert other.post(f"/api/v1/jobs/{job_id}/{action}").status_code == 404, action
    # And tenant B cannot run tenant A's model.
    assert _submit(other, _jsonl(_rows(3))).status_code == 404
    assert Job.objects.get(pk=job_id).state == JobState.QUEUED


HOSTILE = [
    b"",
    b"null",
    b"[]",
    b'"x"',
    b"{",
    b'{"model": null, "format": "jsonl"}',
    b'{"model": ["clf"], "format": "jsonl", "input": "batch-inputs/alpha/x"}',
    b'{"model": "clf", "format": {"a": 1}, "input": "batch-inputs/alpha/x"}',
    b'{"model": "clf", "format": "jsonl", "input": "batch-inputs/alpha/\\u0000"}',
    b'{"model": "clf", "format": "jsonl", "input": "/etc/passwd"}',
    b'{"model": "clf\\u0000", "format": "jsonl", "input": "batch-inputs/alpha/x"}',
    b'{"model": "clf", "format": "jsonl", "version": 99999999999999999999}',
    b'{"model": "clf", "format": "jsonl", "version": -1, "input": "x"}',
    b'{"model": "clf", "format": "jsonl", "alias": "\\ud800", "input": "x"}',
    b'{"model": "clf", "format": "jsonl", "deadline": 12, "input": "x"}',
    b'{"model": "' + b"a" * 5000 + b'", "format": "jsonl", "input": "x"}',
    b"[" * 5000,
]


def test_hostile_submissions_get_a_4xx_never_a_5xx(world, clf, rng):
    client = key_client(world.key_a)
    bodies = list(HOSTILE)
    for _ in range(40):  # random bytes and random mutations of a valid body
        valid = bytearray(b'{"model": "clf", "format": "csv", "input": "batch-inputs/alpha/a"}')
        for i in rng.integers(0, len(valid), 3):
            valid[i] = int(rng.integers(0, 256))
        bodies += [bytes(valid), rng.bytes(int(rng.integers(1, 200)))]
    for body in bodies:
        response = client.generic("POST", "/api/v1/jobs", body, "application/json")
        assert 400 <= response.status_code < 500, (body[:80], response.status_code)
        assert "error" in response.json()
    for data in [b"\xff\xfe" * 50, b"a,b,c,d\n" + b"\x00" * 100, b'{"a":' * 1000]:
        for fmt in ("jsonl", "csv", "parquet"):
            response = _submit(client, data, fmt)
            assert response.status_code < 500, (fmt, data[:20])


def test_the_jobs_pages_list_submit_show_progress_and_act(world, clf):
    engineer = as_user(world.engineer_a)
    upload = io.BytesIO(_csv(_rows(12)))
    upload.name = "rows.csv"
    form = {"model": "clf", "format": "csv", "alias": "", "version": "", "file": upload}
    response = engineer.post("/jobs/", form, format="multipart")
    assert response.status_code == 302, response.content
    job_id = Job.objects.get().pk
    assert response["Location"] == f"/jobs/{job_id}/"
    listing = engineer.get("/jobs/").content.decode()
    assert f'data-job-id="{job_id}"' in listing and "<progress" in listing
    assert 'href="/jobs/"' in listing  # the nav link

    page = engineer.get(f"/jobs/{job_id}/").content.decode()
    assert f'data-status-url="/jobs/{job_id}/status/"' in page and 'data-action="pause"' in page
    # Only what a queued job allows: pause and cancel shown, resume hidden.
    assert re.findall(r'data-when="[^"]*" (hidden)?', page) == ["", "hidden", ""]
    status = engineer.get(f"/jobs/{job_id}/status/").json()
    assert (status["state"], status["rows_total"], status["percent"]) == ("queued", 12, 0.0)
    assert engineer.get(f"/jobs/{job_id}/output/").status_code == 409

    assert engineer.post(f"/jobs/{job_id}/pause/").status_code == 302
    assert Job.objects.get().state == JobState.PAUSED
    assert engineer.post(f"/jobs/{job_id}/pause/").status_code == 409
    assert engineer.post(f"/jobs/{job_id}/resume/").status_code == 302
    _run(job_id, FrontDoor(clf))
    assert engineer.get(f"/jobs/{job_id}/status/").json()["percent"] == 100.0
    assert engineer.get(f"/jobs/{job_id}/output/").status_code == 200
    done = engineer.get(f"/jobs/{job_id}/").content.decode()
    assert re.findall(r'data-when="[^"]*" (hidden)?', done) == ["hidden"] * 3  # it has ended

    viewer = as_user(world.viewer_a)
    assert viewer.get(f"/jobs/{job_id}/").status_code == 200
    assert 'data-action="pause"' not in viewer.get(f"/jobs/{job_id}/").content.decode()
    assert viewer.post(f"/jobs/{job_id}/cancel/").status_code == 403
    upload.seek(0)
    assert viewer.post("/jobs/", form, format="multipart").status_code == 403
    upload.seek(0)
    bad = engineer.post("/jobs/", {**form, "format": "xml"}, format="multipart")
    assert bad.status_code == 400 and "format" in bad.content.decode()


def test_another_tenants_job_is_a_404_on_every_page(world, clf, django_user_model):
    job_id = _submit(key_client(world.key_a), _jsonl(_rows(3))).json()["id"]
    other = as_user(make_member(world.b, "eng-b", "engineer"), "beta")
    for path in ("", "status/", "output/"):
        assert other.get(f"/jobs/{job_id}/{path}").status_code == 404, path
    for action in ("pause", "resume", "cancel"):
        assert other.post(f"/jobs/{job_id}/{action}/").status_code == 404, action
    assert f'data-job-id="{job_id}"' not in other.get("/jobs/").content.decode()
