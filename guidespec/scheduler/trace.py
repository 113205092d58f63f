"""Per-step timings, as a Chrome trace (chrome://tracing, Perfetto) and as summary figures.

The scheduler records its own phases; rank 0 reports when its forward ran, when the bitmask
was in hand, and how long it waited for its other masks (draft steps', a fused step's verify
masks: inside a graph the trampolines time those waits, while the device stands still).
"Scheduler time outside the forward" is the scheduler work the workers wait for: building and
writing the inputs, emitting the outputs, and any mask filling that outlasts the forward
(filling that overlaps the forward costs nothing). "Mask wait" is rank 0's waiting for grammar
masks, all of it: the grammar's cost on the step (an unfused step's bitmask wait is the host's:
on a GPU the forward may still be running meanwhile).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from guidespec import envs
from guidespec.cuda_ext.channel import VERIFY


def step_trace() -> StepTrace | None:
    """The engine's step trace where ``GUIDESPEC_TRACE`` asks for one, else None: a trace keeps
    every step's spans (~2.8 KB a guided step) until the engine stops, a server's memory growing
    without end, and recording them cost ~3% of the scheduler at batch 1."""
    return StepTrace() if envs.trace_path() else None


@dataclass
class StepTrace:
    events: list[dict[str, object]] = field(default_factory=list)
    step_s: float = 0.0
    outside_forward_s: float = 0.0
    fill_s: float = 0.0
    forward_s: float = 0.0
    draft_s: float = 0.0
    draft_fill_s: float = 0.0
    mask_wait_s: float = 0.0
    steps: int = 0
    guided_steps: int = 0
    fused_steps: int = 0

    def record(
        self,
        step: int,
        t: dict[str, float],
        worker: np.ndarray,
        batch: int,
        guided_rows: int,
        draft_s: float = 0.0,
        tokens: int = 0,
        draft_fills: Sequence[tuple[int, float, float]] = (),
        fused: bool = False,
        mask_waits: np.ndarray | None = None,
        as_next: bool = False,
    ) -> None:
        """``t``: scheduler wall times (start, inputs, mask_start, mask, outputs, advanced: the
        grammars advanced by the outputs, emit_start, end: the rest of the emit, which a step run
        ahead of the next leaves until that one's bitmask is sent); ``worker``:
        rank 0's (forward_start, forward_end, mask_ready, done); ``draft_s``: rank 0's drafter
        proposing the next step's drafts, at the end of its step; ``draft_fills``: the scheduler
        filling each of those draft steps' masks (draft step, start, end), which rank 0 waits for;
        ``fused``: rank 0 ran the whole step as one graph (worker/drafting/step_graph.py), one span;
        ``mask_waits``: rank 0's other waits for masks, rows of (draft index or -2 for a fused
        step's verify masks, start, end), nested in its spans; ``as_next``: its inputs went as a
        StepNext (``protocol.py``)."""
        forward_start, forward_end, mask_ready, done = (float(x) for x in worker)
        exposed_fill = max(0.0, t["mask"] - forward_end) if guided_rows else 0.0
        self.step_s += t["end"] - t["start"]
        emitting = (t["advanced"] - t["outputs"]) + (t["end"] - t["emit_start"])  # (the next step's fill between)
        self.outside_forward_s += (t["inputs"] - t["start"]) + emitting + exposed_fill
        self.fill_s += t["mask"] - t["mask_start"]
        self.forward_s += forward_end - forward_start
        self.draft_s += draft_s
        if guided_rows and not fused:
            self.mask_wait_s += max(0.0, mask_ready - forward_end)
        self.steps += 1
        self.guided_steps += bool(guided_rows)
        self.fused_steps += fused
        args: dict[str, object] = {"step": step, "batch": batch, "tokens": tokens, "guided_rows": guided_rows}
        args["inputs"] = "StepNext" if as_next else "StepInputs"
        self._span("schedule + write inputs", t["start"], t["inputs"], 1, args)
        if guided_rows:
            self._span("fill + write bitmask", t["mask_start"], t["mask"], 1, args)
        self._span("wait for outputs", t["mask"], t["outputs"], 1, args)
        self._span("advance grammars", t["outputs"], t["advanced"], 1, args)
        self._span("emit", t["emit_start"], t["end"], 1, args)
        if fused:
            self._span("fused step (verify, accept, draft)", forward_start, done, 2, args)
            if draft_s > 0:  # its draft steps, timed apart (nested in it)
                self._span("draft steps", done - draft_s, done, 2, args)
        else:
            self._worker_spans(forward_start, forward_end, mask_ready, done, draft_s, guided_rows, args)
        for index, start, end in mask_waits if mask_waits is not None else ():
            name = "wait for verify masks" if index == VERIFY else f"wait for draft {int(index)} masks"
            self._span(name, start, end, 2, args)
            self.mask_wait_s += max(0.0, end - start)
        for index, start, end in draft_fills:
            self._span(f"fill draft step {index} masks", start, end, 1, args)
            self.draft_fill_s += end - start

    def _worker_spans(
        self,
        forward_start: float,
        forward_end: float,
        mask_ready: float,
        done: float,
        draft_s: float,
        guided_rows: int,
        args: dict[str, object],
    ) -> None:
        self._span("forward", forward_start, forward_end, 2, args)
        if guided_rows:
            self._span("wait for bitmask", forward_end, max(forward_end, mask_ready), 2, args)
        self._span("mask + sample", max(forward_end, mask_ready), done - draft_s, 2, args)
        if draft_s > 0:
            self._span("propose drafts", done - draft_s, done, 2, args)

    def summary(self) -> dict[str, float]:  # noqa: D401
        return {
            "steps": self.steps,
            "guided_steps": self.guided_steps,
            "fused_steps": self.fused_steps,
            "mean_step_ms": 1000 * self.step_s / max(1, self.steps),
            "outside_forward_fraction": self.outside_forward_s / self.step_s if self.step_s else 0.0,
            "mean_fill_ms": 1000 * self.fill_s / max(1, self.guided_steps),
            "mean_forward_ms": 1000 * self.forward_s / max(1, self.steps),
            "draft_fraction": self.draft_s / self.step_s if self.step_s else 0.0,
            "draft_fill_fraction": self.draft_fill_s / self.step_s if self.step_s else 0.0,
            "mask_wait_fraction": self.mask_wait_s / self.step_s if self.step_s else 0.0,
        }

    def write(self, path: Path) -> None:
        names = [
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "scheduler"}},
            {"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "worker rank 0"}},
        ]
        path.write_text(json.dumps({"traceEvents": names + self.events, "summary": self.summary()}))

    def _span(self, name: str, start: float, end: float, pid: int, args: dict[str, object]) -> None:
        self.events.append(
            {
                "name": name,
                "ph": "X",
                "ts": start * 1e6,
                "dur": max(0.0, end - start) * 1e6,
                "pid": pid,
                "tid": 0,
                "args": args,
            }
        )
