"""Shared fixtures: two tenants and an outsider, ``make_*`` factories, a small ONNX model."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest

from tests.factories import make_key, make_member, make_tenant
from tests.onnx_models import small_onnx


@pytest.fixture(scope="session")
def onnx_bytes() -> bytes:
    return small_onnx()


@dataclass
class World:
    """Tenant A (with an engineer, a viewer and a key), tenant B (with a key), an outsider."""

    a: object
    b: object
    key_a: str
    key_b: str
    engineer_a: object
    viewer_a: object
    outsider: object


@pytest.fixture
def world(db, django_user_model) -> World:
    a, b = make_tenant("alpha"), make_tenant("beta")
    return World(
        a=a,
        b=b,
        key_a=make_key(a)[1],
        key_b=make_key(b)[1],
        engineer_a=make_member(a, "eng-a", "engineer"),
        viewer_a=make_member(a, "viewer-a", "viewer"),
        outsider=django_user_model.objects.create_user("outsider", password="pw-outsider-1"),
    )


def redis_url() -> str | None:
    return os.environ.get("REDIS_URL") or None


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1)
