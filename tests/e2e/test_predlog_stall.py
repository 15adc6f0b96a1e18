"""Fault drill: PostgreSQL stalls the prediction log's writes for 5 s under load, with every
request logged (100 % sampling). Requests never wait on the log; the writer keeps each batch
the database does not take and writes it once the lock is gone: every 2xx answer has its log
row, matched by request id, and nothing is dropped."""

from __future__ import annotations

import pytest

from .conftest import make_backend
from .db_stall_drill import STALL_SEED, run_stall_drill

pytestmark = [pytest.mark.e2e, pytest.mark.serial]


def test_a_5_s_database_stall_loses_no_logged_prediction(tmp_path):
    backend = make_backend("services", tmp_path, STALL_SEED)
    try:
        result = run_stall_drill(backend, stall_s=5.0, before_s=1.5, after_s=1.5)
    finally:
        backend.close()
    print(result.table())
    assert result.during_stall > 100, "the load must go on through the stall"
    assert result.failed == 0, result.statuses
    # The stall reached the writer (its lock timeout is 2 s: batches were refused and kept) ...
    assert result.retries >= 1
    # ... and cost nothing: every 2xx has its row and the writer dropped nothing.
    assert result.lost == 0
    assert sum(result.dropped.values()) == 0, result.dropped
