"""Disaster-recovery drill: back up a platform's PostgreSQL database and artifacts, destroy
both, restore them into a fresh database and folder, verify, and print how long each step took.

1. A fresh, migrated PostgreSQL database of its own, filled through the platform's own code:
   a tenant, models with versions whose artifacts are real ONNX files of several sizes
   (``registry.services.create_version``: stored content-addressed, sha256 recorded), then
   prediction-log, feedback and audit rows in bulk.
2. Backup: ``pg_dump --format=directory --jobs`` (a consistent snapshot as of its start) and a
   tar archive of the artifact folder (``MEDIA_ROOT``).
3. Disaster: the database is dropped and the artifact folder deleted.
4. Restore: a new database, ``pg_restore --jobs``, the archive unpacked.
5. Verify: the row count of every table equals the count before; every version's artifact is
   present and its sha256 is the one recorded (and the one hashed before the disaster);
   ``migrate --check`` finds the schema complete; a server started on the restored database
   answers the tenant's old API key with its models.

RTO here is restore + verify + start; RPO is what a real deployment loses between its last
backup and the disaster (the dump interval, or ``archive_timeout`` with WAL archiving; see
docs/operations.md). Run: ``.venv/bin/python bench/restore_drill.py [--log-rows 200000]`` with
``DATABASE_URL`` (an admin URL of the server) and ``REDIS_URL`` set, else the local defaults.
Needs ``pg_dump`` and ``pg_restore`` of the server's major version on the PATH.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/0")

from tests.e2e.harness import (  # noqa: E402
    Backend,
    create_tenant,
    free_port,
    services_backend,
    start_server,
)
from tests.onnx_models import slow_onnx, small_onnx  # noqa: E402

CREATE_VERSIONS = """
from pathlib import Path
from registry.models import Model, TaskKind
from registry.services import create_version
from tenants.models import Tenant
tenant = Tenant.objects.get(slug="drill")
for path in sorted(Path({folder!r}).glob("*.onnx")):
    model, _ = Model.objects.get_or_create(
        tenant=tenant, name=path.stem.split("-")[0], defaults={{"task": TaskKind.CLASSIFIER}}
    )
    create_version(model, path.read_bytes())
"""
# Bulk rows, as the feedback API would leave them (the prediction log itself is Parquet files
# since 2026-12-08, backed up as files: docs/operations.md): one label per drilled request.
FILL = """
INSERT INTO gateway_feedback (tenant_id, request_id, label, received_at)
SELECT (SELECT id FROM tenants_tenant WHERE slug = 'drill'), 'drill-' || g, to_jsonb(g %% 2),
       now() - g * interval '1 second'
FROM generate_series(1, %(rows)s) AS g
"""


class Clock:
    """Named steps and their seconds, in order."""

    def __init__(self) -> None:
        self.steps: dict[str, float] = {}

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        yield
        self.steps[name] = time.perf_counter() - started


def url_of(admin_url: str, name: str) -> str:
    return f"{admin_url.rsplit('/', 1)[0]}/{name}"


def row_counts(url: str) -> dict[str, int]:
    """Exact row counts of every table of the public schema."""
    with psycopg.connect(url) as conn:
        tables = [
            name
            for (name,) in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename"
            )
        ]
        return {t: conn.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}


def artifact_hashes(url: str, media: Path) -> dict[str, str]:
    """{artifact path: sha256 of the file}, for every version's artifact; raises if one is
    missing or does not match the hash the registry recorded."""
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT artifact, sha256 FROM registry_modelversion").fetchall()
    found = {}
    for path, recorded in rows:
        digest = hashlib.sha256((media / path).read_bytes()).hexdigest()
        if digest != recorded:
            raise AssertionError(f"{path}: sha256 {digest} is not the recorded {recorded}")
        found[path] = digest
    return found


def run(args: list[str]) -> None:
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{args[0]} failed:\n{done.stderr[-3000:]}")


def fill(backend: Backend, tmp: Path, log_rows: int) -> str:
    """The tenant, its models and versions (artifacts of 3 sizes), and bulk rows; returns the
    tenant's API key."""
    key = create_tenant(backend, "drill")
    folder = tmp / "uploads"
    folder.mkdir()
    for i in range(8):
        (folder / f"small-{i}.onnx").write_bytes(small_onnx(seed=i))
    for i, width in enumerate((1024, 2048)):
        (folder / f"wide-{i}.onnx").write_bytes(slow_onnx(width=width, depth=2))
    backend.shell(CREATE_VERSIONS.format(folder=str(folder)))
    with psycopg.connect(backend.env["DATABASE_URL"]) as conn:
        conn.execute(FILL, {"rows": log_rows})
    return key


def serves(url: str, key: str, media: Path, tmp: Path) -> bool:
    """A server on the restored database answers the old key with the tenant's models."""
    env = dict(os.environ, DATABASE_URL=url, SWITCHYARD_MEDIA_ROOT=str(media))
    backend = Backend("services", env, tmp)
    backend.env.update(SWITCHYARD_VAR_DIR=str(tmp), DJANGO_SETTINGS_MODULE="platform_site.settings")
    port = free_port()
    server = start_server(backend, "uvicorn", port)
    try:
        got = httpx.get(
            f"http://127.0.0.1:{port}/api/v1/models",
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        body = got.json()
        models = body["results"] if isinstance(body, dict) else body  # paginated or not
        return got.status_code == 200 and len(models) > 0
    finally:
        server.stop()


def drill(log_rows: int, jobs: int) -> tuple[Clock, dict[str, object]]:
    clock = Clock()
    facts: dict[str, object] = {}
    admin_url = os.environ["DATABASE_URL"].replace("postgres://", "postgresql://", 1)
    with tempfile.TemporaryDirectory(prefix="sy-restore-") as tmp_name:
        tmp = Path(tmp_name)
        backend = services_backend(tmp)
        cleanup: list[Callable[[], None]] = [backend.close]
        try:
            source_url = backend.env["DATABASE_URL"].replace("postgres://", "postgresql://", 1)
            media = tmp / "media"
            with clock.step("fill (not part of RTO)"):
                key = fill(backend, tmp, log_rows)
            before_rows = row_counts(source_url)
            before_files = artifact_hashes(source_url, media)

            dump, archive = tmp / "backup" / "db.dump", tmp / "backup" / "artifacts.tar"
            dump.parent.mkdir()
            with clock.step("backup: pg_dump"):
                run(
                    ["pg_dump", "--format=directory", f"--jobs={jobs}", "-f", str(dump), source_url]
                )
            with clock.step("backup: artifacts tar"):
                with tarfile.open(archive, "w") as tar:
                    tar.add(media, arcname="media")

            with clock.step("disaster: drop database, delete artifacts"):
                with psycopg.connect(admin_url, autocommit=True) as conn:
                    name = source_url.rsplit("/", 1)[1]
                    conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
                shutil.rmtree(media)

            restored = f"sy_restored_{uuid.uuid4().hex[:10]}"
            restored_url = url_of(admin_url, restored)

            def drop_restored() -> None:
                with psycopg.connect(admin_url, autocommit=True) as conn:
                    conn.execute(f'DROP DATABASE IF EXISTS "{restored}" WITH (FORCE)')

            cleanup.append(drop_restored)
            restored_media = tmp / "restored"
            with clock.step("restore: create database + pg_restore"):
                with psycopg.connect(admin_url, autocommit=True) as conn:
                    conn.execute(f'CREATE DATABASE "{restored}"')
                run(["pg_restore", f"--jobs={jobs}", "--no-owner", "-d", restored_url, str(dump)])
            with clock.step("restore: artifacts"):
                with tarfile.open(archive) as tar:
                    tar.extractall(restored_media, filter="data")
            restored_media /= "media"

            with clock.step("verify: row counts, artifact hashes, migrations"):
                after_rows = row_counts(restored_url)
                after_files = artifact_hashes(restored_url, restored_media)
                env = dict(backend.env, DATABASE_URL=restored_url)
                Backend("services", env, tmp).manage("migrate", "--check", "--noinput", "-v0")
            with clock.step("verify: a server on it answers the old key"):
                answered = serves(restored_url, key, restored_media, tmp)

            facts.update(
                tables=len(before_rows),
                rows=sum(before_rows.values()),
                log_rows=before_rows.get("gateway_feedback", 0),
                rows_match=before_rows == after_rows,
                differing={
                    t: (n, after_rows.get(t))
                    for t, n in before_rows.items()
                    if after_rows.get(t) != n
                },
                artifacts=len(before_files),
                artifacts_match=before_files == after_files,
                database_mb=round(du(dump) / 2**20, 1),
                artifacts_mb=round(archive.stat().st_size / 2**20, 1),
                serves=answered,
            )
        finally:
            for step in reversed(cleanup):
                step()
    return clock, facts


PG_BIN = Path(os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin"))


def as_postgres(args: list[str]) -> list[str]:
    """initdb and postgres refuse to run as root: run them as the ``postgres`` user then."""
    return ["runuser", "-u", "postgres", "--", *args] if os.geteuid() == 0 else args


def pitr_drill(seconds: float, archive_timeout_s: int) -> dict[str, float]:
    """Continuous archiving, measured: a private PostgreSQL instance (never the shared one)
    with WAL archiving, a base backup, then a client committing a row every 50 ms; the
    instance crashes (``pg_ctl stop -m immediate``) and its data directory is deleted; the
    base backup is restored with the archive replayed. RPO: the seconds of committed rows the
    restore does not have; RTO: copy the base backup + replay + accepting connections."""
    work = Path(tempfile.mkdtemp(prefix="sy-pitr-"))
    data, base, archive = work / "data", work / "base", work / "archive"
    archive.mkdir()
    if os.geteuid() == 0:
        shutil.chown(work, "postgres")
        shutil.chown(archive, "postgres")
    port = free_port()
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    ctl = [str(PG_BIN / "pg_ctl"), "-w", "-l", str(work / "server.log")]
    started: list[Path] = []

    def start(directory: Path) -> None:
        run(as_postgres([*ctl, "-D", str(directory), "start"]))
        started.append(directory)

    try:
        run(as_postgres([str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust"]))
        with open(data / "postgresql.conf", "a") as conf:
            conf.write(
                f"port = {port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{work}'\nwal_level = replica\n"
                f"archive_mode = on\narchive_command = 'cp %p {archive}/%f'\n"
                f"archive_timeout = {archive_timeout_s}\n"
            )
        start(data)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE drill (id serial PRIMARY KEY, at float8 NOT NULL)")
        run(as_postgres([str(PG_BIN / "pg_basebackup"), "-d", url, "-D", str(base)]))

        last_committed = 0.0
        with psycopg.connect(url, autocommit=True) as conn:
            until = time.time() + seconds
            while time.time() < until:
                now = time.time()
                conn.execute("INSERT INTO drill (at) VALUES (%s)", (now,))
                last_committed = now  # autocommit: it is committed once execute returns
                time.sleep(0.05)
        crashed_at = time.time()
        run(as_postgres([*ctl, "-D", str(data), "stop", "-m", "immediate"]))
        started.remove(data)
        shutil.rmtree(data)

        began = time.perf_counter()
        shutil.copytree(base, data)
        if os.geteuid() == 0:
            run(["chown", "-R", "postgres:postgres", str(data)])
        with open(data / "postgresql.conf", "a") as conf:
            conf.write(f"restore_command = 'cp {archive}/%f %p'\n")
        (data / "recovery.signal").touch()
        start(data)
        with psycopg.connect(url, autocommit=True) as conn:
            while conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]:  # type: ignore[index]
                time.sleep(0.05)
            restored_last = conn.execute("SELECT max(at) FROM drill").fetchone()[0]  # type: ignore[index]
        rto = time.perf_counter() - began
        return {
            "written_s": seconds,
            "archive_timeout_s": archive_timeout_s,
            "rpo_s": last_committed - (restored_last or 0.0),
            "rto_s": rto,
            "crash_after_last_commit_s": crashed_at - last_committed,
        }
    finally:
        for directory in started:
            stop = [*ctl, "-D", str(directory), "stop", "-m", "immediate"]
            subprocess.run(as_postgres(stop), capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-rows", type=int, default=200_000, help="prediction-log rows")
    parser.add_argument("--jobs", type=int, default=2, help="pg_dump/pg_restore parallel jobs")
    parser.add_argument("--json", action="store_true", help="print the facts as JSON too")
    parser.add_argument("--pitr-s", type=float, default=30, help="writes before the PITR crash")
    parser.add_argument("--archive-timeout-s", type=int, default=10, help="for the PITR part")
    parser.add_argument("--skip-pitr", action="store_true", help="only the logical backup drill")
    args = parser.parse_args()
    clock, facts = drill(args.log_rows, args.jobs)
    today = datetime.date.today().isoformat()
    print(
        f"Recorded {today} on {platform.node()} ({os.cpu_count()} CPUs): {facts['tables']} "
        f"tables, {facts['rows']:,} rows ({facts['log_rows']:,} feedback rows), "
        f"{facts['artifacts']} artifacts; backup {facts['database_mb']} MB of database dump "
        f"(directory format, compressed) + {facts['artifacts_mb']} MB of artifacts.\n"
    )
    print("| step | seconds |\n| --- | --- |")
    for name, seconds in clock.steps.items():
        print(f"| {name} | {seconds:.2f} |")
    backup = sum(s for n, s in clock.steps.items() if n.startswith("backup"))
    rto = sum(s for n, s in clock.steps.items() if n.startswith(("restore", "verify")))
    print(f"| **backup total** | **{backup:.2f}** |")
    print(f"| **RTO: restore + verify + serving** | **{rto:.2f}** |")
    ok = facts["rows_match"] and facts["artifacts_match"] and facts["serves"]
    print(
        f"\nrow counts equal in every table: {facts['rows_match']}; every artifact's sha256 "
        f"as recorded and as before: {facts['artifacts_match']}; the restored platform "
        f"answers the old API key: {facts['serves']}"
    )
    if facts["differing"]:
        print(f"differing tables: {facts['differing']}")
    if not args.skip_pitr:
        pitr = pitr_drill(args.pitr_s, args.archive_timeout_s)
        print(
            f"\nContinuous archiving (a private PostgreSQL {PG_BIN.parent.name} instance, "
            f"archive_timeout {pitr['archive_timeout_s']} s, a commit every 50 ms for "
            f"{pitr['written_s']:g} s after the base backup, then a crash and its data "
            "directory deleted):\n"
        )
        print("| | seconds |\n| --- | --- |")
        print(f"| RPO: committed writes missing after the restore | {pitr['rpo_s']:.2f} |")
        print(
            f"| RTO: copy base backup + replay archive + accepting connections | "
            f"{pitr['rto_s']:.2f} |"
        )
        facts["pitr"] = pitr
    if args.json:
        print(json.dumps({"steps": clock.steps, **facts}, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
