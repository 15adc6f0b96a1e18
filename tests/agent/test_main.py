"""``python -m serving_agent``: arguments, a clean exit on SIGTERM, and no Django anywhere."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from serving_agent.__main__ import parse_args

if TYPE_CHECKING:
    from tests.agent.conftest import FakePlatform


def test_flags_may_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_PLATFORM", "http://platform.test")
    monkeypatch.setenv("SWITCHYARD_NODE_TOKEN", "from-env")
    monkeypatch.setenv("SWITCHYARD_AGENT_CACHE", "/tmp/agent-cache")
    args = parse_args([])
    assert (args.platform, args.token, args.cache_dir) == (
        "http://platform.test",
        "from-env",
        "/tmp/agent-cache",
    )
    assert args.threads == 1


def test_the_token_may_come_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SWITCHYARD_NODE_TOKEN", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    args = parse_args(["--platform", "http://p", "--token-file", str(token_file)])
    assert args.token == "from-file"


def test_a_missing_token_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SWITCHYARD_NODE_TOKEN", raising=False)
    monkeypatch.delenv("SWITCHYARD_NODE_TOKEN_FILE", raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--platform", "http://p"])


def test_the_agent_never_imports_django() -> None:
    code = (
        "import sys, serving_agent, serving_agent.__main__; "
        "sys.exit(any(m.split('.')[0] == 'django' for m in sys.modules))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.anyio
async def test_sigterm_closes_the_connection_and_exits_zero(
    platform: FakePlatform, tmp_path: Path
) -> None:
    agent = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "serving_agent",
        "--platform",
        platform.url,
        "--token",
        platform.token,
        "--cache-dir",
        str(tmp_path),
        stderr=subprocess.PIPE,
    )
    try:
        await platform.expect("hello", timeout=20)
        ws = await platform.next_connection()
        agent.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            _, stderr = await agent.communicate()
            await ws.wait_closed()
    finally:
        if agent.returncode is None:
            agent.kill()
    assert agent.returncode == 0, stderr.decode()
    assert ws.close_code == 1000


def test_the_alive_file_may_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_ALIVE_FILE", "/tmp/alive")
    assert parse_args(["--platform", "http://p", "--token", "t"]).alive_file == "/tmp/alive"
    monkeypatch.delenv("SWITCHYARD_ALIVE_FILE")
    assert parse_args(["--platform", "http://p", "--token", "t"]).alive_file is None


@pytest.mark.anyio
async def test_the_alive_file_says_ready_once_connected(
    platform: FakePlatform, tmp_path: Path
) -> None:
    alive = tmp_path / "alive"
    agent = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "serving_agent",
        "--platform",
        platform.url,
        "--token",
        platform.token,
        "--cache-dir",
        str(tmp_path / "cache"),
        "--alive-file",
        str(alive),
        stderr=subprocess.DEVNULL,
    )
    try:
        await platform.expect("hello", timeout=20)
        async with asyncio.timeout(10):
            while not alive.exists() or alive.read_text() != "ready\n":
                await asyncio.sleep(0.1)
    finally:
        agent.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            await agent.wait()
