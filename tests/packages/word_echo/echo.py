"""A generating package: ``generate`` yields the prompt's words one at a time (each but the
first with its leading space). A few prompts do something else, for the tests:

- ``count`` counts from 1 without end (" 2", " 3"...), until the agent stops it;
- ``raise N`` yields N words, then raises;
- ``invalid`` raises InvalidInput before its first word (the caller's fault: a 400);
- ``hang`` yields one word, then sleeps forever (the agent kills the worker);
- ``bytes`` yields bytes, not text;
- ``params`` yields the parameters it was given, as JSON.
"""

import itertools
import json
import time

from switchyard_client.model import InvalidInput


class WordEcho:
    def load(self):
        self.loaded_at = time.time()

    def generate(self, prompt, parameters):
        words = prompt.split()
        command = words[0] if words else ""
        if command == "count":
            for n in itertools.count(1):
                yield str(n) if n == 1 else f" {n}"
        elif command == "raise":
            for n in range(int(words[1])):
                yield f"w{n} "
            raise ValueError("asked to fail")
        elif command == "invalid":
            raise InvalidInput("this prompt is refused")
        elif command == "hang":
            yield "waiting"
            while True:
                time.sleep(60)
        elif command == "bytes":
            yield b"not text"
        elif command == "params":
            yield json.dumps(parameters, sort_keys=True)
        else:
            for i, word in enumerate(words):
                yield word if i == 0 else f" {word}"
