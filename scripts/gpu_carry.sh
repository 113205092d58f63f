#!/bin/bash
# Prepare what a bare GPU machine lacks, for scripts/gpu_check.sh: wheels of the packages its image
# does not have (in .whl/, for CPython 3.12 on x86-64, the versions this .venv holds) and the
# default model's tokenizer files (in .gpu/tok/). Both folders are ignored by git (added to
# .git/info/exclude): name them in the device call's carry list. ~12 MB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
for folder in /.whl/ /.gpu/; do
    grep -qxF "$folder" .git/info/exclude 2>/dev/null || echo "$folder" >>.git/info/exclude
done
packages=(pyzmq xgrammar apache-tvm-ffi pydantic pydantic_core annotated-types typing-inspection llguidance gguf
          jsonschema jsonschema-specifications referencing rpds-py exrex)
platforms=()
for p in manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35; do
    platforms+=(--platform "${p}_x86_64")
done
mkdir -p .whl
for name in "${packages[@]}"; do
    version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "$name==$version"
done
model=$(.venv/bin/python -c "from guidespec.model_files import resolve_model_dir; print(resolve_model_dir(None, False))")
mkdir -p .gpu/tok
for f in tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json; do
    [ -f "$model/$f" ] && cp "$model/$f" .gpu/tok/
done
du -sh .whl .gpu
echo 'then: run(command="bash scripts/gpu_check.sh", carry=[".whl", ".gpu"])'
