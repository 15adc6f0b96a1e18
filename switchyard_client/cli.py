"""``switchyard``: the command line over the SDK. Exit codes: 0 ok, 1 the server said no
(its message on stderr), 2 usage."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
from tqdm import tqdm

from switchyard_client import packaging
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
@click.argument("folder", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
@click.option("--name", default=None, help="the model's name in the hints (default: DIR's name)")
@json_option
def init(folder: Path, name: str | None, as_json: bool) -> None:
    """Write a working python model package into DIR (docs/custom-code.md)."""
    name = name or folder.resolve().name
    try:
        written = packaging.scaffold(folder, name)
    except packaging.PackagingError as error:
        raise click.UsageError(str(error)) from error
    human = "\n".join(
        [
            f"wrote a python model package in {folder}: " + ", ".join(p.name for p in written),
            "next: edit model.py and switchyard.toml, then",
            f"  switchyard models create {name}",
            f"  switchyard push {name} {folder}",
        ]
    )
    emit(as_json, {"folder": str(folder), "files": [p.name for p in written]}, human)


@cli.command()
@click.argument("model")
@click.argument("source", metavar="PATH", type=click.Path(exists=True, path_type=Path))
@click.option("--format", "fmt", default=None, help="the artifact's format (default: onnx)")
@click.option(
    "--no-smoke",
    is_flag=True,
    help="a folder: skip the local check (when this machine lacks the package's requirements)",
)
@click.option(
    "--smoke-timeout",
    type=float,
    default=packaging.SMOKE_TIMEOUT_S,
    show_default=True,
    help="seconds the local check may take",
)
@json_option
def push(
    model: str, source: Path, fmt: str | None, no_smoke: bool, smoke_timeout: float, as_json: bool
) -> None:
    """Upload PATH as MODEL's next version: an artifact file, or a python package's folder
    (checked on this machine first, then uploaded as a .tar.gz of format python, or
    python_generator when its manifest says generates = true)."""
    if not source.is_dir():
        _upload(model, source, fmt or "onnx", as_json)
        return
    if fmt not in (None, packaging.PYTHON_FORMAT, packaging.PYTHON_GENERATOR_FORMAT):
        raise click.UsageError(f"a folder is a python package: --format {fmt} does not apply")
    try:
        packaging.check_folder(source)
    except packaging.PackagingError as error:
        raise click.UsageError(str(error)) from error
    try:
        packaging.package_files(source)  # links refused before the check runs anything
        if not no_smoke:
            _smoke(source, smoke_timeout, as_json)
        with tempfile.TemporaryDirectory(prefix="switchyard-") as scratch:
            packed = packaging.pack(source, Path(scratch) / f"{source.resolve().name}.tar.gz")
            # python, or python_generator for a package whose class streams text
            fmt = packaging.package_format(source)
            version = _packed_upload(model, packed, as_json, fmt)
    except packaging.PackagingError as error:
        raise click.ClickException(f"{error}\nnothing was uploaded.") from error
    if not as_json:
        number = version["version"]
        click.echo(
            "An agent builds its environment from requirements.txt when it first loads it "
            f"(once an alias or a rollout serves it, e.g. `switchyard alias set {model} staging "
            f"{number}`). Follow the build on each node with:\n"
            f"  switchyard versions show {model} {number} --watch"
        )


def _upload(model: str, path: Path, fmt: str, as_json: bool) -> dict[str, Any]:
    size = path.stat().st_size
    with client() as c, tqdm(total=size, unit="B", unit_scale=True, disable=as_json) as bar:
        version = c.push_version(model, path, fmt, progress=bar.update)
    emit(as_json, version, f"pushed {model} version {version['version']} ({fmt})")
    return version


def _packed_upload(
    model: str, packed: packaging.Packed, as_json: bool, fmt: str = packaging.PYTHON_FORMAT
) -> dict[str, Any]:
    if not as_json:
        click.echo(
            f"packed {len(packed.files)} files ({packed.total_bytes} bytes) into {packed.path.name}"
        )
    return _upload(model, packed.path, fmt, as_json)


def _smoke(folder: Path, timeout_s: float, as_json: bool) -> None:
    """The local check of a package folder; a failure stops the push before any upload."""
    if not as_json:
        click.echo(f"checking {folder} on this machine (import, load(), one call)...")
    result = packaging.smoke(folder, timeout_s)
    if result.ok:
        if not as_json:
            seen = result.report.get("outputs", {})
            shapes = ", ".join(f"{n} {o['datatype']} {o['shape']}" for n, o in seen.items())
            click.echo(f"local check passed: {shapes}")
        return
    if result.log.strip():
        click.echo(result.log.rstrip(), err=True)
    hint = ""
    if "ModuleNotFoundError" in result.error or "ImportError" in result.error:
        hint = (
            f"\nIf this machine lacks the package's requirements, install them "
            f"(pip install -r {folder / 'requirements.txt'}) or push with --no-smoke."
        )
    raise packaging.PackagingError(f"the local check of {folder} failed: {result.error}{hint}")


@cli.group()
def versions() -> None:
    """List a model's versions; show one, with its package and its state on each agent."""


@versions.command("list")
@click.argument("model")
@json_option
def versions_list(model: str, as_json: bool) -> None:
    with client() as c:
        found = c.list_versions(model)
    lines = [
        f"v{v['version']}\t{v['format']}\t{v['sha256'][:12]}\t{','.join(v.get('aliases', []))}"
        for v in found
    ]
    emit(as_json, found, "\n".join(lines) or "no versions")


# A placement in one of these states is still on its way (a python environment building).
PENDING_STATES = ("loading",)
FILES_SHOWN = 20  # of a package, by `versions show` (its --json lists them all)


@versions.command("show")
@click.argument("model")
@click.argument("version", type=int)
@click.option("--watch", is_flag=True, help="follow the agents until none is still loading it")
@click.option("--interval", type=float, default=2.0, help="seconds between polls with --watch")
@click.option("--timeout", type=float, default=1800.0, help="give up watching after this long")
@json_option
def versions_show(
    model: str, version: int, watch: bool, interval: float, timeout: float, as_json: bool
) -> None:
    """A version's fields, its package (a python version: entrypoint, resources, requirements,
    files) and its load state on each agent, with the detail of a build or a failure."""
    with client() as c:
        found = c.get_version(model, version)
        package = c.version_package(model, version) if found["format"] == "python" else None
        placements = c.version_placements(model, version)
        if watch:
            placements = _watch(c, model, version, placements, interval, timeout, as_json)
    shown = {"version": found, "package": package, "placements": placements}
    emit(as_json, shown, _version_text(found, package, placements))
    if watch and (
        not placements
        or any(p["state"] in PENDING_STATES or p["state"] == "failed" for p in placements)
    ):
        sys.exit(1)


def _watch(
    c: Client,
    model: str,
    version: int,
    placements: list[dict[str, Any]],
    interval: float,
    timeout: float,
    as_json: bool,
) -> list[dict[str, Any]]:
    """Poll until some agent holds the version and none is still loading it (or ``timeout``),
    printing each agent's state as it changes."""
    deadline = time.monotonic() + timeout
    seen: dict[str, tuple[str, str]] = {}
    while True:
        for p in placements:
            now = (p["state"], p["detail"])
            if seen.get(p["node"]) != now and not as_json:
                first = (p["detail"].splitlines() or [""])[0][:160]
                click.echo(f"{p['node']}: {p['state']}" + (f" ({first})" if first else ""))
            seen[p["node"]] = now
        settled = placements and not any(p["state"] in PENDING_STATES for p in placements)
        if settled or time.monotonic() >= deadline:
            return placements
        time.sleep(interval)
        placements = c.version_placements(model, version)


def _version_text(
    version: dict[str, Any], package: dict[str, Any] | None, placements: list[dict[str, Any]]
) -> str:
    def tensors(specs: list[dict[str, Any]]) -> str:
        return "; ".join(f"{t['name']} {t['datatype']} {t['shape']}" for t in specs) or "-"

    lines = [
        f"{version['model']} v{version['version']}  {version['format']}  "
        f"sha256 {version['sha256'][:12]}  created {version['created_at']}",
        f"aliases:  {', '.join(version.get('aliases', [])) or '-'}",
        f"inputs:   {tensors(version['inputs'])}",
        f"outputs:  {tensors(version['outputs'])}",
    ]
    if package is not None:
        lines += _package_lines(package)
    lines.append("agents:")
    if not placements:
        lines.append(
            "  none holds it now (agents load a version while an alias or a rollout serves it)"
        )
    for p in placements:
        where = p["node"] + (f" ({p['deployment']})" if p.get("deployment") else "")
        extra = f"  {p['provider']}" if p.get("provider") else ""
        lines.append(f"  {where}: {p['state']}{extra}")
        if p.get("detail"):
            lines += ["    " + line for line in str(p["detail"]).splitlines()]
    return "\n".join(lines)


def _package_lines(package: dict[str, Any]) -> list[str]:
    if package.get("error"):
        return [f"package:  {package['error']}"]
    resources, policy = package["resources"], package["policy"]
    lines = [
        f"package:  entrypoint {package['entrypoint']}; {resources['memory_mib']} MiB, "
        f"{resources['cpus']:g} CPU, {resources['timeout_s']:g} s per call; "
        f"network {'allowed' if policy['network'] else 'off'}",
        "requirements: " + (", ".join(package["requirements"]) or "none pinned"),
    ]
    if package.get("wheels"):
        lines.append("wheels:   " + ", ".join(w["name"] for w in package["wheels"]))
    files = package.get("files", [])
    lines.append(f"files:    {len(files)} ({package.get('total_bytes', 0)} bytes)")
    lines += [f"  {f['name']}  {f['size']}" for f in files[:FILES_SHOWN]]
    if len(files) > FILES_SHOWN:
        lines.append(f"  ... {len(files) - FILES_SHOWN} more (--json lists them all)")
    return lines


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
