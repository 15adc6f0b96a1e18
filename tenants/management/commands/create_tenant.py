"""Create a tenant with a quota and an API key; prints the key once (as JSON with --json)."""

import json as jsonlib
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from tenants.audit import Actor
from tenants.keys import create_api_key
from tenants.models import KeyPriority, Quota, Tenant


class Command(BaseCommand):
    help = "Create a tenant, its quota and a first API key (printed once)."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("slug")
        parser.add_argument("--name", default="")
        parser.add_argument("--rps", type=float, default=100.0, help="requests per second")
        parser.add_argument("--burst", type=int, default=200)
        parser.add_argument("--key-name", default="default")
        parser.add_argument(
            "--key-priority",
            choices=KeyPriority.labels,
            default=KeyPriority.INTERACTIVE.label,
            help="the key's scheduling class: its default and the best its requests may ask",
        )
        parser.add_argument("--json", action="store_true", help="print machine-readable JSON")

    def handle(
        self,
        slug: str,
        name: str,
        rps: float,
        burst: int,
        key_name: str,
        key_priority: str,
        json: bool,
        **options: Any,
    ) -> None:
        if Tenant.objects.filter(slug=slug).exists():
            raise CommandError(f"tenant {slug!r} already exists")
        with transaction.atomic():
            tenant = Tenant.objects.create(slug=slug, name=name or slug)
            Quota.objects.create(tenant=tenant, requests_per_second=rps, burst=burst)
            priority = KeyPriority.labels.index(key_priority)
            actor = Actor(None, "create_tenant command")
            _, raw = create_api_key(tenant, key_name, actor, priority=priority)
        if json:
            self.stdout.write(_dumps({"tenant": slug, "api_key": raw}))
        else:
            self.stdout.write(f"tenant {slug} created; API key (shown once): {raw}")


_dumps = jsonlib.dumps
