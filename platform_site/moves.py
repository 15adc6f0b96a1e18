"""Migration operations for models that moved to another app and kept their tables.

Such a move changes only Django's idea of which app owns the model (``SeparateDatabaseAndState``
with state operations alone, the model keeping its ``db_table``); no row is copied. The content
types move with it, so permissions and admin history stay attached to the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import migrations

CONTENTTYPES = ("contenttypes", "0002_remove_content_type_name")


def move_content_types(old_app: str, new_app: str, models: Iterable[str]) -> migrations.RunPython:
    """Relabel the content types of ``models`` (lower-case model names) from ``old_app`` to
    ``new_app``; reversible. A fresh database has none yet (they are made after ``migrate``)."""
    names = list(models)

    def relabel(apps: Any, source: str, target: str) -> None:
        content_type = apps.get_model("contenttypes", "ContentType")
        for name in names:
            if not content_type.objects.filter(app_label=target, model=name).exists():
                content_type.objects.filter(app_label=source, model=name).update(app_label=target)

    def forward(apps: Any, schema_editor: Any) -> None:
        relabel(apps, old_app, new_app)

    def backward(apps: Any, schema_editor: Any) -> None:
        relabel(apps, new_app, old_app)

    return migrations.RunPython(forward, backward)
