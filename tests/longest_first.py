"""Runs the test files longest first, so that two workers finish together.

pytest-xdist hands out work in collection order: with ``--dist loadfile`` a whole file at a time,
with ``--dist load`` chunks of tests. When a long file comes last, one worker runs it alone while
the other idles (the end-to-end pass's last ~40 s ran on one worker). Ordering the files by their
measured time, longest first, is the classic longest-processing-time schedule: the short files
fill the gaps at the end. Tests keep their order inside a file (module fixtures stay shared).

The times are in ``tests/durations.json``: seconds per file, summed over its tests' setup, call
and teardown (on a busy machine they are inflated, but only their order matters). A file it does
not know goes first (a new file may be long; a short one costs little there).
``--record-durations`` rewrites the entries of the files a run collected:

    .venv/bin/python -m pytest --record-durations -m "e2e and not serial" tests/e2e

Loaded with ``-p tests.longest_first`` (pyproject's addopts).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

TIMES = Path(__file__).with_name("durations.json")
ROOT = TIMES.parent.parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations",
        action="store_true",
        help="write each collected file's time (setup, call and teardown) to tests/durations.json",
    )


def _file_of(item: pytest.Item) -> str:
    return item.path.relative_to(ROOT).as_posix()


def _known() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(TIMES.read_text()).items()}
    except (OSError, ValueError):
        return {}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    known = _known()
    # Every xdist worker collects the same files and sorts them the same way: the order must be
    # deterministic (xdist checks that the workers' collections agree).
    first_seen = {path: i for i, path in reversed(list(enumerate(map(_file_of, items))))}
    unknown = float("inf")
    items.sort(key=lambda item: (-known.get(_file_of(item), unknown), first_seen[_file_of(item)]))


class _Recorder:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        path = report.nodeid.split("::", 1)[0]
        self.seconds[path] += report.duration

    def pytest_sessionfinish(self) -> None:
        if not self.seconds:
            return
        merged = _known() | {path: round(s, 1) for path, s in self.seconds.items()}
        TIMES.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    # Only the process that sees every report records: the controller under xdist, or a run
    # without workers (a worker's reports reach the controller too).
    if config.getoption("record_durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Recorder(), "longest-first-recorder")
