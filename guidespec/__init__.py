"""guidespec: guided decoding and speculative decoding together, across processes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from guidespec.protocol import SamplingParams

__all__ = ["LLM", "SamplingParams", "GenerationOutput", "EngineDeadError", "RequestError"]

if TYPE_CHECKING:
    from guidespec.llm import LLM, EngineDeadError, GenerationOutput, RequestError


def __getattr__(name: str) -> Any:
    if name in ("LLM", "GenerationOutput", "EngineDeadError", "RequestError"):
        from guidespec import llm

        return getattr(llm, name)
    raise AttributeError(name)
