"""Set up the embedded demo: admin (an approver) and engineer users, demo tenant and key, a node,
the fraud model serving, the storyteller generator, the MiniLM embedding model, and the fraud
model deployed with autoscaling on the local pool.

Idempotent: a second run reuses what exists. Credentials are kept in ``var/demo.json`` (0600)
so the start script can print them and hand the node token to the local agent; the command's own
output names no secret, since it ends up in ``var/bootstrap.log``.
"""

import json
import os
import secrets
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.base_user import AbstractBaseUser
from django.core.management.base import BaseCommand
from django.db import transaction

from fleet.models import ClusterKind, Deployment, Node, Pool
from fleet.nodes import create_node, rotate_node_token
from platform_site.secret_files import write_private
from registry.models import Model, TaskKind
from registry.services import create_version, set_alias
from tenants.audit import user_actor
from tenants.keys import create_api_key, identify_key
from tenants.models import Membership, Quota, Role, Scope, Tenant

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
        from ...demo.storyteller import train_text_model  # torch training: only here

        self._generator(
            tenant,
            admin,
            name="storyteller",
            description="Demo text generator",
            what="text model",
            seconds_env=("SWITCHYARD_DEMO_TEXT_SECONDS", 90.0),
            train=train_text_model,
            format="textgen",
        )

    def _llama_model(self, tenant: Tenant, admin: AbstractBaseUser) -> None:
        """The demo Hugging Face generator: a small Llama and its BPE tokenizer, trained here
        in seconds and uploaded as an ``hf`` archive (safetensors, tokenizer.json, chat
        template)."""
        from ...demo.llama_storyteller import train_llama_storyteller  # torch: only here

        self._generator(
            tenant,
            admin,
            name="llama-storyteller",
            description="Demo Llama-family generator",
            what="Llama model",
            seconds_env=("SWITCHYARD_DEMO_LLAMA_SECONDS", 20.0),
            train=train_llama_storyteller,
            format="hf",
        )

    def _generator(
        self,
        tenant: Tenant,
        admin: AbstractBaseUser,
        *,
        name: str,
        description: str,
        what: str,
        seconds_env: tuple[str, float],
        train: Callable[..., tuple[bytes, dict[str, Any]]],
        format: str,
    ) -> None:
        """A demo generator trained here for a bounded time (its environment variable, in
        seconds) and put in production, once: a second run finds its version and stops."""
        model, _ = Model.objects.get_or_create(
            tenant=tenant,
            name=name,
            defaults={"task": TaskKind.GENERATOR, "description": description},
        )
        if model.versions.exists():
            return
        variable, default = seconds_env
        seconds = float(os.environ.get(variable, str(default)))
        self.stdout.write(f"training the demo {what} for {seconds:g} s…")
        data, details = train(seconds=seconds)
        version = create_version(
            model,
            data,
            format=format,
            source_commit="demo",
            # Both have 256 positions: prompt and continuation share them.
            max_input_tokens=128,
            max_output_tokens=128,
            **details,
        )
        set_alias(model, "production", version, user_actor(admin), "demo bootstrap")

    def _embedding_model(self, tenant: Tenant, admin: AbstractBaseUser) -> None:
        """The demo embedding model: MiniLM-L6 from the weights a Python package ships, exported
        to ONNX with its pooling (cached across runs) and served with its tokenizer, so it
        answers /v1/embeddings and OIP with text."""
        model, _ = Model.objects.get_or_create(
            tenant=tenant,
            name="minilm",
            defaults={
                "task": TaskKind.EMBEDDING,
                "description": "all-MiniLM-L6-v2 sentence embeddings (384 dimensions)",
            },
        )
        if model.versions.exists():
            return
        self.stdout.write("exporting the demo embedding model to ONNX (once; then cached)…")
        from ...demo import minilm  # torch export: only here

        version = create_version(
            model,
            minilm.exported().read_bytes(),
            tokenizer=minilm.tokenizer_path().read_bytes(),
            source_commit="demo",
            description="all-MiniLM-L6-v2, mean pooling and L2 normalization in the graph",
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
        identity = identify_key(api_key) if api_key else None
        if identity is None or identity.expired():
            # The engineer's key (it acts as them): uploads and plans made with it are the
            # engineer's, so the admin can approve their promotions (four eyes).
            _, api_key = create_api_key(
                tenant,
                "demo key",
                user_actor(engineer, Role.ENGINEER),
                scopes=[Scope.PREDICT, Scope.DEPLOY],
            )

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
        self._llama_model(tenant, admin)
        self._embedding_model(tenant, admin)
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
