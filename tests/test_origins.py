"""Session websockets open only from this site's exact origin (``platform_site.origins``): the
UI's live socket is refused before it is accepted, and the playground's generation socket does
not take the session, from an Origin on another port or scheme, or with none."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator

from platform_site.origins import same_origin
from platform_site.routing import websocket_urlpatterns
from tests.test_generation import FakeAgent, frames_until_end, socket, state, writer  # noqa: F401

SITE = "localhost:8000"  # the Host the sockets below are opened on (one of ALLOWED_HOSTS)


def scope(origin: str | None, host: str = SITE, scheme: str = "ws") -> dict:
    headers = [(b"host", host.encode())]
    if origin is not None:
        headers.append((b"origin", origin.encode()))
    return {"type": "websocket", "scheme": scheme, "headers": headers}


@pytest.mark.parametrize(
    "origin, scheme, allowed",
    [
        ("http://localhost:8000", "ws", True),
        ("https://localhost:8000", "wss", True),  # behind TLS (uvicorn trusts the proxy)
        ("http://localhost:8001", "ws", False),  # another port of an allowed host
        ("http://localhost", "ws", False),
        ("https://localhost:8000", "ws", False),  # another scheme
        ("http://localhost:8000", "wss", False),
        ("null", "ws", False),  # a sandboxed page or a file
        ("http://[::1", "ws", False),  # malformed
        ("", "ws", False),
        (None, "ws", False),  # browsers always send one
    ],
)
def test_only_the_origin_the_socket_was_opened_on_is_same_origin(origin, scheme, allowed):
    assert same_origin(scope(origin, scheme=scheme)) is allowed


def test_a_host_outside_allowed_hosts_is_no_origin_of_ours():
    assert not same_origin(scope("http://evil.example:8000", host="evil.example:8000"))


def test_trusted_origins_match_exactly_or_as_subdomains(settings):
    settings.CSRF_TRUSTED_ORIGINS = ["https://ui.example.com", "https://*.corp.example"]
    assert same_origin(scope("https://ui.example.com"))
    assert not same_origin(scope("https://ui.example.com:8443"))
    assert same_origin(scope("https://app.corp.example"))
    assert not same_origin(scope("http://app.corp.example"))
    assert not same_origin(scope("https://corp.example.evil"))


def session_cookie(client, user) -> tuple[bytes, bytes]:
    client.force_login(user)
    return b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()


def opens_live_socket(cookie: tuple[bytes, bytes], origin: str | None) -> bool:
    headers = [cookie, (b"host", SITE.encode())]
    if origin is not None:
        headers.append((b"origin", origin.encode()))

    async def connect() -> bool:
        communicator = WebsocketCommunicator(
            URLRouter(websocket_urlpatterns), "/ws/ui/live/", headers=headers
        )
        connected, _ = await communicator.connect()
        await communicator.disconnect()
        return connected

    return async_to_sync(connect)()


@pytest.mark.django_db
def test_the_live_socket_opens_only_from_the_exact_origin(world, client):
    cookie = session_cookie(client, world.viewer_a)
    assert opens_live_socket(cookie, "http://localhost:8000")
    assert not opens_live_socket(cookie, "http://localhost:8001")
    assert not opens_live_socket(cookie, "https://localhost:8000")
    assert not opens_live_socket(cookie, None)


@pytest.mark.django_db(transaction=True)  # several sockets, each loading the session
def test_the_playground_socket_takes_no_session_from_another_port(writer, state, client):  # noqa: F811
    cookie = session_cookie(client, writer.engineer_a)

    async def generate(origin: bytes | None) -> dict:
        headers = [cookie, (b"host", SITE.encode())]
        if origin is not None:
            headers.append((b"origin", origin))
        async with socket(None, headers=headers) as ws:
            await ws.send_json_to({"type": "generate", "id": "p", "prompt": "hi"})
            return (await frames_until_end(ws, "p"))[-1]

    async def scenario():
        FakeAgent(state(), writer.version.pk)
        return [
            await generate(b"http://localhost:8000"),
            await generate(b"http://localhost:8001"),
            await generate(None),
        ]

    same, other_port, none = async_to_sync(scenario)()
    assert same["type"] == "done"
    assert other_port["code"] == none["code"] == "unauthorized"
