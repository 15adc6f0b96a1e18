"""Single sign-on: off by default (no button, no URLs), and the group claim's roles synced on
every sign-in, each change audited."""

import json
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client, override_settings

from tenants.models import AuditEvent, Membership
from tenants.sso import SwitchyardOIDCBackend
from tests.factories import make_tenant

pytestmark = pytest.mark.django_db

ROLE_MAP = json.dumps(
    {
        "ml-approvers": ["acme", "approver"],
        "ml-viewers": ["acme", "viewer"],
        "x": ["zeta", "viewer"],
    }
)


def test_disabled_by_default_no_button_and_no_urls():
    page = Client().get("/login/")
    assert page.status_code == 200
    assert b"Sign in with SSO" not in page.content
    assert Client().get("/oidc/authenticate/").status_code == 404
    assert Client().get("/oidc/callback/").status_code == 404


@override_settings(
    SWITCHYARD_OIDC_ROLE_MAP=ROLE_MAP, OIDC_RP_CLIENT_ID="c", OIDC_RP_CLIENT_SECRET="s"
)
def test_group_claims_map_to_roles_and_follow_changes():
    acme = make_tenant("acme")
    backend = SwitchyardOIDCBackend()
    claims = {"sub": "42", "email": "ann@example.com", "groups": ["ml-approvers"]}
    user = backend.create_user(claims)
    assert user.username == "oidc:42"
    assert Membership.objects.get(user=user, tenant=acme).role == "approver"
    assert list(backend.filter_users_by_claims(claims)) == [user]

    backend.update_user(user, {**claims, "groups": ["ml-viewers"]})
    assert Membership.objects.get(user=user, tenant=acme).role == "viewer"
    backend.update_user(user, {**claims, "groups": []})
    assert not Membership.objects.filter(user=user).exists()
    actions = list(AuditEvent.objects.filter(target="oidc:42").values_list("action", flat=True))
    assert sorted(actions) == [
        "sso.membership.added",
        "sso.membership.changed",
        "sso.membership.removed",
    ]


@override_settings(SWITCHYARD_OIDC_ROLE_MAP=ROLE_MAP)
def test_unmapped_groups_grant_no_tenant():
    make_tenant("acme")
    user = SwitchyardOIDCBackend.__new__(SwitchyardOIDCBackend).update_user(
        User.objects.create_user("oidc:7"), {"sub": "7", "groups": ["nobody", "x"]}
    )
    assert not Membership.objects.filter(user=user).exists()


# The real authorization-code flow against a real OIDC provider (oidc-provider-mock on a free
# port): Django's test client plays the browser on our side, httpx on the provider's side.
import httpx  # noqa: E402
from django.urls import include, path  # noqa: E402
from oidc_provider_mock import run_server_in_thread  # noqa: E402

urlpatterns = [
    path("oidc/", include("mozilla_django_oidc.urls")),
    path("", include("web.urls")),
]


@pytest.fixture(scope="module")
def provider():
    with run_server_in_thread(require_nonce=True) as server:
        yield f"http://localhost:{server.server_port}"


def sso_settings(base: str, **changes: Any) -> override_settings:
    return override_settings(
        ROOT_URLCONF="tests.test_sso",
        SSO_ENABLED=True,
        AUTHENTICATION_BACKENDS=["tenants.sso.SwitchyardOIDCBackend"],
        OIDC_RP_CLIENT_ID="switchyard",
        OIDC_RP_CLIENT_SECRET="secret",
        OIDC_OP_AUTHORIZATION_ENDPOINT=f"{base}/oauth2/authorize",
        OIDC_OP_TOKEN_ENDPOINT=f"{base}/oauth2/token",
        OIDC_OP_USER_ENDPOINT=f"{base}/userinfo",
        OIDC_OP_JWKS_ENDPOINT=f"{base}/jwks",
        OIDC_VERIFY_KID=False,  # the mock signs with one key and names no kid
        SWITCHYARD_OIDC_ISSUER=base,
        SWITCHYARD_OIDC_ROLE_MAP=ROLE_MAP,
        **changes,
    )


def sign_in(
    base: str,
    sub: str,
    groups: list[str],
    tamper_nonce: bool = False,
    at_callback: override_settings | None = None,
) -> Client:
    httpx.put(f"{base}/users/{sub}", json={"email": f"{sub}@example.com", "groups": groups})
    browser = Client()
    start = browser.get("/oidc/authenticate/")
    assert start.status_code == 302 and start["Location"].startswith(base)
    answer = httpx.post(start["Location"], data={"sub": sub})
    assert answer.status_code == 302, answer.text
    callback = answer.headers["location"].removeprefix("http://testserver")
    if tamper_nonce:
        session = browser.session
        for state in session["oidc_states"].values():
            state["nonce"] = "not-the-one-sent"
        session.save()
    if at_callback is None:
        browser.get(callback)
    else:
        with at_callback:  # what the platform believes when the ID token comes back
            browser.get(callback)
    return browser


def test_real_flow_maps_groups_and_follows_changes(provider):
    with sso_settings(provider):
        acme = make_tenant("acme")
        cfg = httpx.get(f"{provider}/.well-known/openid-configuration").json()
        assert cfg["authorization_endpoint"] == f"{provider}/oauth2/authorize"
        assert cfg["jwks_uri"] == f"{provider}/jwks"
        browser = sign_in(provider, "ann", ["ml-approvers"])
        user = User.objects.get(username="oidc:ann")
        assert int(browser.session["_auth_user_id"]) == user.pk
        assert Membership.objects.get(user=user, tenant=acme).role == "approver"

        sign_in(provider, "ann", ["ml-viewers"])
        assert Membership.objects.get(user=user, tenant=acme).role == "viewer"

        nobody = sign_in(provider, "bob", ["unmapped"])
        assert not Membership.objects.filter(user__username="oidc:bob").exists()
        assert b"Sign in with SSO" not in nobody.get("/login/").content  # signed in: redirected


def test_real_flow_refuses_a_bad_nonce(provider):
    with sso_settings(provider):
        browser = sign_in(provider, "eve", ["ml-approvers"], tamper_nonce=True)
        assert "_auth_user_id" not in browser.session
        assert not User.objects.filter(username="oidc:eve").exists()


@pytest.fixture(scope="module")
def other_provider():
    """A second provider: its own signing key, its own issuer."""
    with run_server_in_thread(require_nonce=True) as server:
        yield f"http://localhost:{server.server_port}"


def test_a_token_signed_by_another_key_is_refused(provider, other_provider):
    with sso_settings(provider):
        wrong_keys = override_settings(OIDC_OP_JWKS_ENDPOINT=f"{other_provider}/jwks")
        browser = sign_in(provider, "mallory", ["ml-approvers"], at_callback=wrong_keys)
        assert "_auth_user_id" not in browser.session
        assert not User.objects.filter(username="oidc:mallory").exists()


def test_a_code_the_provider_refuses_or_a_foreign_issuer_is_a_failed_sign_in(provider):
    with sso_settings(provider):
        # The code was issued to "switchyard": exchanged as another client, the provider refuses
        # it; that is a failed sign-in (back to the sign-in page), not a 500.
        other_client = override_settings(OIDC_RP_CLIENT_ID="billing-app")
        browser = sign_in(provider, "trent", ["ml-approvers"], at_callback=other_client)
        assert "_auth_user_id" not in browser.session
        elsewhere = override_settings(SWITCHYARD_OIDC_ISSUER="https://sso.example.com")
        browser = sign_in(provider, "trent", ["ml-approvers"], at_callback=elsewhere)
        assert "_auth_user_id" not in browser.session
        assert not User.objects.filter(username="oidc:trent").exists()
        # The same sign-in with the right client and issuer succeeds.
        browser = sign_in(provider, "trent", ["ml-approvers"])
        assert User.objects.filter(username="oidc:trent").exists()
        assert "_auth_user_id" in browser.session


def _signed(key: Any, **claims: Any) -> str:
    import jwt

    base = {"iss": "https://idp.example.com", "sub": "u1", "nonce": "n", "exp": 4102444800}
    return jwt.encode({**base, **claims}, key, algorithm="RS256")


@pytest.mark.parametrize(
    ("claims", "accepted"),
    [
        ({"aud": "switchyard"}, True),
        ({"aud": ["switchyard", "other"], "azp": "switchyard"}, True),
        ({"aud": "other-client"}, False),
        ({"aud": ["switchyard", "other"]}, False),  # several audiences, no azp naming us
        ({"aud": ["switchyard", "other"], "azp": "other"}, False),
        ({"aud": "switchyard", "iss": "https://evil.example.com"}, False),
        ({"aud": "switchyard", "exp": 946684800}, False),  # expired (2000)
        ({"aud": "switchyard", "nonce": "replayed"}, False),
    ],
)
def test_id_token_audience_issuer_expiry_and_nonce_are_checked(claims, accepted):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from django.core.exceptions import SuspiciousOperation

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    with override_settings(
        OIDC_RP_CLIENT_ID="switchyard",
        OIDC_RP_CLIENT_SECRET="secret",
        OIDC_OP_TOKEN_ENDPOINT="https://idp.example.com/token",
        OIDC_OP_USER_ENDPOINT="https://idp.example.com/userinfo",
        OIDC_RP_IDP_SIGN_KEY=public,
        SWITCHYARD_OIDC_ISSUER="https://idp.example.com/",
    ):
        backend = SwitchyardOIDCBackend()
        token = _signed(key, **claims)
        if accepted:
            assert backend.verify_token(token, nonce="n")["sub"] == "u1"
        else:
            with pytest.raises(SuspiciousOperation):
                backend.verify_token(token, nonce="n")
