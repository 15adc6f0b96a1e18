import pytest

from tenants.keys import identify_key, revoke_api_key
from tenants.models import ApiKey
from tests.factories import make_key, make_tenant

pytestmark = pytest.mark.backends


def test_key_is_stored_only_as_a_hash(db):
    key, raw = make_key(make_tenant("t1"))
    row = ApiKey.objects.get(pk=key.pk)
    assert raw not in (row.key_hash, row.prefix)
    assert raw.startswith(f"sy_{row.prefix}_")
    assert len(row.key_hash) == 64


def test_valid_key_identifies_its_tenant_and_quota(db):
    tenant = make_tenant("t1", rps=5, burst=7)
    key, raw = make_key(tenant)
    identity = identify_key(raw)
    assert (identity.key_id, identity.tenant_id, identity.rate, identity.burst) == (
        key.pk,
        tenant.pk,
        5,
        7,
    )


def test_wrong_secret_with_right_prefix_is_refused(db):
    _, raw = make_key(make_tenant("t1"))
    assert identify_key(raw[:-3] + "abc") is None
    assert identify_key("sy_nope") is None
    assert identify_key("") is None


def test_revoked_key_is_refused_and_revocation_time_is_kept(db):
    key, raw = make_key(make_tenant("t1"))
    first = revoke_api_key(key).revoked_at
    assert identify_key(raw) is None
    assert revoke_api_key(key).revoked_at == first
