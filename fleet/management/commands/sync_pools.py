"""Create or update fleet pools from a JSON file (the Helm chart's ``pools.json``)."""

import json
from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from fleet.pools import PoolFileError, parse_pools, sync_pools
from tenants.audit import Actor


class Command(BaseCommand):
    help = (
        "Make the fleet's pools match a JSON list of pools (the Helm chart's pools.json): "
        "create or update each; with --prune, delete unused pools the file does not name."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        source = parser.add_mutually_exclusive_group(required=True)
        source.add_argument("path", nargs="?", help="the JSON file (a list of pools)")
        source.add_argument("--json", dest="text", help="the list itself, as JSON text")
        parser.add_argument(
            "--prune", action="store_true", help="delete pools not in the file and not in use"
        )

    def handle(self, path: str | None, text: str | None, prune: bool, **options: Any) -> None:
        where = path or "--json"
        try:
            data = json.loads(text if text is not None else Path(str(path)).read_bytes())
        except OSError as exc:
            raise CommandError(f"cannot read {path}: {exc.strerror}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CommandError(f"{where} is not JSON: {exc}") from None
        try:
            wanted = parse_pools(data)
        except PoolFileError as exc:
            raise CommandError(f"{where}: {exc}") from None
        result = sync_pools(wanted, Actor(None, "sync_pools command"), prune=prune)
        for verb, names in (
            ("created", result.created),
            ("updated", result.updated),
            ("unchanged", result.unchanged),
            ("pruned", result.pruned),
            ("kept (in use)", result.kept),
        ):
            if names:
                self.stdout.write(f"{verb}: {', '.join(names)}")
