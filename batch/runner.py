"""Sending a chunk's rows to the platform's own OIP v2 front door, as any client would: large
requests at the batch priority class, a few in flight, retried through overload and lost
replicas, and split row by row when a request is refused so each bad row gets its own error."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
from django.conf import settings

from serving_agent.protocol import OIP_TO_NUMPY

from .inputs import Signature

# Answers that say "not now": retried after Retry-After or a backoff. 500 too: the gateway
# answers it when an agent died under the request, work another agent can redo.
RETRIED = frozenset({429, 500, 502, 503, 504})
# Answers that say "this request is wrong": a request of several rows is split to find the row.
ROW_ERRORS = frozenset({400, 413, 422})
BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 4.0, 8.0)
MAX_RETRY_AFTER_S = 30.0


@dataclass(frozen=True)
class Outcome:
    """What became of one row: its outputs by name, or its error."""

    row: int
    outputs: dict[str, Any] | None = None
    error: str | None = None

    def line(self) -> dict[str, Any]:
        if self.error is not None:
            return {"row": self.row, "error": self.error}
        return {"row": self.row, "outputs": self.outputs}


class BudgetStop(Exception):
    """The gateway refused for the tenant's budget: the job pauses with this reason."""


class Unservable(Exception):
    """The gateway refused the job itself (its key, its model): the job fails with this."""


class GaveUp(Exception):
    """The front door stayed unavailable through every retry: the chunk is tried again later."""


@dataclass
class Sender:
    """One chunk's requests: ``rows`` are (row number, converted values) pairs."""

    client: httpx.Client
    url: str
    raw_key: str
    signature: Signature
    sleep: Callable[[float], None] = time.sleep

    def send(self, rows: Sequence[tuple[int, list[Any]]]) -> list[Outcome]:
        response = self._post(rows)
        if response.status_code == 200:
            return _outcomes(rows, response)
        message = _error_text(response)
        if response.status_code in ROW_ERRORS:
            if len(rows) == 1:
                return [Outcome(rows[0][0], error=message)]
            return [o for row in rows for o in self.send([row])]
        raise Unservable(f"the platform answered {response.status_code}: {message}")

    def _post(self, rows: Sequence[tuple[int, list[Any]]]) -> httpx.Response:
        body = {"inputs": _tensors(rows, self.signature), "parameters": {"priority": "batch"}}
        headers = {"Authorization": f"Bearer {self.raw_key}"}
        retries = int(settings.SWITCHYARD_BATCH_RETRIES)
        for attempt in range(retries + 1):
            wait = BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
            try:
                response = self.client.post(self.url, json=body, headers=headers)
            except httpx.TransportError:  # the platform restarting, a connection dropped
                self.sleep(wait)
                continue
            if response.status_code == 429 and "budget" in response.text.lower():
                raise BudgetStop(_error_text(response))
            if response.status_code not in RETRIED:
                return response
            self.sleep(_retry_after(response) or wait)
        raise GaveUp(f"the platform was unavailable through {retries} retries")


def send_all(
    sender: Sender,
    rows: Sequence[tuple[int, list[Any]]],
    between: Callable[[], bool],
) -> list[Outcome] | None:
    """All rows in requests of ``SWITCHYARD_BATCH_REQUEST_ROWS``, ``SWITCHYARD_BATCH_IN_FLIGHT``
    at a time. ``between`` runs after each round (renewing the lease); False stops, None back."""
    size = max(1, int(settings.SWITCHYARD_BATCH_REQUEST_ROWS))
    in_flight = max(1, int(settings.SWITCHYARD_BATCH_IN_FLIGHT))
    groups = [rows[i : i + size] for i in range(0, len(rows), size)]
    outcomes: list[Outcome] = []
    with ThreadPoolExecutor(max_workers=in_flight) as pool:
        for start in range(0, len(groups), in_flight):
            round_ = groups[start : start + in_flight]
            # One request at a time needs no thread (nor a database connection of its own).
            answers = map(sender.send, round_) if in_flight == 1 else pool.map(sender.send, round_)
            for answered in answers:
                outcomes.extend(answered)
            if not between():
                return None
    return outcomes


def _tensors(rows: Sequence[tuple[int, list[Any]]], signature: Signature) -> list[dict[str, Any]]:
    tensors = []
    for i, spec in enumerate(signature.inputs):
        column = [values[i] for _, values in rows]
        if spec["datatype"] == "BYTES":
            tensors.append(
                {"name": spec["name"], "shape": [len(column)], "datatype": "BYTES", "data": column}
            )
            continue
        array = np.asarray(column, dtype=OIP_TO_NUMPY[spec["datatype"]])
        tensors.append(
            {
                "name": spec["name"],
                "shape": list(array.shape),
                "datatype": spec["datatype"],
                "data": array.reshape(-1).tolist(),
            }
        )
    return tensors


def _outcomes(rows: Sequence[tuple[int, list[Any]]], response: httpx.Response) -> list[Outcome]:
    """Each row's slice of each output; an answer that does not hold one per row fails them."""
    try:
        outputs = response.json()["outputs"]
        per_output = {
            o["name"]: np.asarray(o["data"], dtype=object).reshape(o["shape"]) for o in outputs
        }
        if any(len(a) != len(rows) for a in per_output.values()):
            raise ValueError("not one answer per row")
    except (ValueError, KeyError, TypeError) as exc:
        return [Outcome(n, error=f"unreadable answer ({exc})") for n, _ in rows]
    return [
        Outcome(n, outputs={name: _plain(a[i]) for name, a in per_output.items()})
        for i, (n, _) in enumerate(rows)
    ]


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict) and isinstance(body.get("error"), str | dict):
        error = body["error"]
        return str(error.get("message", error) if isinstance(error, dict) else error)[:500]
    return str(body)[:500]


def _retry_after(response: httpx.Response) -> float | None:
    try:
        value = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return min(max(value, 0.0), MAX_RETRY_AFTER_S)
