"""Train the demo text generator (a byte-level GPT) and write it as a safetensors file."""

from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand

from ...demo.storyteller import train_text_model

SAMPLE_PROMPT = "Call me Ishmael. "


class Command(BaseCommand):
    help = (
        "Train a small byte-level GPT on the public-domain text in platform_site/demo/data for a "
        "time budget on the CPU and write it as a safetensors artifact (format 'textgen')."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("output", type=Path, help="where to write the .safetensors file")
        parser.add_argument("--seconds", type=float, default=90.0, help="training time budget")
        parser.add_argument("--seed", type=int, default=0)

    def handle(self, output: Path, seconds: float, seed: int, **options: Any) -> None:
        from serving_agent.textgen import from_safetensors, generate

        data, details = train_text_model(seconds=seconds, seed=seed)
        output.write_bytes(data)
        metrics = details["offline_metrics"]
        self.stdout.write(f"wrote {output} ({len(data)} bytes): {details['description']}")
        self.stdout.write(
            f"validation loss {metrics['val_loss']} nats/byte, {metrics['bits_per_byte']} bits/byte"
        )
        model = from_safetensors(data)
        for temperature in (0.0, 0.8):
            text = generate(model, SAMPLE_PROMPT, 200, temperature=temperature, seed=seed)
            self.stdout.write(f"sample at temperature {temperature}:\n{SAMPLE_PROMPT}{text}\n")
