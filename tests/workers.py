"""Gives every pytest run a var directory of its own, and each pytest-xdist worker its own var
directory and Redis database.

Loaded with ``-p tests.workers`` (pyproject's addopts) so that it runs before Django reads its
settings. Without it a plain ``pytest tests/test_x.py`` would use the repository's ``var/``
(media, the file broker's folder, the secret and metrics-token files): beside a running
``make up`` it would share that platform's broker. A caller who sets ``SWITCHYARD_VAR_DIR``
keeps it (xdist workers then each take a folder inside it). The test databases are already one
per worker (pytest-django), but uploaded artifacts, pool tokens and the keys of the rate limiter
and the stream budgets would otherwise be shared between workers whose tenants have the same ids.
"""

import atexit
import os
import shutil
import tempfile


def _own_dir(prefix: str, parent: str | None = None) -> str:
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    atexit.register(shutil.rmtree, path, True)
    return path


worker = os.environ.get("PYTEST_XDIST_WORKER")
given = os.environ.get("SWITCHYARD_VAR_DIR")
if worker:
    number = int(worker.removeprefix("gw"))
    # The controller (this module, loaded there first) already chose the run's folder.
    os.environ["SWITCHYARD_VAR_DIR"] = _own_dir(f"switchyard-{worker}-", given)
else:
    number = 0
    if not given:
        os.environ["SWITCHYARD_VAR_DIR"] = _own_dir("switchyard-test-")
redis_url = os.environ.get("REDIS_URL")
if redis_url:
    # From the top (a plain run as worker gw0): the end-to-end harness hands out databases from
    # 1 up to its backends, and a platform beside the tests (`make up`) keeps its own 0.
    os.environ["REDIS_URL"] = f"{redis_url.rsplit('/', 1)[0]}/{15 - number}"
