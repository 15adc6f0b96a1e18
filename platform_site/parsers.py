"""The API's JSON body parser, in a module of its own: DRF's settings import it while
``rest_framework.views`` is being imported, so it must not import views or the schema."""

from __future__ import annotations

from typing import Any

import orjson
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser


class JSONBodyParser(JSONParser):
    """Every API's JSON body, read with orjson: it refuses nesting past its depth limit, where
    the stdlib's parser (DRF's ``JSONParser``) recursed until RecursionError, a 500; and bytes
    that are not UTF-8. Either is a 400 naming the problem."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        try:
            return orjson.loads(stream.read() if stream is not None else b"")
        except orjson.JSONDecodeError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
