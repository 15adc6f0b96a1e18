"""Write the Prometheus recording and alerting rules (``monitoring.prometheus_rules``)."""

import re
from argparse import ArgumentParser
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from monitoring.prometheus_rules import render
from monitoring.slo import BURN_WINDOWS

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_window(text: str) -> tuple[str, timedelta]:
    """``1h=1m``: the burn window named 1h, one minute long."""
    name, _, length = text.partition("=")
    found = re.fullmatch(r"(\d+)([smhd])", length.strip())
    if name not in BURN_WINDOWS or found is None or int(found[1]) == 0:
        raise CommandError(
            f"--window {text!r}: NAME=LENGTH, NAME one of {', '.join(BURN_WINDOWS)} and LENGTH "
            "like 30s, 5m or 2h"
        )
    return name, timedelta(seconds=int(found[1]) * UNITS[found[2]])


class Command(BaseCommand):
    help = (
        "Write the Prometheus rules: recording rules for error and slow ratios, multi-window "
        "burn-rate alerts against each model's SLOs (which /metrics exports), and the "
        "platform's operations alerts. Without --out, print them."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--out", action="append", default=[], help="a file to write (may be repeated)"
        )
        parser.add_argument(
            "--window",
            action="append",
            default=[],
            help="shorten a burn window for a test, keeping the rules' shape: 1h=1m (repeatable)",
        )
        parser.add_argument(
            "--min-events",
            type=int,
            help="requests a long window needs before it alerts (SWITCHYARD_SLO_MIN_EVENTS)",
        )

    def handle(
        self, out: list[str], window: list[str], min_events: int | None, **options: Any
    ) -> None:
        if min_events is not None and min_events < 0:
            raise CommandError("--min-events must be 0 or more")
        text = render(dict(parse_window(w) for w in window), min_events)
        if not out:
            self.stdout.write(text, ending="")
        for path in out:
            try:
                Path(path).write_text(text)
            except OSError as exc:
                raise CommandError(f"cannot write {path}: {exc.strerror}") from None
            self.stderr.write(f"wrote {path}")
