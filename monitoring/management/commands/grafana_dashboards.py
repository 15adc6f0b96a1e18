"""Write the Grafana dashboards (``monitoring.dashboards``) as JSON files."""

from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from monitoring.dashboards import render_all


class Command(BaseCommand):
    help = (
        "Write the Grafana dashboards (fleet, model, generation, tenants, SLOs) as JSON into "
        "each folder given: deploy/grafana/dashboards and the Helm chart's dashboards folder."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--out", action="append", required=True, help="a folder to write into (repeatable)"
        )

    def handle(self, out: list[str], **options: Any) -> None:
        files = render_all()
        for folder in map(Path, out):
            try:
                folder.mkdir(parents=True, exist_ok=True)
                for name, text in files.items():
                    (folder / name).write_text(text)
            except OSError as exc:
                raise CommandError(f"cannot write into {folder}: {exc.strerror}") from None
            self.stderr.write(f"wrote {len(files)} dashboards into {folder}")
