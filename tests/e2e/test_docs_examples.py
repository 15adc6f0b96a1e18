"""The shell and Python examples of README.md and docs/*.md, run as a reader pastes them, against
one live platform: what `make up` starts (a uvicorn server with gRPC, a serving agent, a Celery
worker for batch jobs and the autoscaler's cold starts) with the demo `bootstrap_demo` sets up
(users, the `demo` tenant and its key in var/demo.json, fraud-detector, storyteller,
llama-storyteller, minilm, fraud-autoscaled on the local pool).

Each ```bash, ```sh and ```python block is one test (``README.md:123``, the line of its opening
fence), in the order of its file, README first, then docs/ by name: one reader going through them
in one terminal, so a block sees what the earlier ones did (`KEY=...`, a model, a session).
Convention and markers: docs/contributing.md, "Examples in the docs run".

- Ports: the platform listens on free ports and each block's text is rewritten before it runs
  (127.0.0.1:8000 and localhost:8000 become its HTTP port, :8001 its gRPC port, /srv/models a
  folder of the test's), so the module runs beside other tests and beside a `make up`.
- The working directory holds ``var/`` (the platform's own: demo.json, metrics-token) and
  ``.venv``; ``.venv/bin`` is first on PATH (`python3`, `switchyard`); ``XDG_CONFIG_HOME`` is
  its own (the CLI's login stays there).
- Shell blocks run with ``bash -euo pipefail``; the variables a block sets last for the later
  blocks, and the exported ones reach the Python blocks. ``curl`` is wrapped to note each
  answer's status: 400 or more fails the block unless a marker expects or allows it.
- Python blocks run in one .venv/bin/python interpreter per file, as in one session.
- Checked: the exit status (a Python block's own asserts), the statuses, and where a marker
  says so, text the block must print.
- One backend, the embedded default (SQLite, no Redis, the file broker): what `make up` runs
  and the examples are written against, and the cheaper one to start.
- The demo's models: bootstrap_demo runs as written, with its trainers replaced by untrained
  models of the same architecture and signature (tests/e2e/docs_demo.py: training them takes
  about a minute here, and the examples need their interfaces, not their skill). minilm is the
  real export, cached across runs by platform_site.demo.minilm, as the embedding tests use it.
  The agent runs as the harness's seeded node, so it starts while bootstrap_demo runs.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleet.cluster.local import LocalBackend

from .conftest import make_backend
from .harness import (
    AGENT_SEED,
    PY,
    ROOT,
    Proc,
    create_node,
    free_port,
    start_agent,
    start_celery,
    start_server,
    wait_until,
)

pytestmark = pytest.mark.e2e

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"bash": "bash", "sh": "bash", "python": "python"}
BLOCK_TIMEOUT_S = 120

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<lang>[^\s`]*)")
MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<body>.*?)\s*-->", re.S)


@dataclass
class Block:
    path: str  # relative to the repository
    line: int  # the opening fence's
    lang: str
    text: str
    skip: str | None = None  # the reason
    expect: set[int] = field(default_factory=set)  # statuses that must occur
    allow: set[int] = field(default_factory=set)  # statuses that may (a loop waiting for 200)
    before: str = ""
    output: list[str] = field(default_factory=list)  # what the block must print
    problems: list[str] = field(default_factory=list)  # malformed markers

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def _markers(lines: list[str], fence_index: int) -> list[str]:
    """The docs-test comments on the lines right above a fence (blank lines between allowed)."""
    end = fence_index
    while end > 0 and not lines[end - 1].strip():
        end -= 1
    bodies: list[str] = []
    while end > 0 and lines[end - 1].strip().endswith("-->"):
        start = end - 1
        while start >= 0 and "<!--" not in lines[start]:
            start -= 1
        if start < 0:
            break
        found = MARKER.search("\n".join(lines[start:end]))
        if found is None:
            break
        bodies.insert(0, found["body"])
        end = start
        while end > 0 and not lines[end - 1].strip():
            end -= 1
    return bodies


def _apply(block: Block, body: str) -> None:
    word, rest = (body.split(None, 1) + [""])[:2]
    if word == "skip":
        reason = rest.lstrip("—–:-").strip()
        if not reason:
            block.problems.append("a skip marker needs its reason: <!-- docs-test: skip — why -->")
        block.skip = reason or None
    elif word in ("expect", "allow"):
        try:
            statuses = {int(s) for s in rest.split()}
        except ValueError:
            block.problems.append(f"{word} takes HTTP statuses: {body!r}")
            return
        (block.expect if word == "expect" else block.allow).update(statuses)
    elif word == "before":
        block.before += textwrap.dedent(rest) + "\n"
    elif word == "output" and rest:
        block.output.append(rest)
    else:
        block.problems.append(f"unknown docs-test marker {body!r}")


def parse(path: Path) -> Iterator[Block]:
    """Every fenced block of a markdown file, with its markers (those of any language)."""
    lines = path.read_text().split("\n")
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if opened is None:
            i += 1
            continue
        indent, fence, lang = opened["indent"], opened["fence"], opened["lang"]
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        block = Block(str(path.relative_to(ROOT)), i + 1, lang, "\n".join(body) + "\n")
        for marker in _markers(lines, i):
            _apply(block, marker)
        yield block
        i = j + 1


def all_blocks() -> list[Block]:
    return [block for path in DOCS for block in parse(path)]


RUNNABLE = [b for b in all_blocks() if b.lang in RUN]


def test_every_fence_names_its_language() -> None:
    """An unlabelled fence could hide a command from this module: `text` for diagrams and
    output, `json` for bodies, a shell or Python tag for what a reader runs."""
    bare = [b.id for b in all_blocks() if not b.lang]
    assert not bare, f"fences without a language (```text for output, ```bash for commands): {bare}"


def test_markers_are_well_formed() -> None:
    """A skip names its reason; expect and allow name statuses; no other marker exists."""
    wrong = {b.id: b.problems for b in all_blocks() if b.problems}
    assert not wrong, wrong


def test_markers_sit_on_runnable_blocks() -> None:
    marked = [b for b in all_blocks() if b.skip or b.expect or b.allow or b.before or b.output]
    wasted = [b.id for b in marked if b.lang not in RUN]
    assert not wasted, f"docs-test markers above blocks that never run: {wasted}"


def test_no_runnable_block_pipes_into_head() -> None:
    """`curl ... | head -3` fails under pipefail whenever curl is still writing when head exits
    (SIGPIPE, curl's exit 23): README's /metrics example failed a CI run so. A
    reader's `sed -n 1,3p` prints the same and reads to the end."""
    piped = [b.id for b in all_blocks() if b.lang in RUN and re.search(r"\|\s*head\b", b.text)]
    assert not piped, f"pipe into sed -n 1,Np instead of head: {piped}"


# The platform ---------------------------------------------------------------------------------

DEMO_MODELS = ["fraud-detector", "storyteller", "llama-storyteller", "minilm"]


@dataclass
class Platform:
    url: str
    cwd: Path
    env: dict[str, str]
    procs: list[Proc]
    # What the docs name (the ports `make up` listens on, a folder of the machine) and where
    # this platform has it.
    rewrites: list[tuple[str, str]]

    def rewrite(self, text: str) -> str:
        for pattern, replacement in self.rewrites:
            text = re.sub(pattern, replacement, text)
        return text

    def alive(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited:\n{proc.log()[-3000:]}")


def _ready(client: httpx.Client, name: str) -> bool:
    return client.get(f"/v2/models/{name}/ready").status_code == 200


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    started = time.monotonic()
    tmp = tmp_path_factory.mktemp("docs")
    var, cwd, files, imports = tmp / "var", tmp / "work", tmp / "files", tmp / "srv-models"
    for folder in (var, cwd, files, imports):
        folder.mkdir()
    # The node its agent runs as is made with the template's (harness.AGENT_SEED), so the
    # agent starts while bootstrap_demo runs; the demo's own node is left without an agent.
    backend = make_backend("embedded", var, AGENT_SEED)
    (cwd / "var").symlink_to(var)
    (cwd / ".venv").symlink_to(ROOT / ".venv")
    (cwd / "manage.py").symlink_to(ROOT / "manage.py")
    port, grpc_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    # As `make up`: the install makes its own metrics token (var/metrics-token), and the
    # platform's processes (the autoscaler's replicas) call its front door. README's "Artifact
    # storage" imports from /srv/models: here a folder of the test's.
    backend.env.pop("SWITCHYARD_METRICS_TOKEN", None)
    backend.env["SWITCHYARD_PLATFORM_URL"] = url
    backend.env["SWITCHYARD_ARTIFACT_IMPORT_DIRS"] = str(imports)
    procs: list[Proc] = []
    seed = f"import pathlib, tests.e2e.docs_demo as d; d.seed(pathlib.Path({str(files)!r}))"
    seeding = ThreadPoolExecutor(1).submit(backend.shell, seed)
    try:
        procs.append(start_server(backend, "uvicorn", port, grpc_port=grpc_port))
        procs.append(start_agent(backend, url, create_node(backend, "n")))
        seeding.result(timeout=300)
        # Batch jobs and the autoscaler's cold starts, the README's later sections: it starts
        # while the agent loads the demo's models.
        procs.append(start_celery(backend, "worker"))
        key = json.loads((var / "demo.json").read_text())["api_key"]
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as client:
            for name in DEMO_MODELS:
                wait_until(partial(_ready, client, name), 120, procs[1], 0.2)
        env = {k: v for k, v in backend.env.items() if k != "DJANGO_SETTINGS_MODULE"}
        env.update(
            PATH=f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}",
            XDG_CONFIG_HOME=str(cwd / ".config"),
            DOCS_TEST_FILES=str(files),
        )
        rewrites = [
            (r"\b(127\.0\.0\.1|localhost):8000\b", f"127.0.0.1:{port}"),
            (r"\b(127\.0\.0\.1|localhost):8001\b", f"127.0.0.1:{grpc_port}"),
            (r"/srv/models\b", str(imports)),
        ]
        print(f"the docs' platform is ready after {time.monotonic() - started:.1f} s")
        yield Platform(url, cwd, env, procs, rewrites)
    finally:
        seeding.cancel()
        # The agents the autoscaler started for the README's deployments, as `make up` stops
        # them when it ends (manage.py stop_local_agents), then the platform's own processes,
        # all told at once; the worker may be busy with a cancelled job's chunk: killed.
        LocalBackend(var / "agents", url, var).stop_all()
        for proc in procs:
            if proc.name.startswith("celery"):
                proc.kill()
            elif proc.popen.poll() is None:
                os.killpg(proc.popen.pid, signal.SIGTERM)
        for proc in reversed(procs):
            proc.stop()
        backend.close()


# Running blocks --------------------------------------------------------------------------------

# Before each shell block: the variables earlier blocks of its file set, and a curl that notes
# each answer's status. After it: what it set, for the next block and the Python ones.
SHELL_PRELUDE = r"""
__docs_base=$(compgen -v | sort)
if [ -f "$DOCS_TEST_STATE/vars" ]; then . "$DOCS_TEST_STATE/vars"; fi
__docs_save() {
  comm -13 <(printf '%s\n' "$__docs_base") <(compgen -v | sort) \
    | grep -v -e '^__docs' -e '^BASH' -e '^_$' -e '^FUNCNAME$' -e '^PIPESTATUS$' \
    | while read -r __docs_v; do declare -p "$__docs_v"; done > "$DOCS_TEST_STATE/vars.new" || true
  mv "$DOCS_TEST_STATE/vars.new" "$DOCS_TEST_STATE/vars"
  env -0 > "$DOCS_TEST_STATE/env"
}
trap __docs_save EXIT
curl() {
  local __docs_rc=0 __docs_dump
  __docs_dump=$(mktemp)
  command curl -D "$__docs_dump" "$@" || __docs_rc=$?
  sed -n 's/^HTTP\/[0-9.]* \([0-9][0-9]*\).*/\1/p' "$__docs_dump" | tail -n 1 \
    >> "$DOCS_TEST_STATE/statuses"
  rm -f "$__docs_dump"
  return "$__docs_rc"
}
"""

# One interpreter per file: blocks arrive as JSON lines ({code, name, out, env}); each runs in
# the same namespace with its output (fds 1 and 2) in its own file; the answer goes to the pipe
# this driver started with.
PYTHON_DRIVER = r"""
import json, os, sys, traceback
answers = os.fdopen(os.dup(1), "w")
namespace = {"__name__": "__main__"}
for line in sys.stdin:
    message = json.loads(line)
    os.environ.update(message["env"])
    with open(message["out"], "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        ok = True
        try:
            exec(compile(message["code"], message["name"], "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            ok = False
        sys.stdout.flush()
        sys.stderr.flush()
    answers.write(json.dumps({"ok": ok}) + "\n")
    answers.flush()
"""


class Reader:
    """One reader going through the docs in order: one terminal (its shell variables last from
    block to block and file to file, as they would), and a Python prompt per file."""

    def __init__(self, platform: Platform):
        self.platform = platform
        self.state = platform.cwd / ".docs-test"
        self.state.mkdir()
        self.pythons: dict[str, subprocess.Popen[str]] = {}

    def env(self) -> dict[str, str]:
        """The platform's environment with what the reader exported so far."""
        env = dict(self.platform.env, DOCS_TEST_STATE=str(self.state))
        saved = self.state / "env"
        if saved.exists():
            for item in saved.read_text().split("\0"):
                name, eq, value = item.partition("=")
                if eq and not name.startswith(("__docs", "BASH_FUNC")):
                    env[name] = value
        return env

    def shell(self, block: Block, code: str) -> tuple[bool, str, list[int]]:
        """Run a shell block: did it exit 0, its output, the statuses its curl calls got."""
        statuses = self.state / "statuses"
        statuses.write_text("")
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", SHELL_PRELUDE + code, block.id],
            cwd=self.platform.cwd,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
        seen = [int(s) for s in statuses.read_text().split()]
        return done.returncode == 0, done.stdout + done.stderr, seen

    def python(self, block: Block, code: str) -> tuple[bool, str]:
        """Run a Python block in its file's interpreter: did it raise, and its output."""
        driver = self.pythons.get(block.path)
        if driver is None:
            driver = self.pythons[block.path] = subprocess.Popen(
                [PY, "-c", PYTHON_DRIVER],
                cwd=self.platform.cwd,
                env=self.env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        assert driver.stdin is not None and driver.stdout is not None
        out = self.state / f"{block.id.replace('/', '_')}.out"
        message = {"code": code, "name": block.id, "out": str(out), "env": self.env()}
        driver.stdin.write(json.dumps(message) + "\n")
        driver.stdin.flush()
        ready, _, _ = select.select([driver.stdout], [], [], BLOCK_TIMEOUT_S)
        answer = driver.stdout.readline() if ready else ""
        output = out.read_text(errors="replace") if out.exists() else ""
        if not answer:
            self.pythons.pop(block.path).kill()
            return False, f"no answer within {BLOCK_TIMEOUT_S} s\n{output}"
        return bool(json.loads(answer)["ok"]), output

    def close(self) -> None:
        for driver in self.pythons.values():
            driver.kill()
            driver.wait(10)


@pytest.fixture(scope="module")
def reader(platform: Platform) -> Iterator[Reader]:
    started = Reader(platform)
    yield started
    started.close()


def _case(block: Block) -> Any:
    """A block as a test case: skipped before the platform starts when its marker says so (a
    block whose markers are malformed runs, to fail on them)."""
    skip = [pytest.mark.skip(reason=block.skip)] if block.skip and not block.problems else []
    return pytest.param(block, id=block.id, marks=skip)


@pytest.mark.parametrize("block", [_case(b) for b in RUNNABLE])
def test_example_runs(block: Block, platform: Platform, reader: Reader) -> None:
    assert not block.problems, "; ".join(block.problems)
    platform.alive()
    if block.before:
        ok, output, _ = reader.shell(block, platform.rewrite(block.before))
        assert ok, f"the hidden setup above {block.id} failed:\n{output[-4000:]}"
    code = platform.rewrite(block.text)
    if RUN[block.lang] == "python":
        ok, output = reader.python(block, code)
        assert ok, f"{block.id} raised:\n{output[-4000:]}"
        _check_output(block, output)
        return
    ok, output, statuses = reader.shell(block, code)
    assert ok, f"{block.id} exited with an error:\n{output[-4000:]}"
    refused = [s for s in statuses if s >= 400 and s not in block.expect | block.allow]
    assert not refused, (
        f"{block.id}: answered {refused} (statuses {statuses}); if the doc means it, mark the "
        f"block <!-- docs-test: expect {' '.join(map(str, sorted(set(refused))))} -->\n"
        f"{output[-4000:]}"
    )
    missing = block.expect - set(statuses)
    assert not missing, f"{block.id}: expected {sorted(missing)}, got {statuses}\n{output[-4000:]}"
    _check_output(block, output)


def _check_output(block: Block, output: str) -> None:
    absent = [text for text in block.output if text not in output]
    assert not absent, f"{block.id} did not print {absent}:\n{output[-4000:]}"
