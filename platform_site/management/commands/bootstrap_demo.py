"""Set up the embedded demo: admin (an approver) and engineer users, demo tenant and key, a node,
the fraud model serving, and the same model deployed with autoscaling on the local pool.

Idempotent: a second run reuses what exists. Credentials are kept in ``var/demo.json`` (0600)
so the start script can print them and hand the node token to the local agent; the command's own
output names no secret, since it ends up in ``var/bootstrap.log``.
"""

import json
import os
import secrets
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.base_user import AbstractBaseUser
from django.core.management.base import BaseCommand
from django.db import transaction

from fleet.models import ClusterKind, Deployment, Node, Pool
from fleet.nodes import create_node, rotate_node_token
from platform_site.secret_files import write_private
from registry.models import ArtifactFormat, Model, TaskKind
from registry.services import create_version, set_alias
from tenants.audit import user_actor
from tenants.keys import create_api_key, identify_key
from tenants.models import Membership, Quota, Role, Tenant

from ...demo.fraud import FEATURE_NAMES, train_fraud_model


class Command(BaseCommand):
    help = "Create the demo tenant, key, node and fraud model (idempotent)."

    def handle(self, **options: Any) -> None:
        path = settings.SWITCHYARD_VAR_DIR / "demo.json"
        saved = json.loads(path.read_text()) if path.exists() else {}
        with transaction.atomic():
            creds = self._bootstrap(saved)
        write_private(path, json.dumps(creds, indent=2))
        self.stdout.write(
            f"demo ready: tenant {creds['tenant']}, model {creds['model']}, users "
            f"{creds['admin_user']} and {creds['engineer_user']}; their passwords, the API key "
            f"and the node token are in {path} (readable by its owner only)"
        )

    def _text_model(self, tenant: Tenant, admin: AbstractBaseUser) -> None:
        """The demo generative model: a byte-level transformer trained on Moby-Dick."""
        model, _ = Model.objects.get_or_create(
            tenant=tenant,
            name="storyteller",
            defaults={"task": TaskKind.GENERATOR, "description": "Demo text generator"},
        )
        if model.versions.exists():
            return
        seconds = float(os.environ.get("SWITCHYARD_DEMO_TEXT_SECONDS", "90"))
        self.stdout.write(f"training the demo text model for {seconds:g} s…")
        from ...demo.storyteller import train_text_model  # torch training: only here

        data, details = train_text_model(seconds=seconds)
        version = create_version(
            model,
            data,
            format=ArtifactFormat.TEXTGEN,
            source_commit="demo",
            # The architecture's context is 256 bytes: prompt and continuation share it.
            max_input_tokens=128,
            max_output_tokens=128,
            **details,
        )
        set_alias(model, "production", version, user_actor(admin), "demo bootstrap")

    def _autoscaled_model(self, tenant: Tenant, fraud: Model, admin: AbstractBaseUser) -> None:
        """The fraud model again as ``fraud-autoscaled``, deployed on the local pool: the
        control loop starts agent processes for it under load and stops them when idle."""
        model, _ = Model.objects.get_or_create(
            tenant=tenant,
            name="fraud-autoscaled",
            defaults={"task": TaskKind.CLASSIFIER, "description": "Demo autoscaled model"},
        )
        if not model.versions.exists():
            source = fraud.versions.order_by("version").first()
            assert source is not None  # _bootstrap gave the fraud model its first version
            with source.artifact.open("rb") as f:
                data = f.read()
            version = create_version(
                model,
                data,
                feature_names=source.feature_names,
                source_commit="demo",
                description="the demo fraud model, deployed with autoscaling",
            )
            set_alias(model, "production", version, user_actor(admin), "demo bootstrap")
        pool, _ = Pool.objects.get_or_create(
            name="local",
            defaults={
                "backend": ClusterKind.LOCAL,
                "description": "agent processes on this machine",
            },
        )
        Deployment.objects.get_or_create(
            version=model.aliases.get(name="production").version,
            pool=pool,
            defaults={
                "tenant": tenant,
                "min_replicas": 0,
                "max_replicas": 3,
                "target_load_per_replica": 4,
                "scale_down_window_s": 60,
                "idle_to_zero_s": 120,
            },
        )

    def _bootstrap(self, saved: dict[str, Any]) -> dict[str, Any]:
        User = get_user_model()
        password = saved.get("admin_password") or secrets.token_urlsafe(12)
        admin = User.objects.filter(username="admin").first()
        if admin is None:
            admin = User.objects.create_superuser("admin", "admin@localhost", password)
        tenant, _ = Tenant.objects.get_or_create(slug="demo", defaults={"name": "Demo"})
        Quota.objects.get_or_create(
            tenant=tenant, defaults={"requests_per_second": 20000, "burst": 40000}
        )
        Membership.objects.get_or_create(
            tenant=tenant, user=admin, defaults={"role": Role.APPROVER}
        )
        # A second person: promotions need an approver other than the requester.
        engineer_password = saved.get("engineer_password") or secrets.token_urlsafe(12)
        engineer = User.objects.filter(username="engineer").first()
        if engineer is None:
            engineer = User.objects.create_user("engineer", password=engineer_password)
        Membership.objects.get_or_create(
            tenant=tenant, user=engineer, defaults={"role": Role.ENGINEER}
        )

        api_key = saved.get("api_key")
        if not api_key or identify_key(api_key) is None:
            _, api_key = create_api_key(tenant, "demo key", user_actor(admin))

        node = Node.objects.filter(name="local").first()
        node_token = saved.get("node_token")
        if node is None:
            node, node_token = create_node("local")
        elif not node_token:
            node_token = rotate_node_token(node)

        model, _ = Model.objects.get_or_create(
            tenant=tenant,
            name="fraud-detector",
            defaults={"task": TaskKind.CLASSIFIER, "description": "Demo fraud classifier"},
        )
        if not model.versions.exists():
            self.stdout.write("training the demo fraud model…")
            data, details = train_fraud_model()
            version = create_version(
                model,
                data,
                feature_names=FEATURE_NAMES,
                source_commit="demo",
                description="trained by bootstrap_demo on generated data",
                **details,
            )
            set_alias(model, "production", version, user_actor(admin), "demo bootstrap")
        self._text_model(tenant, admin)
        self._autoscaled_model(tenant, model, admin)
        return {
            "admin_user": "admin",
            "admin_password": password if admin.check_password(password) else "(unchanged)",
            "engineer_user": "engineer",
            "engineer_password": engineer_password
            if engineer.check_password(engineer_password)
            else "(unchanged)",
            "api_key": api_key,
            "node_token": node_token,
            "tenant": tenant.slug,
            "model": model.name,
        }
