"""Create a tenant with a quota and an API key; prints the key once (as JSON with --json).

A key acts as the person who created it: ``--owner`` names that person (made a member of the
tenant with ``--owner-role``, and created without a password if new). A key with no owner
may infer and read but never change anything."""

import json as jsonlib
from argparse import ArgumentParser
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from platform_site.errors import Invalid
from tenants.audit import Actor, audit
from tenants.keys import clean_scopes, create_api_key
from tenants.models import SCOPES, KeyPriority, Membership, Quota, Role, Scope, Tenant


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
        parser.add_argument(
            "--scopes",
            default=Scope.PREDICT,
            help=f"the key's scopes, comma separated, of {','.join(SCOPES)} (default: predict)",
        )
        parser.add_argument("--owner", default="", help="username the key acts as")
        parser.add_argument(
            "--owner-role", choices=Role.values, default=Role.ENGINEER, help="the owner's role"
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
        scopes: str,
        owner: str,
        owner_role: str,
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
            created = {"name": tenant.name, "requests_per_second": rps, "burst": burst}
            audit(tenant.pk, actor, "tenant.create", slug, after=created)
            if owner:
                person = get_user_model().objects.filter(username=owner).first()
                if person is None:
                    person = get_user_model().objects.create_user(owner)  # no password
                Membership.objects.create(tenant=tenant, user=person, role=owner_role)
                grant = {"user": owner, "role": owner_role}
                audit(tenant.pk, actor, "membership.create", f"{owner} @ {slug}", after=grant)
                actor = Actor(person.pk, f"{owner} (create_tenant command)", owner_role)
            try:
                wanted = clean_scopes(s.strip() for s in scopes.split(",") if s.strip())
                _, raw = create_api_key(tenant, key_name, actor, priority=priority, scopes=wanted)
            except Invalid as exc:
                raise CommandError(f"--{exc.field}: {exc}") from None
        if json:
            self.stdout.write(_dumps({"tenant": slug, "api_key": raw}))
        else:
            self.stdout.write(f"tenant {slug} created; API key (shown once): {raw}")


_dumps = jsonlib.dumps
