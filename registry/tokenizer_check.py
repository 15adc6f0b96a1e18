"""Check an uploaded tokenizer in a child process: ``python -m registry.tokenizer_check`` with
the tokenizer.json on stdin. Prints ``{"ok": true}`` or ``{"error": ...}``.

``tokenizers`` parses the file in Rust and builds its vocabulary in memory; run here, a crafted
file that takes too long or too much memory is this child's problem (killed at a timeout), not
the web server's. No Django here: the child starts in a fraction of a second.
"""

from __future__ import annotations

import json
import sys


def check(data: bytes) -> dict[str, object]:
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(data.decode())
        # A tokenizer that loads but cannot encode would fail every request: refuse it now.
        tokenizer.encode("Switchyard checks this tokenizer.")
    except Exception as exc:  # tokenizers raises plain Exception for a bad file
        return {"error": f"not a valid tokenizer.json: {str(exc)[:300]}"}
    return {"ok": True}


if __name__ == "__main__":
    print(json.dumps(check(sys.stdin.buffer.read())))
