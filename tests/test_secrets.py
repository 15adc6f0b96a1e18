"""Secrets and exposure: each install generates its own secrets in 0600 files, the database
file is 0600, the production settings pass ``check --deploy``, a new API key or node token
travels in no cookie, and sign-in is throttled per username and address, audited."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from axes.models import AccessAttempt
from django.test import Client, override_settings

from fleet.models import Node
from platform_site.secret_files import install_secret, private_file, write_private
from tenants.models import AuditEvent, Role
from tests.factories import make_member, make_tenant

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# The public string settings.py used to ship as the default SECRET_KEY.
OLD_PUBLIC_KEY = "switchyard-embedded-dev-key-change-me-in-production"
SECRET_NAMES = ("SECRET_KEY", "SWITCHYARD_METRICS_TOKEN", "SWITCHYARD_METRICS_PUBLIC")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_an_install_secret_is_made_once_0600_and_every_racer_reads_the_same(tmp_path):
    path = tmp_path / "secret_key"
    with ThreadPoolExecutor(16) as pool:
        values = set(pool.map(lambda _: install_secret(path, 50), range(64)))
    (value,) = values
    assert len(value) >= 50 and mode(path) == 0o600
    assert install_secret(path) == value  # kept across starts
    assert [p.name for p in tmp_path.iterdir()] == ["secret_key"]  # no temporary file left
    assert install_secret(tmp_path / "other") != value  # per install


def test_an_older_world_readable_secret_file_is_narrowed(tmp_path):
    path = tmp_path / "metrics-token"
    path.write_text("kept\n")
    path.chmod(0o644)
    assert install_secret(path) == "kept" and mode(path) == 0o600
    db = tmp_path / "switchyard.sqlite3"
    db.write_bytes(b"")
    db.chmod(0o644)
    private_file(db)
    assert mode(db) == 0o600


def test_sqlite_gives_its_wal_and_shm_files_the_database_files_mode(tmp_path):
    db = private_file(tmp_path / "switchyard.sqlite3")
    old = os.umask(0o022)  # the usual umask: files would be world-readable without ours
    try:
        with sqlite3.connect(db) as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("CREATE TABLE t (x)")
            conn.execute("INSERT INTO t VALUES ('password hash')")
            assert {p.name: mode(p) for p in tmp_path.iterdir()} == {
                "switchyard.sqlite3": 0o600,
                "switchyard.sqlite3-wal": 0o600,
                "switchyard.sqlite3-shm": 0o600,
            }
    finally:
        os.umask(old)


def test_a_private_write_is_never_wider_than_0600(tmp_path):
    path = tmp_path / "demo.json"
    path.write_text("{}")
    path.chmod(0o644)
    write_private(path, '{"api_key": "sy_x"}')
    assert path.read_text() == '{"api_key": "sy_x"}' and mode(path) == 0o600


def manage(var_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """manage.py in a fresh process, as a new install: its own var/, none of our secrets."""
    clean = {k: v for k, v in os.environ.items() if k not in SECRET_NAMES}
    clean.pop("DATABASE_URL", None)
    clean.pop("REDIS_URL", None)
    clean.update(SWITCHYARD_VAR_DIR=str(var_dir), DJANGO_SETTINGS_MODULE="platform_site.settings")
    clean.update(env)
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
    )


PRINT_SECRETS = (
    "from django.conf import settings as s; print(s.SECRET_KEY); print(s.SWITCHYARD_METRICS_TOKEN)"
)


def secrets_of(var_dir: Path, **env: str) -> list[str]:
    """[SECRET_KEY, SWITCHYARD_METRICS_TOKEN] as a process started on var_dir sees them."""
    done = manage(var_dir, "shell", "-v", "0", "-c", PRINT_SECRETS, **env)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\n")[:2]


def test_a_new_install_generates_its_own_secret_key_and_metrics_token(tmp_path):
    secret_key, metrics_token = secrets_of(tmp_path)
    assert secret_key != OLD_PUBLIC_KEY and len(secret_key) >= 50 and metrics_token
    assert (tmp_path / "secret_key").read_text().strip() == secret_key
    assert (tmp_path / "metrics-token").read_text().strip() == metrics_token
    for name in ("secret_key", "metrics-token", "switchyard.sqlite3"):
        assert mode(tmp_path / name) == 0o600, name
    # The next start reads the same; another install has its own.
    assert secrets_of(tmp_path) == [secret_key, metrics_token]
    other = tmp_path / "other"
    other.mkdir()
    assert set(secrets_of(other)).isdisjoint({secret_key, metrics_token})
    # The environment still wins, and public metrics (an internal-only port) need no token.
    key = "k" * 60 + "ey-from-env"
    assert secrets_of(tmp_path, SECRET_KEY=key, SWITCHYARD_METRICS_PUBLIC="on") == [key, ""]
    assert secrets_of(tmp_path, SWITCHYARD_METRICS_TOKEN="given")[1] == "given"


def production_settings() -> dict[str, str]:
    """The variables README's "Production settings" block lists, with its placeholders."""
    text = README.read_text()
    block = text.split("### Production settings", 1)[1].split("```bash", 1)[1].split("```")[0]
    env = {}
    for line in block.splitlines():
        line = line.strip()
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            env[name] = value.strip("'\"")
    return env


def test_check_deploy_is_clean_with_the_documented_production_settings(tmp_path):
    env = production_settings()
    assert {"SECURE_SSL_REDIRECT", "SECURE_HSTS_SECONDS", "ALLOWED_HOSTS"} <= set(env)
    # The documented command substitutions, run here as an operator's shell would.
    env = {k: v for k, v in env.items() if not v.startswith("$(")}
    env.pop("DATABASE_URL", None)  # the deploy checks do not connect
    env.pop("REDIS_URL", None)
    done = manage(tmp_path, "check", "--deploy", "--fail-level", "WARNING", **env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no issues" in done.stdout
    # Without them the same check fails (so the test above can fail), yet the embedded
    # default starts as it is.
    bare = manage(tmp_path, "check", "--deploy", "--fail-level", "WARNING")
    assert bare.returncode != 0 and "security.W004" in bare.stderr
    assert manage(tmp_path, "check").returncode == 0


@pytest.fixture
def root_client(db, django_user_model):
    user = django_user_model.objects.create_superuser("root", "root@example.com", "pw-root-123")
    client = Client()
    client.force_login(user)
    return client


def no_cookie_holds(response, secret: str) -> None:
    for name, morsel in response.cookies.items():
        assert secret not in morsel.value, f"the {name} cookie carries the secret"
    assert "no-store" in response["Cache-Control"]


def test_a_new_api_key_is_shown_in_the_response_itself_and_no_cookie_carries_it(root_client):
    tenant = make_tenant("acme")
    response = root_client.post("/admin/tenants/apikey/add/", {"tenant": tenant.pk, "name": "ci"})
    assert response.status_code == 200
    page = response.content.decode()
    raw = page.split("<code>", 1)[1].split("</code>", 1)[0]
    assert raw.startswith("sy_")
    no_cookie_holds(response, raw)
    # Nothing is left to show on the next page either (no message stored for later).
    assert raw not in root_client.get("/admin/tenants/apikey/").content.decode()


def test_a_new_or_rotated_node_token_travels_in_no_cookie(root_client):
    created = root_client.post("/admin/fleet/node/add/", {"name": "gpu-1", "enabled": "on"})
    token = created.content.decode().split("<code>", 1)[1].split("</code>", 1)[0]
    assert created.status_code == 200 and token.startswith("syn_")
    no_cookie_holds(created, token)
    node = Node.objects.get(name="gpu-1")
    rotated = root_client.post(
        "/admin/fleet/node/", {"action": "rotate_token", "_selected_action": [node.pk]}
    )
    new = rotated.content.decode().split("<code>", 1)[1].split("</code>", 1)[0]
    assert rotated.status_code == 200 and new.startswith("syn_") and new != token
    no_cookie_holds(rotated, new)


@override_settings(AXES_FAILURE_LIMIT=3)
@pytest.mark.parametrize("login_url", ["/login/", "/admin/login/"])
def test_sign_in_locks_out_a_username_from_any_address_after_failures_audited(db, login_url):
    tenant = make_tenant("acme")
    person = make_member(tenant, "eng-a", Role.APPROVER)
    person.is_staff = True  # the admin's sign-in takes staff only
    person.save()
    attacker = Client(REMOTE_ADDR="203.0.113.7")
    for _ in range(3):
        wrong = attacker.post(login_url, {"username": "eng-a", "password": "guess"})
        assert wrong.status_code in (200, 429)
    # Locked: even the right password is refused...
    locked = attacker.post(login_url, {"username": "eng-a", "password": "pw-eng-a-1"})
    assert locked.status_code == 429 and "_auth_user_id" not in attacker.session
    attacker.post(login_url, {"username": "eng-a", "password": "again"})
    # ...from any address: a new X-Forwarded-For on each attempt (which a proxy the server
    # trusts turns into the client address, REMOTE_ADDR) does not get around it.
    for n in range(5):
        forged = Client(REMOTE_ADDR=f"198.51.100.{n}", HTTP_X_FORWARDED_FOR=f"192.0.2.{n}")
        again = forged.post(login_url, {"username": "eng-a", "password": "pw-eng-a-1"})
        assert again.status_code == 429 and "_auth_user_id" not in forged.session
    # Another username is not locked by it.
    make_member(tenant, "eng-b", Role.ENGINEER)
    other = Client(REMOTE_ADDR="203.0.113.7")
    ok = other.post("/login/", {"username": "eng-b", "password": "pw-eng-b-1"})
    assert ok.status_code == 302 and "_auth_user_id" in other.session
    # One audit event per lockout, in the person's tenant, naming the address; the attempts
    # kept by django-axes hold no password.
    (event,) = AuditEvent.objects.filter(tenant=tenant, action="login.lockout")
    assert event.target == "user:eng-a" and event.after == {"ip_address": "203.0.113.7"}
    for attempt in AccessAttempt.objects.all():
        assert "guess" not in attempt.post_data and "pw-eng-a-1" not in attempt.post_data
