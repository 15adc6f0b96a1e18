"""The Switchyard Python SDK: typed calls over the platform's HTTP API (it imports no platform
code; it speaks only HTTP, so it runs anywhere the server is reachable)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

JSON = dict[str, Any]


class SwitchyardError(Exception):
    """The server said no: its HTTP status and its message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def _message(response: httpx.Response) -> str:
    """The server's own words: DRF's ``detail``, OIP's ``error``, or the field errors."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or response.reason_phrase
    if isinstance(body, dict):
        for field in ("detail", "error", "message"):
            if field in body:
                value = body[field]
                return value if isinstance(value, str) else json.dumps(value)
    return json.dumps(body)


class _ProgressReader:
    """A file read in chunks that reports how many bytes have gone so far (for a progress bar)."""

    def __init__(self, path: Path, progress: Callable[[int], None] | None) -> None:
        self._file = path.open("rb")
        self._progress = progress

    def read(self, size: int = -1) -> bytes:
        chunk = self._file.read(size)
        if self._progress and chunk:
            self._progress(len(chunk))
        return chunk

    # httpx sizes the multipart body from these, so the upload carries a Content-Length
    # rather than going chunked (which the server's multipart parser does not read)
    def fileno(self) -> int:
        return self._file.fileno()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        self._file.close()


class Client:
    """``Client(url, key)``: one tenant's view of a Switchyard server."""

    def __init__(self, url: str, key: str, timeout: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise SwitchyardError(response.status_code, _message(response))
        if response.status_code == 204 or not response.content:
            return {}
        return response.json()

    # models and versions
    def list_models(self) -> list[JSON]:
        found = self._call("GET", "/api/v1/models")
        return list(found["results"] if isinstance(found, dict) and "results" in found else found)

    def create_model(self, name: str, task: str = "classifier") -> JSON:
        created: JSON = self._call("POST", "/api/v1/models", json={"name": name, "task": task})
        return created

    def get_model(self, name: str) -> JSON:
        found: JSON = self._call("GET", f"/api/v1/models/{name}")
        return found

    def list_versions(self, model: str) -> list[JSON]:
        found = self._call("GET", f"/api/v1/models/{model}/versions")
        return list(found["results"] if isinstance(found, dict) and "results" in found else found)

    def get_version(self, model: str, version: int) -> JSON:
        found: JSON = self._call("GET", f"/api/v1/models/{model}/versions/{version}")
        return found

    def version_placements(self, model: str, version: int) -> list[JSON]:
        """Where a version is on the live agents: per agent its load state (``loading`` while
        a python package's environment builds, ``ready``, ``failed``, ``evicted``) and the
        detail that explains it (the installer's error when the build failed)."""
        found = self._call("GET", f"/api/v1/models/{model}/versions/{version}/placements")
        return list(found)

    def version_package(self, model: str, version: int) -> JSON:
        """What a python version's package holds: entrypoint, resources, policy, pinned
        requirements, wheels and files (a 404 for a version of another format)."""
        found: JSON = self._call("GET", f"/api/v1/models/{model}/versions/{version}/package")
        return found

    def push_version(
        self,
        model: str,
        artifact: str | Path,
        fmt: str = "onnx",
        fields: dict[str, str] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> JSON:
        """Upload an artifact as the model's next version; ``progress(n)`` is called with each
        chunk's size as it is read into the request."""
        path = Path(artifact)
        reader = _ProgressReader(path, progress)
        try:
            files = {"artifact": (path.name, reader, "application/octet-stream")}
            data = {"format": fmt, **(fields or {})}
            pushed: JSON = self._call(
                "POST", f"/api/v1/models/{model}/versions", files=files, data=data
            )
        finally:
            reader.close()
        return pushed

    # batch jobs
    def submit_job(
        self,
        model: str,
        path: str | Path,
        fmt: str,
        alias: str | None = None,
        version: int | None = None,
        deadline: str | None = None,
    ) -> JSON:
        """Upload an input file (jsonl, csv or parquet) as a batch job against ``model``."""
        data = {"model": model, "format": fmt}
        for name, value in (("alias", alias), ("version", version), ("deadline", deadline)):
            if value is not None:
                data[name] = str(value)
        with open(path, "rb") as fh:
            files = {"file": (Path(path).name, fh, "application/octet-stream")}
            submitted: JSON = self._call("POST", "/api/v1/jobs", files=files, data=data)
        return submitted

    def list_jobs(self) -> list[JSON]:
        return list(self._call("GET", "/api/v1/jobs"))

    def get_job(self, job_id: int) -> JSON:
        found: JSON = self._call("GET", f"/api/v1/jobs/{job_id}")
        return found

    def job_action(self, job_id: int, action: str) -> JSON:
        """``pause``, ``resume`` or ``cancel``."""
        changed: JSON = self._call("POST", f"/api/v1/jobs/{job_id}/{action}")
        return changed

    def job_errors(self, job_id: int) -> JSON:
        found: JSON = self._call("GET", f"/api/v1/jobs/{job_id}/errors")
        return found

    def download_job_output(self, job_id: int, target: str | Path) -> int:
        """Stream a succeeded job's output (JSON Lines) to ``target``; the bytes written."""
        written = 0
        with self._http.stream("GET", f"/api/v1/jobs/{job_id}/output") as response:
            if response.status_code >= 400:
                response.read()
                raise SwitchyardError(response.status_code, _message(response))
            with open(target, "wb") as out:
                for chunk in response.iter_bytes():
                    out.write(chunk)
                    written += len(chunk)
        return written

    # aliases, approvals and rollouts
    def set_alias(self, model: str, alias: str, version: int, comment: str = "") -> JSON:
        """Move an alias. Moving ``production`` once it exists opens an approval request
        instead (the answer then is the request, with ``status`` "pending")."""
        body = {"version": version, "comment": comment}
        moved: JSON = self._call("PUT", f"/api/v1/models/{model}/aliases/{alias}", json=body)
        return moved

    def list_approvals(self) -> list[JSON]:
        found = self._call("GET", "/api/v1/approvals")
        return list(found["results"] if isinstance(found, dict) and "results" in found else found)

    def start_rollout(self, model: str, candidate: int, **plan: Any) -> JSON:
        body = {"candidate": candidate, **plan}
        started: JSON = self._call("POST", f"/api/v1/models/{model}/rollouts", json=body)
        return started

    def get_rollout(self, plan_id: int) -> JSON:
        found: JSON = self._call("GET", f"/api/v1/rollouts/{plan_id}")
        return found

    def kill_rollout(self, plan_id: int) -> JSON:
        killed: JSON = self._call("POST", f"/api/v1/rollouts/{plan_id}/kill", json={})
        return killed

    # inference
    def infer(self, model: str, body: JSON) -> JSON:
        """An OIP v2 request (``{"inputs": [...]}``) to the model's serving alias."""
        answer: JSON = self._call("POST", f"/v2/models/{model}/infer", json=body)
        return answer

    def generate(
        self, model: str, prompt: str, max_tokens: int = 64, temperature: float | None = None
    ) -> Iterator[str]:
        """Stream a generation's text pieces over the OpenAI-compatible completions SSE
        (``temperature`` 0 is greedy; None leaves the server's default)."""
        body: JSON = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
        if temperature is not None:
            body["temperature"] = temperature
        with self._http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code >= 400:
                response.read()
                raise SwitchyardError(response.status_code, _message(response))
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                choices = json.loads(data).get("choices") or [{}]
                text = choices[0].get("text", "")
                if text:
                    yield str(text)

    # keys
    def list_keys(self) -> list[JSON]:
        found = self._call("GET", "/api/v1/keys")
        return list(found["results"] if isinstance(found, dict) and "results" in found else found)

    def create_key(self, name: str, scopes: list[str] | None = None) -> JSON:
        body = {"name": name, "scopes": scopes or ["predict"]}
        created: JSON = self._call("POST", "/api/v1/keys", json=body)
        return created

    def rotate_key(self, key_id: int, overlap_s: int = 3600) -> JSON:
        rotated: JSON = self._call(
            "POST", f"/api/v1/keys/{key_id}/rotate", json={"overlap_s": overlap_s}
        )
        return rotated

    def revoke_key(self, key_id: int) -> JSON:
        revoked: JSON = self._call("POST", f"/api/v1/keys/{key_id}/revoke", json={})
        return revoked
