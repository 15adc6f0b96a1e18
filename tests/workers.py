"""Gives each pytest-xdist worker a var directory and a Redis database of its own.

Loaded with ``-p tests.workers`` (pyproject's addopts) so that it runs before Django reads its
settings: the test databases are already one per worker (pytest-django), but uploaded
artifacts, pool tokens and the keys of the rate limiter and the stream budgets would otherwise
be shared between workers whose tenants have the same ids.
"""

import os
import tempfile

worker = os.environ.get("PYTEST_XDIST_WORKER")
if worker:
    number = int(worker.removeprefix("gw"))
    os.environ["SWITCHYARD_VAR_DIR"] = tempfile.mkdtemp(prefix=f"switchyard-{worker}-")
    redis_url = os.environ.get("REDIS_URL")
    if redis_url:
        # From the top: the end-to-end harness hands out databases from 1 up to its backends.
        os.environ["REDIS_URL"] = f"{redis_url.rsplit('/', 1)[0]}/{15 - number}"
