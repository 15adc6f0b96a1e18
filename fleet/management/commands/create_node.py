"""Create a serving node and print its token once."""

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from fleet.models import Node
from fleet.nodes import create_node
from tenants.audit import Actor
from tenants.models import Tenant


class Command(BaseCommand):
    help = "Create a node allowed to run a serving agent; prints its token (shown once)."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("name")
        parser.add_argument("--tenant", help="serve only this tenant's models (slug)")
        parser.add_argument("--quiet", action="store_true", help="print only the token")

    def handle(self, name: str, tenant: str | None, quiet: bool, **options: Any) -> None:
        if Node.objects.filter(name=name).exists():
            raise CommandError(f"node {name!r} already exists")
        owner = None
        if tenant:
            owner = Tenant.objects.filter(slug=tenant).first()
            if owner is None:
                raise CommandError(f"no tenant {tenant!r}")
        _, token = create_node(name, owner, Actor(None, "create_node command"))
        if quiet:
            self.stdout.write(token)
        else:
            self.stdout.write(
                f"node {name} created. Start its agent with:\n"
                f"  python -m serving_agent --platform http://PLATFORM:8000 --token {token}"
            )
