"""``switchyard``: the command line over the SDK. Exit codes: 0 ok, 1 the server said no
(its message on stderr), 2 usage."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click
from tqdm import tqdm

from switchyard_client.sdk import Client, SwitchyardError


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "switchyard" / "config.json"


def load_config() -> dict[str, str]:
    """The stored login, with SWITCHYARD_URL / SWITCHYARD_KEY overriding it."""
    path = config_path()
    stored: dict[str, str] = json.loads(path.read_text()) if path.exists() else {}
    url = os.environ.get("SWITCHYARD_URL") or stored.get("url", "")
    key = os.environ.get("SWITCHYARD_KEY") or stored.get("key", "")
    if not url or not key:
        raise click.UsageError("not logged in: run `switchyard login --url URL --key KEY`")
    return {"url": url, "key": key}


def save_config(url: str, key: str) -> Path:
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    # created 0600 from the start: the key is never readable by others, not even briefly
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"url": url, "key": key}, out)
    path.chmod(0o600)
    return path


def client() -> Client:
    config = load_config()
    return Client(config["url"], config["key"])


def emit(as_json: bool, value: Any, human: str) -> None:
    click.echo(json.dumps(value, indent=2) if as_json else human)


json_option = click.option("--json", "as_json", is_flag=True, help="machine-readable output")


@click.group()
def cli() -> None:
    """Switchyard: models, versions, aliases, rollouts, inference and keys."""


@cli.command()
@click.option("--url", required=True)
@click.option("--key", required=True)
@json_option
def login(url: str, key: str, as_json: bool) -> None:
    """Check the key against the server and store it."""
    with Client(url, key) as c:
        c.list_models()
    path = save_config(url, key)
    emit(as_json, {"url": url, "config": str(path)}, f"logged in to {url} ({path})")


@cli.group()
def models() -> None:
    """List and create models."""


@models.command("list")
@json_option
def models_list(as_json: bool) -> None:
    with client() as c:
        found = c.list_models()
    emit(as_json, found, "\n".join(f"{m['name']}\t{m.get('task', '')}" for m in found))


@models.command("create")
@click.argument("name")
@click.option("--task", default="classifier")
@json_option
def models_create(name: str, task: str, as_json: bool) -> None:
    with client() as c:
        created = c.create_model(name, task)
    emit(as_json, created, f"created model {created['name']}")


@cli.command()
@click.argument("model")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--format", "fmt", default="onnx")
@json_option
def push(model: str, file: str, fmt: str, as_json: bool) -> None:
    """Upload FILE as MODEL's next version."""
    size = Path(file).stat().st_size
    with client() as c, tqdm(total=size, unit="B", unit_scale=True, disable=as_json) as bar:
        version = c.push_version(model, file, fmt, progress=bar.update)
    emit(as_json, version, f"pushed {model} version {version['version']}")


@cli.group()
def alias() -> None:
    """Move aliases (moving production opens an approval request)."""


@alias.command("set")
@click.argument("model")
@click.argument("alias_name", metavar="ALIAS")
@click.argument("version", type=int)
@click.option("--comment", default="")
@json_option
def alias_set(model: str, alias_name: str, version: int, comment: str, as_json: bool) -> None:
    with client() as c:
        moved = c.set_alias(model, alias_name, version, comment)
    if "version" in moved and "status" not in moved:
        human = f"{model}@{alias_name} -> version {moved['version']}"
    else:
        human = f"approval request opened: {json.dumps(moved)}"
    emit(as_json, moved, human)


@cli.group()
def rollout() -> None:
    """Start, show and kill rollouts."""


@rollout.command("start")
@click.argument("model")
@click.argument("candidate", type=int)
@click.option("--plan", "plan_json", default="{}", help="more plan fields, as JSON")
@json_option
def rollout_start(model: str, candidate: int, plan_json: str, as_json: bool) -> None:
    with client() as c:
        plan = c.start_rollout(model, candidate, **json.loads(plan_json))
    emit(as_json, plan, f"rollout {plan.get('id')} started")


@rollout.command("show")
@click.argument("plan_id", type=int)
@json_option
def rollout_show(plan_id: int, as_json: bool) -> None:
    with client() as c:
        plan = c.get_rollout(plan_id)
    emit(as_json, plan, json.dumps(plan, indent=2))


@rollout.command("kill")
@click.argument("plan_id", type=int)
@json_option
def rollout_kill(plan_id: int, as_json: bool) -> None:
    with client() as c:
        plan = c.kill_rollout(plan_id)
    emit(as_json, plan, f"rollout {plan_id} killed")


@cli.command()
@click.argument("model")
@click.option("--input", "body", required=True, help="an OIP v2 request as JSON, or @file")
@json_option
def predict(model: str, body: str, as_json: bool) -> None:
    """Send an OIP v2 inference request."""
    text = Path(body[1:]).read_text() if body.startswith("@") else body
    try:
        request = json.loads(text)
    except ValueError as error:
        raise click.UsageError(f"--input is not JSON: {error}") from error
    with client() as c:
        answer = c.infer(model, request)
    emit(as_json, answer, json.dumps(answer.get("outputs", answer), indent=2))


@cli.command()
@click.argument("model")
@click.argument("prompt")
@click.option("--max-tokens", default=64)
@click.option("--temperature", type=float, default=None, help="0: greedy (the server's default: 1)")
def generate(model: str, prompt: str, max_tokens: int, temperature: float | None) -> None:
    """Stream a generation's tokens to stdout."""
    with client() as c:
        for piece in c.generate(model, prompt, max_tokens, temperature):
            click.echo(piece, nl=False)
    click.echo()


@cli.group()
def keys() -> None:
    """List, create, rotate and revoke API keys."""


@keys.command("list")
@json_option
def keys_list(as_json: bool) -> None:
    with client() as c:
        found = c.list_keys()
    emit(as_json, found, "\n".join(f"{k['id']}\t{k.get('name', '')}" for k in found))


@keys.command("create")
@click.argument("name")
@click.option("--scope", "scopes", multiple=True, default=["predict"])
@json_option
def keys_create(name: str, scopes: tuple[str, ...], as_json: bool) -> None:
    with client() as c:
        created = c.create_key(name, list(scopes))
    emit(as_json, created, f"key {created['id']}: {created['key']} (shown once)")


@keys.command("rotate")
@click.argument("key_id", type=int)
@click.option("--overlap-s", default=3600)
@json_option
def keys_rotate(key_id: int, overlap_s: int, as_json: bool) -> None:
    with client() as c:
        rotated = c.rotate_key(key_id, overlap_s)
    emit(as_json, rotated, f"rotated: {json.dumps(rotated)}")


@keys.command("revoke")
@click.argument("key_id", type=int)
@json_option
def keys_revoke(key_id: int, as_json: bool) -> None:
    with client() as c:
        revoked = c.revoke_key(key_id)
    emit(as_json, revoked, f"key {key_id} revoked")


@cli.group()
def jobs() -> None:
    """Batch inference jobs: submit an input file, follow it, download its output."""


@jobs.command("submit")
@click.argument("model")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--alias", default=None, help="the alias to run (default: production)")
@click.option("--version", "version", type=int, default=None, help="a version instead")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["jsonl", "csv", "parquet"]),
    default=None,
    help="the input's format (default: from the file's extension)",
)
@click.option("--deadline", default=None, help="ISO 8601, e.g. 2026-12-01T08:00:00Z")
@json_option
def jobs_submit(
    model: str,
    file: str,
    alias: str | None,
    version: int | None,
    fmt: str | None,
    deadline: str | None,
    as_json: bool,
) -> None:
    """Submit FILE as a batch job against MODEL."""
    if alias and version is not None:
        raise click.UsageError("give --alias or --version, not both")
    fmt = fmt or Path(file).suffix.lstrip(".").lower()
    if fmt not in ("jsonl", "csv", "parquet"):
        raise click.UsageError("give --format (jsonl, csv or parquet)")
    with client() as c:
        job = c.submit_job(model, file, fmt, alias, version, deadline)
    emit(as_json, job, f"job {job['id']} submitted: {job['rows_total']} rows")


def _job_line(job: dict[str, Any]) -> str:
    p = job["progress"]
    rate = f", {p['rows_per_s']} rows/s" if p["rows_per_s"] else ""
    eta = f", ETA {p['eta_s']} s" if p["eta_s"] else ""
    deadline = ""
    if job["deadline"]:
        verdict = {True: "on time", False: "late", None: "unknown"}[p["on_time"]]
        deadline = f", deadline {job['deadline']} ({verdict})"
    return (
        f"job {job['id']} {job['model']} v{job['version']}: {job['state']} "
        f"{job['rows_done']}/{job['rows_total']} rows ({job['rows_failed']} failed){rate}{eta}"
        f"{deadline}"
    )


@jobs.command("list")
@json_option
def jobs_list(as_json: bool) -> None:
    with client() as c:
        found = c.list_jobs()
    emit(as_json, found, "\n".join(_job_line(j) for j in found) or "no jobs")


ENDED = ("succeeded", "failed", "cancelled")


@jobs.command("status")
@click.argument("job_id", type=int)
@click.option("--wait", is_flag=True, help="follow the job with a progress bar until it ends")
@click.option("--interval", type=float, default=1.0, help="seconds between polls with --wait")
@json_option
def jobs_status(job_id: int, wait: bool, interval: float, as_json: bool) -> None:
    with client() as c:
        job = c.get_job(job_id)
        if wait and job["state"] not in ENDED:
            with tqdm(total=job["rows_total"], unit="rows", disable=as_json) as bar:
                while True:
                    bar.update(job["rows_done"] - bar.n)
                    if job["state"] in ENDED:
                        break
                    time.sleep(interval)
                    job = c.get_job(job_id)
    emit(as_json, job, _job_line(job))
    if wait and job["state"] != "succeeded":
        sys.exit(1)


def _action(job_id: int, action: str, as_json: bool) -> None:
    with client() as c:
        job = c.job_action(job_id, action)
    emit(as_json, job, _job_line(job))


@jobs.command("pause")
@click.argument("job_id", type=int)
@json_option
def jobs_pause(job_id: int, as_json: bool) -> None:
    """No new chunk starts; the running ones finish."""
    _action(job_id, "pause", as_json)


@jobs.command("resume")
@click.argument("job_id", type=int)
@json_option
def jobs_resume(job_id: int, as_json: bool) -> None:
    _action(job_id, "resume", as_json)


@jobs.command("cancel")
@click.argument("job_id", type=int)
@json_option
def jobs_cancel(job_id: int, as_json: bool) -> None:
    _action(job_id, "cancel", as_json)


@jobs.command("download")
@click.argument("job_id", type=int)
@click.option("-o", "--output", "target", required=True, type=click.Path(dir_okay=False))
@json_option
def jobs_download(job_id: int, target: str, as_json: bool) -> None:
    """Save a succeeded job's output (JSON Lines: row number and outputs) to a file."""
    with client() as c:
        size = c.download_job_output(job_id, target)
    emit(as_json, {"path": target, "bytes": size}, f"saved {size} bytes to {target}")


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.UsageError as error:
        error.show()
        sys.exit(2)
    except click.exceptions.Abort:
        sys.exit(1)
    except SwitchyardError as error:
        click.echo(f"error: {error}", err=True)
        sys.exit(1)
    except click.ClickException as error:
        error.show()
        sys.exit(1)


if __name__ == "__main__":
    main()
