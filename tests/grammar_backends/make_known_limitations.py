"""Regenerate known_limitations.json: run after a backend upgrade, then read the diff.

.venv/bin/python -m tests.grammar_backends.make_known_limitations
"""

from __future__ import annotations

import json
from pathlib import Path

from guidespec.grammar_backends import BACKENDS, create_backend
from tests.grammar_backends.dataset import byte_level_tokenizer, disagreements


def main() -> None:
    tokenizer = byte_level_tokenizer()
    stop = tokenizer.eos_token_id
    out = {
        name: disagreements(name, create_backend(name, tokenizer, len(tokenizer), (stop,)), tokenizer, stop)
        for name in BACKENDS
    }
    path = Path(__file__).with_name("known_limitations.json")
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print({name: len(v) for name, v in out.items()})


if __name__ == "__main__":
    main()
