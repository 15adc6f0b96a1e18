"""Scoped cache invalidation: a change reaches every gateway process through the change log
(``fleet.changes``), and each process drops only the cached entries it touched, within one
poll of the refresh loop; a process that fell behind the kept rows drops everything."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import connection
from django.db.models import F
from django.test.utils import CaptureQueriesContext

from fleet import changes
from fleet.models import ConfigGeneration, Pool
from gateway import state as gateway_state
from gateway.routes import RouteMissing
from gateway.state import GatewayState
from registry.services import set_alias
from tenants.keys import revoke_api_key
from tenants.models import ApiKey, Quota
from tests.factories import make_model, make_version

# Transactional: the refresh loop's database calls close a connection in a test's transaction.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def state(world, onnx_bytes) -> GatewayState:
    """A gateway process that has read the generation once, with tenant A's models ``x`` and
    ``y`` and both tenants' keys cached."""
    for name in ("x", "y"):
        make_version(make_model(world.a, name), onnx_bytes)
    gateway = GatewayState()
    refresh(gateway)
    warm(gateway, world)
    return gateway


def refresh(state: GatewayState) -> None:
    async_to_sync(state.refresh_once)()


def warm(state: GatewayState, world) -> None:
    async def lookups() -> None:
        for key in (world.key_a, world.key_b):
            await state.identify(key, used=False)
        for name in ("x", "y"):
            route = await state.route(world.a.pk, name, "production")
            await state.version_route(world.a.pk, route.version_id)
            await state.split(world.a.pk, name, "production")

    async_to_sync(lookups)()


def queries_of(call) -> tuple[object, int]:
    """What ``call()`` (a coroutine) returns, and how many queries it made."""

    async def run() -> object:
        return await call()

    with CaptureQueriesContext(connection) as queries:
        result = async_to_sync(run)()
    return result, len(queries)


def test_an_alias_change_refreshes_that_models_routes_and_nothing_else(state, world, onnx_bytes):
    x = world.a.models.get(name="x")
    old = async_to_sync(state.route)(world.a.pk, "x", "production")
    set_alias(x, "production", make_version(x, onnx_bytes, alias=None))
    refresh(state)

    assert (world.a.pk, "x", "production") not in state._routes
    assert (world.a.pk, "x", "production") not in state._splits
    assert (world.a.pk, old.version_id) not in state._by_id
    # Tenant B's key, tenant A's key and model y's route, split and version stay cached.
    y = state._routes[(world.a.pk, "y", "production")]
    assert (world.a.pk, "y", "production") in state._splits
    assert (world.a.pk, y.version_id) in state._by_id
    for key in (world.key_a, world.key_b):
        identity, count = queries_of(lambda key=key: state.identify(key, used=False))
        assert identity is not None and count == 0
    same, count = queries_of(lambda: state.route(world.a.pk, "y", "production"))
    assert same is y and count == 0
    new, count = queries_of(lambda: state.route(world.a.pk, "x", "production"))
    assert new.version == old.version + 1 and count > 0


def test_a_revoked_key_is_refused_after_one_poll_and_other_keys_stay_cached(state, world):
    revoke_api_key(ApiKey.objects.get(tenant=world.a))
    refresh(state)
    assert async_to_sync(state.identify)(world.key_a) is None
    assert world.key_b in state._keys
    assert (world.a.pk, "x", "production") in state._routes  # routes do not hang on keys


def test_a_quota_change_refreshes_that_tenants_limits_only(state, world):
    quota = Quota.objects.get(tenant=world.a)
    quota.requests_per_second = 7
    quota.save()
    refresh(state)
    assert world.key_a not in state._keys and world.key_b in state._keys
    assert async_to_sync(state.identify)(world.key_a).rate == 7


def test_a_model_created_under_a_name_cached_as_missing_is_found(state, world, onnx_bytes):
    with pytest.raises(RouteMissing):
        async_to_sync(state.route)(world.a.pk, "late", "production")
    make_version(make_model(world.a, "late"), onnx_bytes)
    refresh(state)
    assert async_to_sync(state.route)(world.a.pk, "late", "production").version == 1
    assert (world.a.pk, "x", "production") in state._routes


def test_a_fleet_change_drops_no_cache_and_repushes_assignments(state, world):
    pushed = []

    class Consumer:
        async def push_assignment(self) -> None:
            pushed.append(True)

    state.agent_consumers.add(Consumer())
    Pool.objects.create(name="gpu", backend="local")
    refresh(state)
    assert pushed == [True]
    assert len(state._keys) == 2 and len(state._routes) == 2
    # A key change moves no agent's assignment.
    revoke_api_key(ApiKey.objects.get(tenant=world.b))
    refresh(state)
    assert pushed == [True] and world.key_b not in state._keys


def test_a_process_behind_the_kept_changes_drops_everything(state, world, monkeypatch):
    monkeypatch.setattr(changes, "KEEP_CHANGES", 3)
    monkeypatch.setattr(changes, "PRUNE_EVERY", 1)
    seen = changes.read_generation()
    for name in "pqrst":  # five fleet changes: the oldest two are pruned
        Pool.objects.create(name=name, backend="local")
    assert changes.changes_since(seen) == (seen + 5, None)
    assert len(changes.changes_since(seen + 2)[1]) == 3
    refresh(state)
    assert not state._keys and not state._routes and not state._splits and not state._by_id


def test_a_generation_moved_without_its_row_drops_everything(state):
    # What a process of an older release does while a newer one rolls out.
    ConfigGeneration.objects.filter(pk=1).update(value=F("value") + 1)
    refresh(state)
    assert not state._keys and not state._routes


def test_each_change_moves_the_generation_by_one_and_logs_its_scope(world, onnx_bytes):
    before = changes.read_generation()
    model = make_model(world.a, "z")
    now, logged = changes.changes_since(before)
    assert now == before + 1
    assert logged == [changes.Change("model", world.a.pk, model.pk, "z")]
    ApiKey.objects.get(tenant=world.b).save()
    assert changes.changes_since(now)[1] == [
        changes.Change("key", world.b.pk, ApiKey.objects.get(tenant=world.b).pk)
    ]


def test_a_key_revoked_while_it_is_looked_up_is_not_cached(state, world, monkeypatch):
    """The race scoped invalidation opens: a lookup that read the key before its revocation
    committed, and returns after the poll that dropped it, must not cache the old answer."""
    del state._keys[world.key_a]
    key = ApiKey.objects.get(tenant=world.a)
    real_lookup = gateway_state.lookup

    async def revoked_meanwhile(fn, *args):
        found = await real_lookup(fn, *args)
        # The revocation commits and this process's poll handles it while the query runs.
        await sync_to_async(revoke_api_key)(key)
        await state.refresh_once()
        return found

    monkeypatch.setattr(gateway_state, "lookup", revoked_meanwhile)
    assert async_to_sync(state.identify)(world.key_a, used=False) is not None  # in flight
    monkeypatch.setattr(gateway_state, "lookup", real_lookup)
    assert world.key_a not in state._keys  # not cached: the next request looks again
    assert async_to_sync(state.identify)(world.key_a) is None
