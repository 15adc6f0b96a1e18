"""Recognising pickle data, so that it is refused whatever format it claims.

Unpickling runs code chosen by whoever wrote the file; Switchyard never does it. The registry
refuses such an upload, and the agent refuses an archive's pickled members before extracting
them (``hf_archive``), both with these recognisers and a message that says why, rather than a
parser's confusing failure (or, worse, a later load that unpickles it). It lives on the agent's
side because the agent is packaged alone (no Django); the registry imports it from here.

Recognised without unpickling: protocol 2-5 streams by their header, protocol 0/1 streams by
walking their opcodes with ``pickletools`` (which only parses), and zip archives holding
``.pkl`` members (``torch.save``'s format, and what joblib and others write inside archives).
"""

from __future__ import annotations

import pickletools
import re
import zipfile
from typing import IO, cast

# Enough of the file's start to recognise a protocol 0/1 stream's first opcodes.
HEAD_BYTES = 64 * 1024
# How protocol 0/1 pickles import what they call: "module name" on one line each.
_IMPORTING_OPCODES = {"GLOBAL", "INST"}
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
# Text can parse as a few opcodes by chance; a pickle keeps parsing.
MIN_OPCODES = 8


def pickle_protocol(head: bytes) -> int | None:
    """The protocol (2-5) of a pickle stream starting with ``head`` by its PROTO header, or None."""
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return head[1]
    return None


def pickle_kind(file: IO[bytes] | IO[str]) -> str | None:
    """What kind of pickle data ``file`` (seekable) holds, or None when it holds none."""
    file.seek(0)
    head = file.read(HEAD_BYTES)
    file.seek(0)
    if isinstance(head, str):
        # A text file object (a tokenizer given as a string): only protocol 0 is text.
        old = _parses_as_old_pickle(head.encode("utf-8", "surrogateescape"))
        return "a pickle (protocol 0)" if old else None
    protocol = pickle_protocol(head)
    if protocol is not None:
        return f"a pickle (protocol {protocol})"
    if head[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(cast(IO[bytes], file)) as zf:
                members = [n for n in zf.namelist() if n.endswith(".pkl")]
        except zipfile.BadZipFile:
            return None
        finally:
            file.seek(0)
        if members:
            return f"a zip archive holding pickled {members[0]!r} (torch.save writes these)"
        return None
    if _parses_as_old_pickle(head):
        return "a pickle (protocol 0 or 1)"
    return None


def _parses_as_old_pickle(head: bytes) -> bool:
    """True when ``head`` starts a protocol 0/1 pickle that imports something (what makes one
    dangerous), or is a whole small pickle of plain data."""
    imports, opcodes = False, 0
    try:
        for opcode, arg, pos in pickletools.genops(head):
            opcodes += 1
            if opcode.name in _IMPORTING_OPCODES:
                module, _, name = str(arg).partition(" ")
                if not (_DOTTED.fullmatch(module) and _DOTTED.fullmatch(name)):
                    return False
                imports = True
            if opcode.name == "STOP":
                whole = pos is not None and not head[pos + 1 :].strip()
                return whole and (imports or opcodes >= 3)
    except ValueError:  # not an opcode, or the head ended inside one
        pass
    return imports and opcodes >= MIN_OPCODES
