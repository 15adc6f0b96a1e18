"""Train the demo fraud classifier and write it as an ONNX file."""

from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand

from ...demo.fraud import train_fraud_model


class Command(BaseCommand):
    help = "Train the demo fraud classifier with torch on generated data and export it to ONNX."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("output", type=Path, help="where to write the .onnx file")
        parser.add_argument("--epochs", type=int, default=8)

    def handle(self, output: Path, epochs: int, **options: Any) -> None:
        data, details = train_fraud_model(epochs=epochs)
        output.write_bytes(data)
        self.stdout.write(
            f"wrote {output} ({len(data)} bytes), accuracy {details['offline_metrics']['accuracy']}"
        )
