"""Every test run has a var directory of its own (tests/workers.py), with or without xdist:
never the repository's var/, whose broker folder, media and secret files a running `make up`
uses."""

import os
import subprocess
import sys
from pathlib import Path

from django.conf import settings

ROOT = Path(__file__).resolve().parents[1]


def test_this_run_does_not_use_the_repositorys_var_dir():
    repo_var = (ROOT / "var").resolve()
    var_dir = Path(settings.SWITCHYARD_VAR_DIR).resolve()
    assert var_dir != repo_var
    assert not var_dir.is_relative_to(repo_var)
    for path in (settings.MEDIA_ROOT, settings.STATIC_ROOT):
        assert not Path(path).resolve().is_relative_to(repo_var)
    assert os.environ["SWITCHYARD_VAR_DIR"] == str(settings.SWITCHYARD_VAR_DIR)


def chosen_var_dir(env: dict[str, str]) -> str:
    """The var directory tests/workers.py gives a pytest process started with ``env``."""
    code = "import os, tests.workers; print(os.environ['SWITCHYARD_VAR_DIR'])"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_a_plain_run_without_xdist_gets_a_temporary_var_dir():
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env.pop("SWITCHYARD_VAR_DIR", None)
    chosen = Path(chosen_var_dir(env))
    assert chosen.resolve() != (ROOT / "var").resolve()
    assert not chosen.exists()  # removed when that run ends


def test_a_var_dir_the_caller_sets_is_kept(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env["SWITCHYARD_VAR_DIR"] = str(tmp_path)
    assert chosen_var_dir(env) == str(tmp_path)
    # An xdist worker takes a folder of its own inside it.
    worker = Path(chosen_var_dir(env | {"PYTEST_XDIST_WORKER": "gw3"}))
    assert worker.parent == tmp_path
