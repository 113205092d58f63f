"""Host overhead (issue 48): what guidespec spends a step around a model whose forward costs
microseconds, unguided and guided, batch 1 to 256, with async scheduling and without.

    python benchmarks/overhead.py [--model DIR] [--modes unguided,json,json-noclose,regex,json+ngram]
        [--batches 1,16,64,256] [--max-tokens 256] [--scheduling async,sync] [--device cpu|cuda]
        [--repeat 3] [--peers] [--threads N] [--stream]
    python benchmarks/overhead.py --batches 1,4 --max-tokens 32 --modes unguided,regex --peers  # a quick look

The model is ``random_model.py``'s "tiny" preset (2 layers, hidden 64, SmolLM2's 49,152 tokens,
random weights; built into out/tiny-model on first use) unless ``--model`` names another folder:
its forward is nearly free, so a step's time is the scheduler, the workers' Python, the grammar
and the messages between them. The modes: ``unguided``; ``json``, an array of at least 300
integers (it cannot close within the run, so every step is masked; early closing on, the
default); ``json-noclose``, the same with ``close_early=False``; ``regex``, ``[0-9a-z ]+``;
``json+ngram``, the json mode with the n-gram drafter. Everything else is the engine's defaults
(jump-forward on). Each mode runs on an engine of its own once per ``--scheduling``: ``async``
(the default: step N+1 planned and sent while step N runs; on CUDA a greedy decode step is
launched before the step before's tokens reach the host), ``sync``
(``GUIDESPEC_ASYNC_SCHEDULING=0``; an engine with a drafter runs its steps one after another
either way) and ``async-serial-worker`` (async, but the worker waits for each step's tokens
before it launches the next: ``GUIDESPEC_OVERLAP_STEPS=0``). Only ``async`` and ``sync`` run
unless ``--scheduling`` names it.

The modes of one speculative setting share an engine (per ``--scheduling``): unguided, json,
json-noclose and regex one, json+ngram another. For each batch B, B prompts (eight distinct short
ones, cycled), greedy, EOS ignored, each run to ``--max-tokens`` (``--stream``: each streamed, its
deltas taken on an event loop as a server takes them): each mode's timed generate (after
a warm-up generate of 8 tokens) in turn, ``--repeat`` rounds (default 3), so that the modes' runs
lie side by side in time on a noisy host. ms/step is a timed generate's wall time over the longest
output's token count (the prompts' step included); tok/s, all output tokens over the wall time:
each the median over the rounds. Guided ÷ unguided: the median over the rounds of a guided mode's
tok/s over unguided's in the same round (json+ngram, from another engine: over unguided's median)
at the same batch and scheduling. "CPU ms/step": each engine process's CPU time (user + system,
every thread, ``/proc``) over a timed generate, per step, the median over the rounds: less noisy
than wall time on a shared host, and on one whose cores are all busy what each process's work costs
a step (rank 0's includes its kernels' helper thread spinning between a step's regions). The span columns are medians
over the timed generates' steps of batch B in the step trace the scheduler writes at close
(``GUIDESPEC_TRACE``, ``scheduler/trace.py``), per process, plus two derived spans: "inputs out", a
step's "schedule + write inputs" end to its worker's first span (the forward; under async
scheduling this includes the wait for the step before), and "tokens back", the worker's last span
end to the scheduler's "advance grammars" start (where its emit begins: a step's grammars advanced
by its tokens; the rest of its emit, the "emit" span, comes after the next step's bitmask when that
step was sent ahead).

``--device cuda`` also runs, per batch, a 16-token generate under torch's profiler on rank 0
(``GUIDESPEC_TORCH_PROFILER_DIR``, ``worker.py``'s ``_StepProfiler``) and reports, over its
steps after the prompts' (found by the worker's ``step`` frames in the trace), kernel launches
a step (``cudaLaunchKernel``-like calls; CUDA graph launches apart) and the GPU's busy share
(kernel time over the steps' wall span). Every step of a CUDA engine then checks for the
profiler's switch file (one ``stat``), the timed ones included. The CUDA part is unverified
until run on a GPU (the profiler window and the step frames were checked on the CPU, where the
trace has no kernels).

``--peers``: llama.cpp and Hugging Face ``generate`` at batch 1 on the same weights
(``overhead_peers.py``; the tiny preset or a Hugging Face Llama folder only) with ``--threads``
threads (default: every core; give no more than the idle ones). Their ms/step leaves the
prompt's step out, ours includes it (one step in ``--max-tokens``). On the CPU ``--peers`` also
measures guidespec's model alone at each batch (``model_alone_ms_per_step``: the worker's forward
and greedy picks in this process, each row at the run's middle context, on ``--threads``
threads): what an unguided step costs beyond it is the runtime's share of the step.

Goals (issue 48), where measured: batch 1 ms/step ÷ llama.cpp's <= 1 (unguided), batch 64 ÷ batch 1
step time <= 3, guided ÷ unguided at batch 64 >= 0.95 (with the range of its rounds' ratios: on a
noisy host one round can meet it and the next not). Prints a markdown table and writes it,
with the JSON, to benchmarks/results/overhead-<device>-<date>-<commit>.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import itertools
import json
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import REPO, commit, fmt, machine  # noqa: E402

from guidespec import LLM, SamplingParams  # noqa: E402
from guidespec.protocol import GuidedDecoding  # noqa: E402

JSON_ARRAY = json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 300})
MODES: dict[str, tuple[GuidedDecoding | None, str | None]] = {  # mode -> (guided, speculative)
    "unguided": (None, None),
    "json": (GuidedDecoding(json_schema=JSON_ARRAY), None),
    "json-noclose": (GuidedDecoding(json_schema=JSON_ARRAY, close_early=False), None),
    "regex": (GuidedDecoding(regex="[0-9a-z ]+"), None),
    "json+ngram": (GuidedDecoding(json_schema=JSON_ARRAY), "ngram"),
}
# -> (GUIDESPEC_ASYNC_SCHEDULING, GUIDESPEC_OVERLAP_STEPS)
SCHEDULING = {"async": ("1", ""), "sync": ("0", ""), "async-serial-worker": ("1", "0")}
PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List the prime numbers below one hundred.",
    "Describe the water cycle to a child.",
    "What is the capital of Australia, and why not Sydney?",
    "Give three tips for learning to play the guitar.",
    "Explain how a hash table works.",
    "Translate 'good morning' into five languages.",
    "Summarize the plot of a heist film in two sentences.",
)
WARMUP_TOKENS = 8
PROFILE_TOKENS = 16
SPAN_COLUMNS = (  # the usual spans, in this order; any others follow in the order met
    "scheduler: schedule + write inputs",
    "scheduler: fill + write bitmask",
    "scheduler: wait for outputs",
    "scheduler: advance grammars",
    "scheduler: emit",
    "worker: forward",
    "worker: wait for bitmask",
    "worker: mask + sample",
    "inputs out",
    "tokens back",
)
PROCESSES = {1: "scheduler", 2: "worker"}  # trace.py's pids
LLAMA_CPP, HF = "llama.cpp (f32 GGUF)", "HF generate (fp32)"
# the worker's step() in a torch profiler trace's Python frames ("…/worker/worker.py(249): step")
STEP_FRAME = re.compile(r"worker\.py\(\d+\): step$")
LAUNCH_CALL = re.compile(r"^(cuda|cu)Launch(Cooperative)?Kernel")


def main() -> None:
    args = parse_args()
    model = model_dir(args.model)
    rows: list[dict[str, Any]] = []
    prompt_ids: list[list[int]] = []
    engines: dict[str | None, list[str]] = {}  # speculative -> its modes
    for mode in args.modes:
        engines.setdefault(MODES[mode][1], []).append(mode)
    for modes in engines.values():
        for scheduling in args.scheduling:
            rows += run_engine(model, modes, scheduling, args, prompt_ids)
            print(f"{', '.join(modes)}, {scheduling}: done", flush=True)
    add_unguided_ratios(rows)
    order = {
        (mode, scheduling): i for i, (mode, scheduling) in enumerate(itertools.product(args.modes, args.scheduling))
    }
    rows.sort(key=lambda r: (order[r["mode"], r["scheduling"]], r["batch"]))
    peers = measure_peers(model, args, prompt_ids[0]) if args.peers and prompt_ids else {}
    alone = measure_model_alone(model, args, prompt_ids) if args.peers and prompt_ids else {}
    report = {
        "meta": meta(args, model),
        "rows": rows,
        "peers": peers,
        "model_alone": alone,
        "goals": goals(rows, peers),
    }
    text = markdown(report)
    print("\n" + text)
    write_results(report, text, args.device)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a model folder (default: the tiny preset)")
    parser.add_argument("--modes", type=_names(MODES), default=list(MODES))
    parser.add_argument("--batches", type=_integers, default=[1, 16, 64, 256])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3, help="rounds of each mode's timed generate (medians)")
    parser.add_argument("--scheduling", type=_names(SCHEDULING), default=["async", "sync"])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--peers", action="store_true", help="llama.cpp and HF generate at batch 1, same weights")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the peers' threads")
    parser.add_argument(
        "--stream", action="store_true", help="each request streamed (a delta a step; the client makes its text)"
    )
    return parser.parse_args()


def model_dir(model: Path | None) -> Path:
    if model is not None:
        return model
    from benchmarks.random_model import build_random_model

    return build_random_model("tiny", REPO / "out" / "tiny-model")


# ---------------------------------------------------------------- guidespec


def run_engine(
    model: Path, modes: list[str], scheduling: str, args: argparse.Namespace, prompt_ids: list[list[int]]
) -> list[dict[str, Any]]:
    """One engine for ``modes`` (one speculative setting) and ``scheduling``: every batch timed
    in each mode, then the step trace's span medians for each. ``prompt_ids`` gets the prompts'
    token ids if it has none yet."""
    with tempfile.TemporaryDirectory(prefix="guidespec-overhead-") as tmp:
        trace, profile = Path(tmp) / "trace.json", Path(tmp) / "profile"
        ahead, overlap = SCHEDULING[scheduling]
        env = {"GUIDESPEC_TRACE": str(trace), "GUIDESPEC_ASYNC_SCHEDULING": ahead}
        if overlap:
            env["GUIDESPEC_OVERLAP_STEPS"] = overlap
        if args.device == "cuda":
            profile.mkdir()
            env["GUIDESPEC_TORCH_PROFILER_DIR"] = str(profile)
        rows = []
        with mock.patch.dict(
            os.environ, env
        ):  # the engine's processes read these as they start (the trace path: at close)
            try:
                rows = _measure_engine(model, modes, args, prompt_ids, profile)
            except Exception as exc:
                traceback.print_exc()
                return [
                    {"mode": mode, "scheduling": scheduling, "batch": b, "error": repr(exc)}
                    for mode in modes
                    for b in args.batches
                ]
        events = _read_trace(trace)
    for row in rows:
        row["scheduling"] = scheduling
        row["spans"], row["traced_steps"] = span_medians(events, row.pop("windows"), row["batch"])
    return rows


def _measure_engine(
    model: Path, modes: list[str], args: argparse.Namespace, prompt_ids: list[list[int]], profile: Path
) -> list[dict[str, Any]]:
    llm = LLM(
        str(model),
        max_batch_size=max(args.batches),
        max_model_len=args.max_tokens + 64,
        show_progress=False,
        device=args.device,
        speculative=MODES[modes[0]][1],
    )
    try:
        if not prompt_ids:
            prompt_ids += [llm.encode_prompt(text) for text in PROMPTS]
        rows = []
        for batch in args.batches:
            prompts = [{"prompt_token_ids": prompt_ids[i % len(prompt_ids)]} for i in range(batch)]
            runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
            for _ in range(args.repeat):
                for mode in modes:
                    runs[mode].append(time_batch(llm, prompts, _params(mode, args.max_tokens), args.stream))
            for mode in modes:
                rows.append(_medians(mode, runs[mode]))
                if args.device == "cuda":
                    rows[-1]["gpu"] = profile_batch(llm, prompts, _params(mode, args.max_tokens), profile)
        return rows
    finally:
        llm.close()


def _params(mode: str, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, guided=MODES[mode][0])


def _medians(mode: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A mode's row at one batch: the medians of its rounds, with each round's tok/s (``rounds``)
    and every timed generate's window."""
    row: dict[str, Any] = {
        key: float(np.median([r[key] for r in runs])) for key in ("ms_per_step", "tok_per_s", "wall_s")
    }
    row.update(
        mode=mode,
        batch=runs[0]["batch"],
        tokens=runs[0]["tokens"],
        longest=runs[0]["longest"],
        rounds=[r["tok_per_s"] for r in runs],
        windows=[r["window"] for r in runs],
        cpu={name: float(np.median([r["cpu"][name] for r in runs])) for name in runs[0]["cpu"]},
    )
    return row


def time_batch(llm: LLM, prompts: list[dict[str, Any]], params: SamplingParams, stream: bool = False) -> dict[str, Any]:
    """A warm-up generate, then the timed one; ``window``: its wall-clock span (the trace's clock);
    ``cpu``: each engine process's CPU time (user + system) over it, ms a step. ``stream``: the
    requests streamed, their deltas taken on an event loop as a server's are."""
    generate = _streamed if stream else LLM.generate
    generate(llm, prompts, dataclasses.replace(params, max_tokens=WARMUP_TOKENS))
    cpu_before = cpu_seconds(llm)
    start, clock = time.time(), time.perf_counter()
    outputs = generate(llm, prompts, params)
    wall, end = time.perf_counter() - clock, time.time()
    cpu_after = cpu_seconds(llm)
    longest = max(len(o.token_ids) for o in outputs)
    tokens = sum(len(o.token_ids) for o in outputs)
    return {
        "batch": len(prompts),
        "ms_per_step": 1e3 * wall / longest,
        "tok_per_s": tokens / wall,
        "tokens": tokens,
        "longest": longest,
        "wall_s": wall,
        "window": (start, end),
        "cpu": {name: 1e3 * (cpu_after[name] - cpu_before[name]) / longest for name in cpu_after if name in cpu_before},
    }


def _streamed(llm: LLM, prompts: list[dict[str, Any]], params: SamplingParams) -> list[Any]:
    """``LLM.generate``'s outputs, each request streamed (``LLM.open_stream``)."""

    async def run() -> list[Any]:
        handles = [llm.open_stream(prompt, params) for prompt in prompts]

        async def drain(handle: Any) -> None:
            async for _ in handle.deltas():
                pass

        await asyncio.gather(*(drain(handle) for handle in handles))
        return [handle.output for handle in handles]

    return asyncio.run(run())


def cpu_seconds(llm: LLM) -> dict[str, float]:
    """The CPU time (user + system, all threads) each engine process has used so far, from ``/proc``,
    in clock ticks of 10 ms (the scheduler's ~90 ms over 256 batch-1 steps reads within ~10%, its
    seconds at batch 64 within 1%); empty where there is no ``/proc``. Less noisy than wall time on
    a shared host, and on one whose cores are all busy (2 cores: the scheduler beside rank 0's two
    threads) what a step costs: every process's milliseconds come out of the same two cores. Rank
    0's includes its kernels' helper thread spinning between a step's regions. "client": this
    process (the LLM's receiver thread makes the outputs' text: ``guidespec/output_text.py``)."""
    seconds = {}
    pids = {name: process.pid for name, process in llm._processes.processes.items()}
    for name, pid in {**pids, "client": os.getpid()}.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def span_medians(
    events: list[dict[str, Any]], windows: list[tuple[float, float]], batch: int
) -> tuple[dict[str, float], int]:
    """The median ms of each span over the steps of ``batch`` that began inside one of
    ``windows`` (seconds, time.time()), and how many such steps. Steps overlap under async
    scheduling: a step's spans are those whose ``args.step`` is its number."""
    windows_us = [(start * 1e6, end * 1e6) for start, end in windows]
    durations: dict[str, list[float]] = {}
    steps = 0
    for spans in _spans_by_step(events).values():
        first = next((e for e in spans if e["pid"] == 1 and e["name"] == "schedule + write inputs"), None)
        if first is None or first["args"].get("batch") != batch:
            continue
        if not any(start <= first["ts"] <= end for start, end in windows_us):
            continue
        steps += 1
        for name, ms in _step_durations(spans, first).items():
            durations.setdefault(name, []).append(ms)
    return {name: float(np.median(values)) for name, values in durations.items()}, steps


def _step_durations(spans: list[dict[str, Any]], first: dict[str, Any]) -> dict[str, float]:
    """One step's ms per span (same-named spans summed), and the derived "inputs out" and "tokens back"."""
    out: dict[str, float] = {}
    for e in spans:
        name = f"{PROCESSES[e['pid']]}: {e['name']}"
        out[name] = out.get(name, 0.0) + e["dur"] / 1e3
    worker = [e for e in spans if e["pid"] == 2]
    back = next((e for e in spans if e["pid"] == 1 and e["name"] == "advance grammars"), None)
    if worker:
        out["inputs out"] = (min(e["ts"] for e in worker) - (first["ts"] + first["dur"])) / 1e3
        if back is not None:
            out["tokens back"] = (back["ts"] - max(e["ts"] + e["dur"] for e in worker)) / 1e3
    return out


def _spans_by_step(events: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    steps: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in PROCESSES and "step" in e.get("args", {}):
            steps.setdefault(e["args"]["step"], []).append(e)
    return steps


def _read_trace(path: Path, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The trace's events (the scheduler writes it as it closes: waited for a while)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return list(json.loads(path.read_text())["traceEvents"])
        except (OSError, ValueError):
            time.sleep(0.2)
    print(f"no step trace at {path}: span columns left empty", flush=True)
    return []


# ---------------------------------------------------------------- CUDA: torch's profiler (unverified)


def profile_batch(llm: LLM, prompts: list[dict[str, Any]], params: SamplingParams, folder: Path) -> dict[str, Any]:
    """A ``PROFILE_TOKENS``-token generate under rank 0's profiler (on while ``folder/on`` exists):
    kernel launches and GPU busy share a step. The window's trace is written at the first step
    after ``on`` goes away, so a 1-token generate follows."""
    on, before = folder / "on", set(folder.glob("rank0-*.json"))
    on.touch()
    try:
        llm.generate(prompts, dataclasses.replace(params, max_tokens=PROFILE_TOKENS))
    finally:
        on.unlink()
    llm.generate(prompts[:1], dataclasses.replace(params, max_tokens=1, guided=None))
    written = sorted(set(folder.glob("rank0-*.json")) - before)
    if not written:
        return {"error": "no profiler trace written"}
    try:
        return kernel_figures(json.loads(written[-1].read_text()))
    finally:
        for path in written:
            path.unlink()


def kernel_figures(trace: dict[str, Any]) -> dict[str, Any]:
    """Over the profiled steps after the first (the prompts'): launches, graph launches and GPU
    kernels a step, and the kernels' summed time over the steps' wall span (one stream: no overlap)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in events if STEP_FRAME.search(str(e.get("name", "")))), key=lambda e: e["ts"])[1:]
    if not steps:
        return {"error": "no worker step frames in the profiler trace"}
    lo, hi = steps[0]["ts"], max(e["ts"] + e["dur"] for e in steps)
    inside = [e for e in events if lo <= e["ts"] <= hi]
    calls = [e for e in inside if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    kernels = [e for e in inside if e.get("cat") == "kernel"]
    busy = sum(min(e["ts"] + e["dur"], hi) - e["ts"] for e in kernels)
    return {
        "profiled_steps": len(steps),
        "launches_per_step": sum(bool(LAUNCH_CALL.match(e["name"])) for e in calls) / len(steps),
        "graph_launches_per_step": sum(e["name"].startswith("cudaGraphLaunch") for e in calls) / len(steps),
        "kernels_per_step": len(kernels) / len(steps),
        "gpu_busy": busy / (hi - lo) if hi > lo else None,
    }


# ---------------------------------------------------------------- peers, ratios, goals


def measure_peers(model: Path, args: argparse.Namespace, prompt_ids: list[int]) -> dict[str, Any]:
    """llama.cpp and HF generate at batch 1 on ``model``'s weights (a Hugging Face Llama folder)."""
    from benchmarks.overhead_peers import hf_generate_ms_per_step, llama_cpp_ms_per_step, write_gguf

    config = json.loads((model / "config.json").read_text()) if (model / "config.json").exists() else {}
    if config.get("model_type") != "llama" or not (model / "model.safetensors").exists():
        print(f"--peers: {model} is not a Hugging Face Llama folder with one model.safetensors: skipped")
        return {}
    peers: dict[str, Any] = {}
    try:
        gguf = write_gguf(model, REPO / "out" / f"{model.name}.f32.gguf")
        peers[LLAMA_CPP] = llama_cpp_ms_per_step(gguf, prompt_ids, args.max_tokens, args.threads)
    except Exception as exc:
        traceback.print_exc()
        peers[LLAMA_CPP] = {"error": repr(exc)}
    try:
        peers[HF] = hf_generate_ms_per_step(model, prompt_ids, args.max_tokens, args.threads)
    except Exception as exc:
        traceback.print_exc()
        peers[HF] = {"error": repr(exc)}
    return peers


def measure_model_alone(model: Path, args: argparse.Namespace, prompt_ids: list[list[int]]) -> dict[str, Any]:
    """At each batch, guidespec's forward and greedy picks alone (``model_alone_ms_per_step``), on
    the CPU: each row at the run's middle context (a prompt's mean length and half of
    ``--max-tokens``), the kernels on ``--threads`` threads. Keyed by batch (as text: the JSON's)."""
    from benchmarks.overhead_peers import model_alone_ms_per_step

    if args.device != "cpu":
        return {}
    context = round(float(np.mean([len(p) for p in prompt_ids]))) + args.max_tokens // 2
    try:
        alone = model_alone_ms_per_step(model, args.batches, context, args.threads)
    except Exception as exc:
        traceback.print_exc()
        return {str(batch): {"error": repr(exc)} for batch in args.batches}
    return {str(batch): figures for batch, figures in alone.items()}


def add_unguided_ratios(rows: list[dict[str, Any]]) -> None:
    """Each guided row's tok/s over unguided's at the same batch and scheduling: the median of
    the rounds' ratios where unguided ran in the same engine, round by round; else over its median."""
    unguided = {(r["scheduling"], r["batch"]): r for r in rows if r["mode"] == "unguided" and "error" not in r}
    for row in rows:
        base = unguided.get((row["scheduling"], row["batch"]))
        if row["mode"] == "unguided" or base is None or "error" in row:
            continue
        if MODES[row["mode"]][1] is None and len(row["rounds"]) == len(base["rounds"]):
            ratios = np.array(row["rounds"]) / np.array(base["rounds"])
            row["vs_unguided"] = float(np.median(ratios))
            row["vs_unguided_range"] = [float(ratios.min()), float(ratios.max())]
        else:
            row["vs_unguided"] = row["tok_per_s"] / base["tok_per_s"]


def goals(rows: list[dict[str, Any]], peers: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 48's goals where this run measured them: (label, value, target "<= x" / ">= x" or None)."""
    at = {(r["mode"], r["scheduling"], r["batch"]): r for r in rows if "error" not in r}
    llama = peers.get(LLAMA_CPP, {}).get("ms_per_step")
    out = []
    for mode, scheduling in dict.fromkeys((r["mode"], r["scheduling"]) for r in rows):
        one, wide = at.get((mode, scheduling, 1)), at.get((mode, scheduling, 64))
        if one is not None and llama:
            label = f"{mode}, {scheduling}: batch 1 ms/step ÷ llama.cpp's"
            out.append(_goal(label, one["ms_per_step"] / llama, ("<=", 1.0) if mode == "unguided" else None))
        if one is not None and wide is not None:
            ratio = wide["ms_per_step"] / one["ms_per_step"]
            out.append(_goal(f"{mode}, {scheduling}: batch 64 ÷ batch 1 step time", ratio, ("<=", 3.0)))
        if wide is not None and "vs_unguided" in wide:
            label = f"{mode}, {scheduling}: guided ÷ unguided at batch 64"
            out.append(_goal(label, wide["vs_unguided"], (">=", 0.95), wide.get("vs_unguided_range")))
    return out


def _goal(
    label: str, value: float, target: tuple[str, float] | None, rounds: list[float] | None = None
) -> dict[str, Any]:
    """A goal's row; ``rounds``: the lowest and highest of the rounds' values where the value is
    their median (on a noisy host a goal can be met in one round and not in the next)."""
    met = None if target is None else (value <= target[1] if target[0] == "<=" else value >= target[1])
    goal = {"goal": label, "value": value, "target": None if target is None else f"{target[0]} {target[1]}", "met": met}
    if rounds is not None:
        goal["rounds"] = rounds
    return goal


# ---------------------------------------------------------------- report


def meta(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": machine(),
        "device": args.device,
        "model": str(model) if args.model is not None else "tiny random Llama (2 layers, hidden 64)",
        "max_tokens": args.max_tokens,
        "batches": args.batches,
        "repeat": args.repeat,
        "peer_threads": args.threads,
        "stream": args.stream,
    }


def markdown(report: dict[str, Any]) -> str:
    m, rows = report["meta"], report["rows"]
    spans = list(dict.fromkeys([*SPAN_COLUMNS, *(name for r in rows for name in r.get("spans", {}))]))
    spans = [s for s in spans if any(s in r.get("spans", {}) for r in rows)]
    gpu = any("gpu" in r for r in rows)
    gpu_columns = ["launches/step", "graph launches/step", "kernels/step", "GPU busy"] if gpu else []
    cpus = list(dict.fromkeys(name for r in rows for name in r.get("cpu", {})))
    header = ["mode", "scheduling", "batch", "ms/step", "tok/s", "÷ unguided", "steps"]
    header += [f"CPU ms/step: {name}" for name in cpus] + [*spans, *gpu_columns]
    lines = [
        f"# Host overhead (issue 48): {m['model']}, {m['device']}",
        "",
        f"- {m['date']}, commit {m['commit']}; {m['machine']}",
        f"- greedy, EOS ignored, {m['max_tokens']} tokens a request"
        f"{', streamed (a delta a step)' if m.get('stream') else ''}; ms/step and tok/s: medians of "
        f"{m.get('repeat', 1)} rounds, the modes of an engine in turn in each; spans: median ms over the timed "
        "steps of the batch (steps: how many) in the scheduler's step trace",
        "",
        "| " + " | ".join(header) + " |",
        "|---|---|" + "---:|" * (len(header) - 2),
    ]
    lines += [_table_row(r, cpus, spans, gpu) for r in rows]
    if report["peers"]:
        lines += ["", f"Peers, batch 1, {m['peer_threads']} threads:", ""]
        lines += ["| system | ms/step | tok/s |", "|---|---:|---:|"]
        for name, p in report["peers"].items():
            lines.append(f"| {name} | {fmt(p.get('ms_per_step'), '.3f')} | {fmt(p.get('tok_per_s'))} |")
    if report.get("model_alone"):
        lines += _model_alone_lines(report["model_alone"], rows, m["peer_threads"])
    if report["goals"]:
        lines += ["", "| goal | measured | the rounds' range | target | met |", "|---|---:|---:|---:|---|"]
        for g in report["goals"]:
            met = "–" if g["met"] is None else ("yes" if g["met"] else "no")
            spread = f"{g['rounds'][0]:.2f}-{g['rounds'][1]:.2f}" if g.get("rounds") else "–"
            lines.append(f"| {g['goal']} | {fmt(g['value'], '.2f')} | {spread} | {g['target'] or 'reported'} | {met} |")
    return "\n".join(lines) + "\n"


def _model_alone_lines(alone: dict[str, Any], rows: list[dict[str, Any]], threads: int) -> list[str]:
    """The model alone at each batch beside the engine's unguided step (async): the runtime's
    share of a step is what the step costs beyond its model."""
    engine = {
        str(r["batch"]): r["ms_per_step"]
        for r in rows
        if r["mode"] == "unguided" and r["scheduling"] == "async" and "error" not in r
    }
    first = next(iter(alone.values()))
    lines = [
        "",
        f"The model alone (forward + greedy picks in one process, {threads} threads, "
        f"{first.get('context', '?')} positions a row):",
        "",
        "| batch | model alone ms/step | unguided, async ms/step | the runtime's share of a step |",
        "|---:|---:|---:|---:|",
    ]
    for batch, a in alone.items():
        ms, step = a.get("ms_per_step"), engine.get(batch)
        share = None if ms is None or step is None else 100 * (1 - ms / step)
        lines.append(f"| {batch} | {fmt(ms, '.3f')} | {fmt(step, '.3f')} | {fmt(share, '.0f', '%')} |")
    return lines


def _table_row(r: dict[str, Any], cpus: list[str], spans: list[str], gpu: bool) -> str:
    cells = [r["mode"], r["scheduling"], str(r["batch"])]
    if "error" in r:
        return "| " + " | ".join(cells) + f" | error: {r['error']} |"
    cells += [fmt(r["ms_per_step"], ".3f"), fmt(r["tok_per_s"]), fmt(r.get("vs_unguided"), ".2f")]
    cells += [str(r["traced_steps"])] + [fmt(r.get("cpu", {}).get(name), ".2f") for name in cpus]
    cells += [fmt(r["spans"].get(s), ".3f") for s in spans]
    if gpu:
        g = r.get("gpu", {})
        busy = g.get("gpu_busy")
        cells += [fmt(g.get(k)) for k in ("launches_per_step", "graph_launches_per_step", "kernels_per_step")]
        cells.append(fmt(None if busy is None else 100 * busy, ".0f", "%") if "error" not in g else g["error"])
    return "| " + " | ".join(cells) + " |"


def write_results(report: dict[str, Any], text: str, device: str) -> None:
    folder = REPO / "benchmarks" / "results"
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"overhead-{device}-{datetime.date.today().isoformat()}-{report['meta']['commit'].split()[0]}"
    (folder / f"{stem}.json").write_text(json.dumps(report, indent=2))
    (folder / f"{stem}.md").write_text(text)
    print(f"written: {folder / stem}.{{md,json}}")


# ---------------------------------------------------------------- helpers


def _integers(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(known: dict[str, Any]) -> Any:
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown: {', '.join(unknown)} (one of {', '.join(known)})")
        return names

    return parse


if __name__ == "__main__":
    main()
