"""Regenerate known_limitations.json: run after a backend upgrade, then read the diff.

.venv/bin/python -m tests.grammar_backends.make_known_limitations
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

from guidespec.grammar_backends import BACKENDS, create_backend
from guidespec.model_files import resolve_model_dir
from tests.grammar_backends.dataset import disagreements

STOP = 2  # <|im_end|> of SmolLM2-Instruct


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None, show_progress=False))
    out = {
        name: disagreements(name, create_backend(name, tokenizer, 49152, (STOP,)), tokenizer, STOP) for name in BACKENDS
    }
    path = Path(__file__).with_name("known_limitations.json")
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print({name: len(v) for name, v in out.items()})


if __name__ == "__main__":
    main()
