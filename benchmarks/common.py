"""Helpers shared by the benchmarks: the workload's prompts, memory bandwidth, machine facts."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = REPO.parent / "shared" / "data" / "jsonschemabench" / "workload.jsonl"


def workload_chats(prefix: str = "JME_", limit: int | None = None) -> list[list[dict[str, str]]]:
    """Chat prompts of the workload whose id starts with ``prefix``."""
    path = Path(os.environ.get("GUIDESPEC_WORKLOAD", WORKLOAD))
    chats = []
    with path.open() as f:
        for line in f:
            case = json.loads(line)
            if case["id"].startswith(prefix):
                chats.append(case["messages"])
    return chats[:limit]


def memory_bandwidth_gb_s(size_mb: int = 512, repeats: int = 5) -> dict[str, float]:
    """Read bandwidth (a sum over a large tensor) and copy bandwidth (bytes read + written)."""
    x = torch.ones(size_mb * 1024 * 1024 // 4)
    y = torch.empty_like(x)
    x.sum(), y.copy_(x)
    start = time.perf_counter()
    for _ in range(repeats):
        x.sum()
    read = x.numel() * 4 * repeats / (time.perf_counter() - start) / 1e9
    start = time.perf_counter()
    for _ in range(repeats):
        y.copy_(x)
    copy = 2 * x.numel() * 4 * repeats / (time.perf_counter() - start) / 1e9
    return {"read_gb_s": read, "copy_gb_s": copy}


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


def commit() -> str:
    """This checkout's short commit, saying so where tracked files have uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    """A table cell: ``value`` formatted, or a dash where there is none."""
    return "–" if value is None else f"{value:{spec}}{suffix}"


def print_rounds_table(rounds: dict[str, list[dict[str, float]]], first_column: str = "what") -> None:
    """A markdown table of per-round measures: a row per measure, a column per setting, each cell
    the rounds' median and range (seconds, 2 decimals)."""
    import statistics

    names = list(rounds)
    print(f"\n| {first_column} | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
    for key in rounds[names[0]][0]:
        cells = []
        for name in names:
            values = [r[key] for r in rounds[name]]
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        print(f"| {key} | " + " | ".join(cells) + " |")
