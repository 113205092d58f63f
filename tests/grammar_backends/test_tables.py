"""The backends' tables of a vocabulary, made once before the scheduler forks its compile process
and used by both (``grammar_backends/tables.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from guidespec.bitmask import allowed_ids, bitmask_width
from guidespec.grammar_backends import create_backend, prepare_tables
from guidespec.grammar_backends.llguidance_backend import LLGuidanceBackend
from guidespec.grammar_backends.xgrammar_backend import XGrammarBackend
from guidespec.model_files import load_tokenizer, shared_tokenizer
from guidespec.protocol import GuidedDecoding

VOCAB, STOPS = 49152, (2,)


def test_kept_tables_are_used_by_backends_in_a_forked_process(real_model_dir: Path) -> None:
    """After ``prepare_tables``, a backend made from the same tokenizer in a process forked
    afterwards (as the compile process is) or here takes the kept tables (the same objects, not
    made again) and masks with them; another tokenizer or stop list gets its own, and tables made
    without preparing are not kept."""
    tokenizer = shared_tokenizer(real_model_dir)
    assert shared_tokenizer(real_model_dir) is tokenizer
    prepare_tables(("xgrammar", "llguidance"), tokenizer, VOCAB, STOPS)
    kept_info = XGrammarBackend.tables(tokenizer, VOCAB, STOPS)
    kept_llg = LLGuidanceBackend.tables(tokenizer, VOCAB, STOPS)[0]
    digit, letter = (tokenizer.encode(c, add_special_tokens=False)[0] for c in "7x")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the kept tables, and backends that mask with them
        code = 1
        try:
            for name in ("llguidance", "xgrammar"):
                backend = create_backend(name, shared_tokenizer(real_model_dir), VOCAB, STOPS)
                kept = backend.tokenizer is kept_llg if name == "llguidance" else backend.info is kept_info  # type: ignore[attr-defined]
                matcher = backend.create_matcher(backend.compile(GuidedDecoding(regex="[0-9]+")))
                bitmask = np.zeros((1, bitmask_width(VOCAB)), dtype=np.int32)
                backend.fill_bitmasks([matcher], bitmask, [0])
                allowed = set(allowed_ids(bitmask[0]).tolist())
                code = 0 if kept and digit in allowed and letter not in allowed else 2
                if code:
                    break
        finally:
            os.write(write, bytes([code]))
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == bytes([0]), "the forked process's backends did not use the kept tables"
    os.waitpid(pid, 0)
    assert create_backend("xgrammar", tokenizer, VOCAB, STOPS).info is kept_info  # type: ignore[attr-defined]
    assert create_backend("xgrammar", tokenizer, VOCAB, (1, 2)).info is not kept_info  # type: ignore[attr-defined]
    other = load_tokenizer(real_model_dir)
    assert create_backend("llguidance", other, VOCAB, STOPS).tokenizer is not kept_llg  # type: ignore[attr-defined]
    assert XGrammarBackend.tables(other, VOCAB, STOPS) is not XGrammarBackend.tables(other, VOCAB, STOPS)
