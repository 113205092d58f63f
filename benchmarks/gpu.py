"""The GPU benchmark (issue 22, item 7): decode speed, guidance, speculation, CUDA graphs, bitmasks.

    python -m benchmarks.gpu --device cuda --preset smollm2-135m --batch-sizes 1 16 64 --max-tokens 128 --output out/gpu
    python -m benchmarks.gpu --device cpu --quick --output /tmp/gpu-smoke   # smoke: batch 1, 2; 16 tokens; 4 layers

Without ``--model``, a Llama folder with random weights is built for ``--preset`` (SmolLM2-135M's
or SmolLM2-1.7B's config, ``benchmarks/random_model.py``) and cached in ``--work-dir``, so a bare
machine with torch and transformers needs no model files. For each batch size B, B distinct chat
prompts asking for JSON under one of three small embedded schemas (or ``--workload`` cases) are
generated greedily through the Python API, each figure after a warm-up run of the same requests
(graphs are captured the first time a step's shape is met: the warm-up captures what the timed
runs replay, as a long-running server has):

- decode tok/s: unguided, EOS ignored, exactly ``--max-tokens`` each: output tokens over the wall
  time of one ``generate`` call of the B prompts (prefill included);
- guided ÷ unguided: each prompt under its schema, against an unguided run held to exactly the
  lengths the guided run produced (same tokens computed, differing only by the guidance);
- guided + speculative ÷ guided: the same guided requests on an engine with ``speculative="ngram"``;
- graphs ÷ eager: decode tok/s of the default engine over one with ``enforce_eager=True``;
- EAGLE graphs (issue 23): an EAGLE-3 head (``--eagle-head``, else random weights of the model's
  shape) drafting ``--draft-len`` tokens a step (fixed length), guided and unguided, in the
  variants of ``--eagle-variants``: "fused" (the default engine: each greedy step, verify, masks,
  acceptance and draft steps, one captured graph whose grammar waits are host nodes,
  ``worker/drafting/step_graph.py``), "draft-graph" (only the draft steps as a graph,
  ``GUIDESPEC_FUSED_STEPS=0``), "steps" (everything one by one, ``--no-graph-grammar``),
  "fused-unmasked" (drafts no grammar masks, ``constrain_drafts=False``: no round trip to the scheduler
  while drafting), "fused-first-mask" (only draft step 0 masked, ``draft_mask_steps=1``: one round
  trip), "fused-sampled" and "steps-sampled" (temperature 1, unseeded: fused steps verify them by
  rejection sampling on the device), and a draft model (the target's first 2 layers, sharing its
  cache) "draft-model-fused" and "draft-model-steps", at batch 1 and 16: time per engine step, the grammar's share of a
  step (guided over unguided step time, minus 1), of wall time (unguided runs to the guided
  outputs' lengths, so both produce the same tokens) and of a decode step (p50 from each engine's
  step trace, ``--trace-dir``, with the guided steps' parts); a random head's drafts are nearly all
  rejected, so its accepted tokens per step say nothing (a trained head and ``--model`` do);
- bitmask: p50 time per step to copy R = B x (1 + draft length) bitmask rows host-to-device from a
  page-locked arena (``DeviceMasks.upload``), to apply them to fp32 logits [R, vocab] already on the
  device, and both (``DeviceMasks.apply``), for the default vocabulary and a 128k one; on the CPU,
  the apply alone (nothing is copied there).

Prefix caching is off, so every run computes its prefill. Random weights leave the figures that
depend only on shapes valid (decode speed, graphs ÷ eager, guided ÷ unguided, bitmask times); the
drafts' acceptance, and with it guided + speculative ÷ guided, needs real weights (``--model``).
Writes gpu.json and gpu.md (markdown tables with the device, date and commit) into ``--output``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import commit, fmt, machine  # noqa: E402
from benchmarks.random_model import PRESETS, build_random_model, default_folder  # noqa: E402

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "person",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "email": {"type": "string"},
                "languages": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["name", "age", "email", "languages"],
        },
    ),
    (
        "order",
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "integer"},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "quantity": {"type": "integer"},
                            "price": {"type": "number"},
                        },
                        "required": ["sku", "quantity", "price"],
                    },
                },
                "paid": {"type": "boolean"},
            },
            "required": ["order_id", "items", "paid"],
        },
    ),
    (
        "event",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "city": {"type": "string"},
                "status": {"enum": ["planned", "confirmed", "cancelled"]},
                "attendees": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}, "role": {"type": "string"}},
                        "required": ["name", "role"],
                    },
                },
            },
            "required": ["title", "city", "status", "attendees"],
        },
    ),
]
SUBJECTS = [
    "a software engineer in Lisbon",
    "a bakery order for a wedding",
    "a jazz concert in Osaka",
    "a retired teacher who learned Python",
    "three books bought online",
    "a team offsite in Oslo",
]


# ---------------------------------------------------------------- workload


def embedded_cases() -> list[dict[str, Any]]:
    return [{"id": f"embedded-{name}", "schema": schema} for name, schema in SCHEMAS]


def workload_cases(path: Path, prefix: str) -> list[dict[str, Any]]:
    cases = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    cases = [c for c in cases if c["id"].startswith(prefix) and "schema" in c and "messages" in c]
    if not cases:
        raise SystemExit(f"{path} has no cases with id prefix {prefix!r}")
    return cases


def requests(cases: list[dict[str, Any]], n: int) -> list[tuple[Any, Any]]:
    """``n`` (chat prompt, schema) pairs: the cases in turn; embedded ones made distinct per index."""
    out = []
    for i in range(n):
        case = cases[i % len(cases)]
        if "messages" in case:
            out.append((case["messages"], case["schema"]))
            continue
        text = (
            f"Request {i}: describe {SUBJECTS[i % len(SUBJECTS)]} as one JSON object matching this schema:\n"
            f"{json.dumps(case['schema'])}"
        )
        out.append(([{"role": "user", "content": text}], case["schema"]))
    return out


# ---------------------------------------------------------------- engines


@dataclass
class Setup:
    model_dir: Path
    device: str
    dtype: str
    max_batch_size: int
    max_model_len: int | None
    max_num_batched_tokens: int | None
    grammar_backend: str
    gpu_memory_utilization: float | None
    draft_len: int
    repeats: int
    jump_forward: bool
    accepted: set[str] = field(default_factory=set)  # LLM's keyword arguments
    not_passed: list[str] = field(default_factory=list)  # flags this LLM does not take

    def kwargs(self, enforce_eager: bool | None = None, speculative: bool = False) -> dict[str, Any]:
        kw: dict[str, Any] = dict(
            model=str(self.model_dir),
            dtype=self.dtype,
            max_batch_size=self.max_batch_size,
            show_progress=False,
            grammar_backend=self.grammar_backend,
            enable_prefix_caching=False,
            jump_forward=self.jump_forward,
        )
        if self.max_model_len is not None:
            kw["max_model_len"] = self.max_model_len
        if self.max_num_batched_tokens is not None:
            kw["max_num_batched_tokens"] = self.max_num_batched_tokens
        if speculative:
            kw["speculative"] = {"method": "ngram", "max_draft_len": self.draft_len}
        if "device" in self.accepted:
            kw["device"] = self.device
        elif self.device != "cpu":
            raise SystemExit(f"this guidespec's LLM takes no device= argument: it cannot run on {self.device}")
        else:
            self._note("device")
        if enforce_eager is not None:
            if "enforce_eager" in self.accepted:
                kw["enforce_eager"] = enforce_eager
            else:
                self._note("enforce_eager")
        if self.gpu_memory_utilization is not None and self.device != "cpu":
            if "gpu_memory_utilization" not in self.accepted:
                raise SystemExit("this guidespec's LLM takes no gpu_memory_utilization= argument")
            kw["gpu_memory_utilization"] = self.gpu_memory_utilization
        return kw

    def _note(self, flag: str) -> None:
        if flag not in self.not_passed:
            self.not_passed.append(flag)


def start_engine(setup: Setup, label: str, **options: Any) -> tuple[Any, float]:
    from guidespec import LLM

    start = time.perf_counter()
    llm = LLM(**setup.kwargs(**options))
    took = time.perf_counter() - start
    blocks = getattr(llm, "num_kv_blocks", None)  # the paged KV pool (issue 47), sized from free memory
    print(f"[{label}] engine started in {took:.1f} s; KV pool: {blocks} blocks", flush=True)
    return llm, took


def run_generate(llm: Any, prompts: list[Any], params: Any) -> tuple[list[Any], float]:
    """One ``generate`` call of every prompt: outputs and wall seconds."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return outs, time.perf_counter() - start


def run_each(llm: Any, prompts: list[Any], params: list[Any]) -> tuple[list[Any], float]:
    """Every prompt with its own parameters, all submitted at once; a refused request gives None."""
    from guidespec import RequestError

    async def one(prompt: Any, p: Any) -> Any:
        try:
            return await llm.agenerate(prompt, p)
        except RequestError as exc:
            print(f"  request failed: {exc}", flush=True)
            return None

    async def every() -> list[Any]:
        return list(await asyncio.gather(*(one(prompt, p) for prompt, p in zip(prompts, params))))

    start = time.perf_counter()
    outs = asyncio.run(every())
    return outs, time.perf_counter() - start


def summary(outs: list[Any], wall: float) -> dict[str, Any]:
    done = [o for o in outs if o is not None]
    tokens = sum(len(o.token_ids) for o in done)
    per_request = [o.decode_tokens_per_s for o in done if o.decode_tokens_per_s > 0]
    drafts = sum(o.stats.num_draft_tokens for o in done)
    accepted = sum(o.stats.num_accepted_tokens for o in done)
    spec_steps = sum(o.stats.num_spec_steps for o in done)
    chars = sum(len(o.text) for o in done)
    return {
        "tokens": tokens,
        "steps": sum(o.stats.num_steps for o in done),
        "wall_s": wall,
        "tok_s": tokens / wall if wall > 0 else 0.0,
        "chars": chars,
        "chars_s": chars / wall if wall > 0 else 0.0,
        "median_request_decode_tok_s": statistics.median(per_request) if per_request else 0.0,
        "failed": len(outs) - len(done),
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance": accepted / drafts if drafts else None,
        "tokens_per_spec_step": 1 + accepted / spec_steps if spec_steps else None,
        "sample": done[0].text[:200] if done else None,
    }


def measure(run: Callable[[], tuple[list[Any], float]], repeats: int) -> tuple[dict[str, Any], list[Any]]:
    """``run`` ``repeats`` times: the summary and outputs of the run with the median tok/s (with
    every run's tok/s)."""
    results = [run() for _ in range(repeats)]
    summaries = [summary(outs, wall) for outs, wall in results]
    middle = sorted(range(repeats), key=lambda i: summaries[i]["tok_s"])[repeats // 2]
    return dict(summaries[middle], runs_tok_s=[s["tok_s"] for s in summaries]), results[middle][0]


def same_text(a: Any, b: Any) -> bool:
    """One output's text starts the other's (both cut at max_tokens, maybe after different tokens)."""
    return a is not None and b is not None and (a.text.startswith(b.text) or b.text.startswith(a.text))


def valid_json(text: str, schema: Any) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:
        return True  # parsed JSON; the schema is not checked where jsonschema is missing
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def guided_params(schemas: list[Any], max_tokens: int, temperature: float = 0.0) -> list[Any]:
    from guidespec import SamplingParams
    from guidespec.protocol import GuidedDecoding

    return [
        SamplingParams(max_tokens=max_tokens, temperature=temperature, guided=GuidedDecoding(json_schema=s))
        for s in schemas
    ]


def bench_default(
    setup: Setup,
    cases: list[dict[str, Any]],
    batch_sizes: list[int],
    max_tokens: int,
    rows: dict[int, dict[str, Any]],
    skip: set[str],
    engines: dict[str, float],
) -> None:
    """Decode (unguided, fixed length), guided, and unguided held to the guided lengths."""
    from guidespec import SamplingParams

    fixed = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm, engines["default"] = start_engine(setup, "default", enforce_eager=False)
    with llm:
        for b in batch_sizes:
            pairs = requests(cases, b)
            prompts, schemas = [p for p, _ in pairs], [s for _, s in pairs]
            row = rows[b]
            llm.generate(prompts, fixed)  # warm-up
            row["decode"], outs = measure(lambda: run_generate(llm, prompts, fixed), setup.repeats)
            row["_decode_ids"] = [list(o.token_ids) for o in outs]
            print(f"[default] batch {b}: decode {row['decode']['tok_s']:.1f} tok/s", flush=True)
            if "guided" in skip:
                continue
            run_each(llm, prompts, guided_params(schemas, max_tokens))  # compiles the grammars, warms up
            row["guided"], outs = measure(
                lambda: run_each(llm, prompts, guided_params(schemas, max_tokens)), setup.repeats
            )
            row["guided"]["valid_json"] = sum(o is not None and valid_json(o.text, s) for o, s in zip(outs, schemas))
            row["_guided_outs"] = outs
            lengths = [len(o.token_ids) if o is not None else 0 for o in outs]
            kept = [i for i, n in enumerate(lengths) if n > 0]
            twins = [SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True) for i in kept]
            row["unguided_same_lengths"], _ = measure(
                lambda: run_each(llm, [prompts[i] for i in kept], twins), setup.repeats
            )
            print(
                f"[default] batch {b}: guided {row['guided']['tok_s']:.1f} tok/s, unguided at the same lengths "
                f"{row['unguided_same_lengths']['tok_s']:.1f} tok/s ({row['guided']['tokens']} tokens, "
                f"{row['guided']['valid_json']}/{b} valid)",
                flush=True,
            )


def bench_eager(
    setup: Setup,
    cases: list[dict[str, Any]],
    batch_sizes: list[int],
    max_tokens: int,
    rows: dict[int, dict[str, Any]],
    engines: dict[str, float],
) -> bool:
    """Decode with ``enforce_eager=True``; False where this LLM has no such flag."""
    from guidespec import SamplingParams

    if "enforce_eager" not in setup.accepted:
        setup._note("enforce_eager")
        print("[eager] skipped: this LLM takes no enforce_eager= argument", flush=True)
        return False
    fixed = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm, engines["eager"] = start_engine(setup, "eager", enforce_eager=True)
    with llm:
        for b in batch_sizes:
            prompts = [p for p, _ in requests(cases, b)]
            llm.generate(prompts, fixed)  # warm-up: captures the graphs the run meets
            rows[b]["decode_eager"], outs = measure(lambda: run_generate(llm, prompts, fixed), setup.repeats)
            reference = rows[b].get("_decode_ids")
            if reference is not None:
                rows[b]["decode_eager"]["same_tokens_as_graphs"] = sum(
                    list(o.token_ids) == ids for o, ids in zip(outs, reference)
                )
            print(f"[eager] batch {b}: decode {rows[b]['decode_eager']['tok_s']:.1f} tok/s", flush=True)
    return True


def bench_speculative(
    setup: Setup,
    cases: list[dict[str, Any]],
    batch_sizes: list[int],
    max_tokens: int,
    rows: dict[int, dict[str, Any]],
    engines: dict[str, float],
) -> None:
    """The guided requests again, on an engine with n-gram speculation."""
    llm, engines["ngram"] = start_engine(setup, "guided+ngram", enforce_eager=False, speculative=True)
    with llm:
        for b in batch_sizes:
            pairs = requests(cases, b)
            prompts, schemas = [p for p, _ in pairs], [s for _, s in pairs]
            run_each(llm, prompts, guided_params(schemas, max_tokens))  # compiles, captures, warms up
            row = rows[b]
            row["guided_spec"], outs = measure(
                lambda: run_each(llm, prompts, guided_params(schemas, max_tokens)), setup.repeats
            )
            row["guided_spec"]["valid_json"] = sum(
                o is not None and valid_json(o.text, s) for o, s in zip(outs, schemas)
            )
            reference = row.get("_guided_outs")
            if reference is not None:  # by text: forced-token drafts may split the same text into other tokens
                row["guided_spec"]["same_text_as_guided"] = sum(same_text(o, r) for o, r in zip(outs, reference))
            acc = row["guided_spec"]["acceptance"]
            print(
                f"[guided+ngram] batch {b}: {row['guided_spec']['tok_s']:.1f} tok/s, acceptance "
                f"{'-' if acc is None else f'{acc:.0%}'}",
                flush=True,
            )


# variant -> (graph_grammar, masked draft steps (None: all, 0: drafts unchecked), fused steps,
# drafter: the EAGLE head, or a draft model spec; temperature, unseeded)
EAGLE_VARIANTS: dict[str, tuple[bool, int | None, bool, str, float]] = {
    "fused": (True, None, True, "eagle", 0.0),
    "draft-graph": (True, None, False, "eagle", 0.0),
    "steps": (False, None, False, "eagle", 0.0),
    "fused-unmasked": (True, 0, True, "eagle", 0.0),
    "fused-first-mask": (True, 1, True, "eagle", 0.0),
    "fused-sampled": (True, None, True, "eagle", 1.0),
    "steps-sampled": (False, None, False, "eagle", 1.0),
    "draft-model-fused": (True, None, True, "layers:2", 0.0),
    "draft-model-steps": (False, None, False, "layers:2", 0.0),
}


def bench_eagle_graphs(
    setup: Setup,
    cases: list[dict[str, Any]],
    batch_sizes: list[int],
    max_tokens: int,
    head: Path | None,
    trace_dir: Path | None = None,
    variants: list[str] | None = None,
) -> list[dict[str, Any]]:
    """EAGLE draft steps as a graph against step by step, guided and unguided, per batch size;
    with ``trace_dir``, each engine's step trace (``GUIDESPEC_TRACE``) is written there."""
    from guidespec import LLM, SamplingParams

    from benchmarks.random_model import build_random_eagle_head

    if "graph_grammar" not in setup.accepted:
        setup._note("graph_grammar")
        print("[eagle] skipped: this LLM takes no graph_grammar= argument", flush=True)
        return []
    head = head or build_random_eagle_head(setup.model_dir, setup.model_dir.parent / f"{setup.model_dir.name}-eagle")
    eagle = {"method": "eagle", "draft_model": str(head), "adaptive": False, "max_draft_len": setup.draft_len}
    out: list[dict[str, Any]] = []
    trace_dir = trace_dir or Path(tempfile.mkdtemp(prefix="guidespec-eagle-trace-"))
    trace_dir.mkdir(parents=True, exist_ok=True)
    # (verification refuses what the grammar does in every variant, masked drafts or not)
    for variant in variants or list(EAGLE_VARIANTS):
        graph, masked, fused, drafter, temperature = EAGLE_VARIANTS[variant]
        os.environ["GUIDESPEC_FUSED_STEPS"] = "1" if fused else "0"
        label = f"eagle {variant}"
        model_drafter = eagle if drafter == "eagle" else dict(eagle, method="draft_model", draft_model=drafter)
        kw = dict(
            setup.kwargs(enforce_eager=False),
            speculative=dict(model_drafter, constrain_drafts=masked != 0, draft_mask_steps=masked or None),
            graph_grammar=graph,
        )
        trace = trace_dir / f"{label.replace(',', '').replace(' ', '-')}.json"
        os.environ["GUIDESPEC_TRACE"] = str(trace)  # the engine's step trace, written at its shutdown
        start = time.perf_counter()
        rows: list[dict[str, Any]] = []
        try:  # a variant that fails is reported, and the next one still runs
            with LLM(**kw) as llm:
                print(f"[{label}] engine started in {time.perf_counter() - start:.1f} s", flush=True)
                for b in batch_sizes:
                    pairs = requests(cases, b)
                    prompts, schemas = [p for p, _ in pairs], [s for _, s in pairs]
                    run_each(llm, prompts, guided_params(schemas, max_tokens, temperature))  # warm-up, captures
                    guided, outs = measure(
                        lambda: run_each(llm, prompts, guided_params(schemas, max_tokens, temperature)), setup.repeats
                    )
                    lengths = [len(o.token_ids) if o is not None else max_tokens for o in outs]
                    plain = [SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True) for n in lengths]
                    run_each(llm, prompts, plain)
                    unguided, _ = measure(lambda: run_each(llm, prompts, plain), setup.repeats)
                    row = {"graph": graph, "variant": variant, "batch": b, "guided": guided, "unguided": unguided}
                    for key in ("guided", "unguided"):  # every request runs in every step: steps = request steps / B
                        s = row[key]
                        s["step_ms"] = 1e3 * s["wall_s"] * b / s["steps"] if s["steps"] else None
                    row["valid_json"] = sum(o is not None and valid_json(o.text, s) for o, s in zip(outs, schemas))
                    rows.append(row)
                    print(
                        f"[{label}] batch {b}: guided step {fmt(guided['step_ms'], '.2f')} ms, unguided step "
                        f"{fmt(unguided['step_ms'], '.2f')} ms, "
                        f"tokens/step {fmt(guided['tokens_per_spec_step'], '.2f')}, "
                        f"wall guided {guided['wall_s']:.3f} s, unguided {unguided['wall_s']:.3f} s",
                        flush=True,
                    )
        except Exception:
            print(f"[{label}] FAILED:\n{traceback.format_exc()}", flush=True)
        os.environ.pop("GUIDESPEC_TRACE", None)
        os.environ.pop("GUIDESPEC_FUSED_STEPS", None)
        summary = json.loads(trace.read_text())["summary"] if trace.exists() else {}
        for row in rows:  # the trace is complete once the engine has shut down
            row["decode"] = decode_steps(trace, row["batch"], setup.draft_len)
            d = row["decode"]
            print(
                f"[{label}] batch {row['batch']}: decode steps p50 guided {fmt(d['guided_ms'], '.2f')} ms "
                f"({d['guided_steps']}), unguided {fmt(d['unguided_ms'], '.2f')} ms ({d['unguided_steps']})",
                flush=True,
            )
        if summary:  # the engine's whole run, warm-ups included: how many steps ran as one graph
            for row in rows:
                row["engine_steps"], row["fused_steps"] = summary.get("steps"), summary.get("fused_steps")
            print(f"[{label}] fused steps: {summary.get('fused_steps')} of {summary.get('steps')}", flush=True)
        out.extend(rows)
    return out


def decode_steps(trace: Path, batch: int, draft_len: int) -> dict[str, Any]:
    """p50 wall ms of the engine's steps of ``batch`` rows and at most ``batch * (1 + draft_len)``
    tokens (decode and verify steps, no prefill chunk), guided and unguided, from its step trace;
    and the guided steps' parts (p50 ms of each span: the scheduler's fills, rank 0's forward,
    mask + sample, drafting, its waits for masks), and the p50 share of a guided step rank 0
    spent waiting for masks (inside a fused step's graph, timed by the trampolines while the
    device stood still; an unfused step's bitmask wait is the host's, which on a GPU may overlap
    the forward still running)."""
    if not trace.exists():
        return {
            "guided_ms": None,
            "unguided_ms": None,
            "guided_steps": 0,
            "unguided_steps": 0,
            "parts": {},
            "mask_wait_share": None,
            "full_guided_ms": None,
            "full_unguided_ms": None,
            "full_steps": (0, 0),
        }
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        steps.setdefault(int(e["args"]["step"]), []).append(e)
    times: dict[bool, list[float]] = {True: [], False: []}
    full: dict[bool, list[float]] = {True: [], False: []}  # steps of every row's whole shape: alike in work
    parts: dict[str, list[float]] = {}
    wait_shares: list[float] = []
    for spans in steps.values():
        args = spans[0]["args"]
        if args["batch"] != batch or args["tokens"] > batch * (1 + draft_len):
            continue
        mine = [e for e in spans if e["pid"] == 1]  # the scheduler's spans: the step from start to end
        begin, end = min(e["ts"] for e in mine), max(e["ts"] + e["dur"] for e in mine)
        guided = bool(args["guided_rows"])
        times[guided].append((end - begin) / 1e3)
        if args["tokens"] == batch * (1 + draft_len):
            full[guided].append((end - begin) / 1e3)
        if guided:
            for e in spans:
                parts.setdefault(e["name"], []).append(e["dur"] / 1e3)
            waited = sum(e["dur"] for e in spans if e["pid"] == 2 and str(e["name"]).startswith("wait for "))
            wait_shares.append(waited / max(end - begin, 1e-9))
    p50 = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {
        "guided_ms": p50(times[True]),
        "unguided_ms": p50(times[False]),
        "guided_steps": len(times[True]),
        "unguided_steps": len(times[False]),
        "parts": {name: p50(xs) for name, xs in sorted(parts.items())},
        "mask_wait_share": p50(wait_shares),
        "full_guided_ms": p50(full[True]),
        "full_unguided_ms": p50(full[False]),
        "full_steps": (len(full[True]), len(full[False])),
    }


# ---------------------------------------------------------------- bitmask


def bench_bitmask(
    device: str, batch_sizes: list[int], draft_len: int, vocabs: list[int], iters: int
) -> list[dict[str, Any]]:
    """p50 µs per step: copy R rows host-to-device, apply them on the device, and both."""
    from guidespec.worker.mask import DeviceMasks, apply_on_device

    cuda = device.startswith("cuda")
    kernel = "torch"
    if cuda:
        try:
            from xgrammar import apply_token_bitmask_inplace  # noqa: F401

            kernel = "xgrammar"
        except ImportError:
            pass

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def p50_us(fn: Any) -> float:
        times = []
        for i in range(iters + max(3, iters // 10)):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if i >= max(3, iters // 10):
                times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6

    rng = np.random.default_rng(0)
    results = []
    for vocab in vocabs:
        words = (vocab + 31) // 32
        max_rows = max(batch_sizes) * (1 + draft_len)
        arena = rng.integers(0, 2**32, size=(max_rows, words), dtype=np.uint32).view(np.int32)
        masks = DeviceMasks(device, max_rows, words, arena_buffers=[arena])
        try:
            for b in batch_sizes:
                r = b * (1 + draft_len)
                rows = np.arange(r, dtype=np.int64)
                bitmask = arena[:r]
                logits = torch.randn(r, vocab, dtype=torch.float32, device=device)
                entry: dict[str, Any] = {
                    "vocab": vocab,
                    "batch": b,
                    "rows": r,
                    "bytes": int(bitmask.nbytes),
                    "pinned": masks.is_pinned(bitmask) if cuda else None,
                    "kernel": kernel,
                }
                if cuda:

                    def copy() -> None:
                        masks.upload(bitmask)
                        masks.wait()

                    entry["copy_us"] = p50_us(copy)
                    on_device = masks.upload(bitmask)
                    masks.wait()
                    entry["apply_us"] = p50_us(lambda: apply_on_device(logits, rows, on_device))
                    entry["copy_apply_us"] = p50_us(lambda: masks.apply(logits, rows, bitmask))
                else:  # nothing is copied: the apply reads the arena's rows in place
                    entry["copy_us"] = None
                    entry["apply_us"] = entry["copy_apply_us"] = p50_us(lambda: masks.apply(logits, rows, bitmask))
                results.append(entry)
                copy_us = "-" if entry["copy_us"] is None else f"{entry['copy_us']:.1f}"
                print(
                    f"[bitmask] vocab {vocab} batch {b} ({r} rows): copy {copy_us} µs, apply "
                    f"{entry['apply_us']:.1f} µs, both {entry['copy_apply_us']:.1f} µs",
                    flush=True,
                )
        finally:
            masks.close()
    return results


# ---------------------------------------------------------------- report


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return (
            f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}, CUDA {torch.version.cuda}"
        )
    return machine()


def ratio(row: dict[str, Any], top: str, bottom: str, key: str = "tok_s") -> float | None:
    if top in row and bottom in row and row[bottom][key] > 0:
        return float(row[top][key] / row[bottom][key])
    return None


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        "# guidespec GPU benchmark",
        "",
        f"- device: {meta['device_name']} (`--device {meta['device']}`)",
        f"- date: {meta['date']}; commit {meta['commit']}",
        f"- model: {meta['model']}; {meta['dtype']}",
        f"- greedy, max_tokens {meta['max_tokens']}, grammar backend {meta['grammar_backend']}, "
        f"n-gram draft length {meta['draft_len']}, jump-forward {'on' if meta['jump_forward'] else 'off'}, "
        f"prefix caching off, median of {meta['repeats']} timed run(s) "
        f"per figure; prompts: {meta['prompts']}",
        "- engine start (s): " + ", ".join(f"{k} {v:.1f}" for k, v in meta["engine_start_s"].items()),
    ]
    if meta["not_passed"]:
        lines.append(f"- not passed (this LLM does not take them): {', '.join(meta['not_passed'])}")
    lines += [
        "",
        "| batch | decode tok/s | eager tok/s | graphs ÷ eager | guided tok/s | unguided, same lengths, "
        "tok/s | guided ÷ unguided | guided + ngram tok/s | guided+spec ÷ guided (chars/s) | drafts accepted | "
        "valid JSON (guided / +spec) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in report["rows"]:

        def tok_s(key: str) -> str:
            return fmt(row[key]["tok_s"]) if key in row else "–"

        spec = row.get("guided_spec", {})
        valid = (
            (f"{row['guided']['valid_json']}/{row['batch']}" if "guided" in row else "–")
            + " / "
            + (f"{spec['valid_json']}/{row['batch']}" if spec else "–")
        )
        lines.append(
            f"| {row['batch']} | {tok_s('decode')} | {tok_s('decode_eager')} | "
            f"{fmt(row['ratios']['graphs_over_eager'], '.2f', 'x')} | {tok_s('guided')} | "
            f"{tok_s('unguided_same_lengths')} | {fmt(row['ratios']['guided_over_unguided'], '.3f')} | "
            f"{tok_s('guided_spec')} | {fmt(row['ratios']['guided_spec_over_guided'], '.2f', 'x')} | "
            f"{fmt(spec.get('acceptance'), '.0%')} | {valid} |"
        )
    if report.get("eagle"):
        lines += [
            "",
            "EAGLE steps (draft length fixed): each greedy step (verify, masks, acceptance, draft steps) one "
            "captured graph, grammar waits as host nodes (fused); only the draft steps as a graph (draft-graph); "
            "everything one by one (steps); fused with drafts no grammar masks (fused-unmasked: no round trip "
            "while drafting) or only the first draft step masked (fused-first-mask: one); *-sampled: temperature 1, "
            "unseeded; draft-model-*: "
            "the target's first 2 layers drafting instead of the head; "
            "step = wall × batch ÷ request steps. "
            "Unguided runs to the guided outputs' lengths, so the wall-time share compares the same tokens; "
            "guided steps carry grammar-forced drafts, so they are fewer and longer.",
            "",
            "| batch | draft steps | guided step ms | unguided step ms | grammar's share of a step | "
            "grammar's share of wall time | decode step p50 ms, guided / unguided | grammar's share of a decode step | "
            "rank 0 waiting for masks, p50 share of a guided decode step | decode steps of B × (1 + k) tokens, "
            "p50 ms, guided / unguided (steps) | grammar's share there | tokens / step | valid JSON |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for e in report["eagle"]:
            g, u = e["guided"]["step_ms"], e["unguided"]["step_ms"]
            share = g / u - 1 if g and u else None
            gw, uw = e["guided"]["wall_s"], e["unguided"]["wall_s"]
            wall_share = gw / uw - 1 if gw and uw else None
            d = e.get("decode") or {}
            dg, du = d.get("guided_ms"), d.get("unguided_ms")
            decode_share = dg / du - 1 if dg and du else None
            waiting = d.get("mask_wait_share")
            fg, fu = d.get("full_guided_ms"), d.get("full_unguided_ms")
            full_share = fg / fu - 1 if fg and fu else None
            fn = d.get("full_steps", (0, 0))
            lines.append(
                f"| {e['batch']} | {e['variant']} | {fmt(g, '.2f')} | {fmt(u, '.2f')} | "
                f"{fmt(None if share is None else 100 * share, '.1f', '%')} | "
                f"{fmt(None if wall_share is None else 100 * wall_share, '.1f', '%')} | "
                f"{fmt(dg, '.2f')} / {fmt(du, '.2f')} | "
                f"{fmt(None if decode_share is None else 100 * decode_share, '.1f', '%')} | "
                f"{fmt(None if waiting is None else 100 * waiting, '.1f', '%')} | "
                f"{fmt(fg, '.2f')} / {fmt(fu, '.2f')} ({fn[0]} / {fn[1]}) | "
                f"{fmt(None if full_share is None else 100 * full_share, '.1f', '%')} | "
                f"{fmt(e['guided']['tokens_per_spec_step'], '.2f')} | {e['valid_json']}/{e['batch']} |"
            )
        parts = [(e, (e.get("decode") or {}).get("parts") or {}) for e in report["eagle"]]
        names = sorted({name for _, p in parts for name in p})
        if names:
            lines += [
                "",
                "Guided decode steps, p50 ms of each span of the step trace (scheduler: fills, emit; rank 0: "
                "forward with the head's follow run, mask + sample, propose drafts, waits for masks):",
                "",
                "| batch | draft steps | " + " | ".join(names) + " |",
                "|---:|---|" + "---:|" * len(names),
            ]
            for e, p in parts:
                cells = " | ".join(fmt(p.get(name), ".2f") for name in names)
                lines.append(f"| {e['batch']} | {e['variant']} | {cells} |")
    if report["bitmask"]:
        lines += [
            "",
            "Bitmask per step (p50 µs): R = batch x (1 + draft length) rows, fp32 logits [R, vocab]; "
            "copy = host-to-device from the page-locked arena, apply = on rows already on the device.",
            "",
            "| vocab | batch | rows | mask bytes | copy µs | apply µs | copy + apply µs | kernel |",
            "|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for m in report["bitmask"]:
            lines.append(
                f"| {m['vocab']} | {m['batch']} | {m['rows']} | {m['bytes']:,} | {fmt(m['copy_us'])} | "
                f"{fmt(m['apply_us'])} | {fmt(m['copy_apply_us'])} | {m['kernel']} |"
            )
    for name in report.get("errors", {}):
        lines.append(f"\n**{name}: failed** (the traceback is in gpu.json's `errors`)")
    lines += ["", *(f"{note}" for note in report["notes"]), ""]
    return "\n".join(lines)


def notes(meta: dict[str, Any]) -> list[str]:
    out = []
    if meta["random_weights"]:
        out.append(
            "Random weights: decode tok/s, graphs ÷ eager and the bitmask times depend only on shapes and "
            "hold for the real model, as does guided ÷ unguided up to the share of grammar-forced tokens "
            "(see jump-forward below); the drafts' acceptance and guided + spec ÷ guided depend on what the "
            "model predicts and need real weights (`--model DIR`). Guided outputs are grammar-constrained "
            "(valid JSON unless cut at max_tokens) whatever the weights."
        )
    else:
        out.append("Real weights: every figure holds for this model.")
    if meta["jump_forward"]:
        out.append(
            "Jump-forward is on (the engine's default): grammar-forced tokens of a guided request can skip "
            "steps, so guided ÷ unguided may exceed 1 and moves with the share of forced tokens in the output "
            "(which the weights partly decide); `--no-jump-forward` measures guidance's cost per step alone "
            "(gpu.json's `steps` counts the steps each run took)."
        )
    if meta["device"] == "cpu":
        out.append(
            "CPU: there are no CUDA graphs, so graphs ÷ eager is ~1 by construction, and nothing is copied "
            "for the bitmask (the arena's rows are used in place)."
        )
    out.append(
        "tok/s are output tokens over the wall time of the whole batch (prefill included); gpu.json also "
        "holds each run's median per-request decode tok/s (after the first token). guided+spec ÷ guided "
        "compares output characters per second: a grammar-forced draft can spell the same text in other, "
        "smaller tokens than the plain run picks, so tokens/s would flatter speculation."
    )
    return out


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a Hugging Face folder (real weights)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: smollm2-135m")
    parser.add_argument("--num-layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="where the random model is built and kept (default: out/gpu-model-<preset>)",
    )
    parser.add_argument(
        "--tokenizer-from",
        type=Path,
        default=None,
        help="a folder to copy the tokenizer from (default: the default model's)",
    )
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="auto: bfloat16 on cuda, float32 on cpu",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default: 1 16 64")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: 128")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--grammar-backend", default="xgrammar")
    parser.add_argument(
        "--draft-len", type=int, default=3, help="n-gram max draft length; bitmask rows per request - 1"
    )
    parser.add_argument(
        "--workload",
        type=Path,
        default=None,
        help="a workload.jsonl (id, messages, schema) instead of the embedded schemas",
    )
    parser.add_argument("--workload-prefix", default="JME_")
    parser.add_argument("--mask-vocabs", type=int, nargs="+", default=[49152, 128256])
    parser.add_argument("--mask-iters", type=int, default=None, help="default: 200 (quick: 20)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed runs per figure, the median kept (default: 3; quick: 1)"
    )
    parser.add_argument(
        "--no-jump-forward",
        action="store_true",
        help="guided requests take a step per token (isolates the mask's cost from the steps that jump-forward saves)",
    )
    parser.add_argument(
        "--skip", nargs="+", default=[], choices=["default", "eager", "guided", "spec", "eagle", "mask"]
    )
    parser.add_argument(
        "--eagle-variants", nargs="+", default=list(EAGLE_VARIANTS), choices=list(EAGLE_VARIANTS), metavar="VARIANT"
    )
    parser.add_argument("--eagle-head", type=Path, default=None, help="an EAGLE-3 head folder (default: random)")
    parser.add_argument("--trace-dir", type=Path, default=None, help="EAGLE section: each engine's step trace here")
    parser.add_argument("--quick", action="store_true", help="smoke run: batch 1 and 2, 16 tokens, 4 layers")
    parser.add_argument("--output", type=Path, default=Path("out/gpu"))
    args = parser.parse_args()

    preset = args.preset or "smollm2-135m"
    num_layers = args.num_layers if args.num_layers is not None else (4 if args.quick and args.model is None else None)
    batch_sizes = args.batch_sizes or ([1, 2] if args.quick else [1, 16, 64])
    max_tokens = args.max_tokens or (16 if args.quick else 128)
    mask_iters = args.mask_iters or (20 if args.quick else 200)
    repeats = args.repeats or (1 if args.quick else 3)
    max_model_len = args.max_model_len or (1024 if args.quick else None)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    dtype = ("bfloat16" if device == "cuda" else "float32") if args.dtype == "auto" else args.dtype
    skip = set(args.skip)
    if "guided" in skip:
        skip.add("spec")

    if args.model is not None:
        model_dir, model_label, random_weights = args.model, str(args.model), False
    else:
        model_dir = build_random_model(
            preset, args.work_dir or default_folder(preset, num_layers), args.tokenizer_from, num_layers
        )
        layers = PRESETS[preset]["num_hidden_layers"] if num_layers is None else num_layers
        model_label, random_weights = f"random weights, {preset} config ({layers} layers)", True
    if args.workload is not None:
        cases, prompts_label = (
            workload_cases(args.workload, args.workload_prefix),
            f"{args.workload} ({args.workload_prefix}*)",
        )
    else:
        cases, prompts_label = embedded_cases(), f"{len(SCHEMAS)} embedded schemas ({', '.join(n for n, _ in SCHEMAS)})"

    from guidespec import LLM

    setup = Setup(
        model_dir,
        device,
        dtype,
        max(batch_sizes),
        max_model_len,
        args.max_num_batched_tokens,
        args.grammar_backend,
        args.gpu_memory_utilization,
        args.draft_len,
        repeats,
        not args.no_jump_forward,
        accepted=set(inspect.signature(LLM.__init__).parameters),
    )
    rows: dict[int, dict[str, Any]] = {b: {"batch": b} for b in batch_sizes}
    engines: dict[str, float] = {}
    errors: dict[str, str] = {}
    eagle: list[dict[str, Any]] = []
    bitmask: list[dict[str, Any]] = []
    meta = {
        "device": device,
        "device_name": device_name(device),
        "dtype": dtype,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": commit(),
        "model": model_label,
        "model_dir": str(model_dir),
        "random_weights": random_weights,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "jump_forward": not args.no_jump_forward,
        "grammar_backend": args.grammar_backend,
        "draft_len": args.draft_len,
        "prompts": prompts_label,
        "engine_start_s": engines,
        "not_passed": setup.not_passed,
        "batch_sizes": batch_sizes,
    }

    def write() -> None:
        """The report so far: a section that fails or a run cut short keeps what came before it."""
        for row in rows.values():
            row["ratios"] = {
                "guided_over_unguided": ratio(row, "guided", "unguided_same_lengths"),
                # by output text per second: forced-token drafts may split the same text into more tokens
                "guided_spec_over_guided": ratio(row, "guided_spec", "guided", "chars_s"),
                "guided_spec_over_guided_tok_s": ratio(row, "guided_spec", "guided"),
                "graphs_over_eager": ratio(row, "decode", "decode_eager"),
            }
        public = [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows.values()]
        report = {"meta": meta, "rows": public, "eagle": eagle, "bitmask": bitmask, "errors": errors}
        report["notes"] = notes(meta)
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "gpu.json").write_text(json.dumps(report, indent=2, default=str))
        (args.output / "gpu.md").write_text(markdown(report))

    def section(name: str, run: Callable[[], Any]) -> None:
        """One part of the benchmark; its failure is reported and the next part still runs."""
        if name in skip:
            return
        try:
            run()
        except Exception:
            errors[name] = traceback.format_exc()
            print(f"[{name}] FAILED:\n{errors[name]}", flush=True)
        write()

    eagle_batches = [b for b in batch_sizes if b in (1, 16)] or batch_sizes[:1]
    section("default", lambda: bench_default(setup, cases, batch_sizes, max_tokens, rows, skip, engines))
    section("eager", lambda: bench_eager(setup, cases, batch_sizes, max_tokens, rows, engines))
    section(
        "mask",
        lambda: bitmask.extend(bench_bitmask(device, batch_sizes, args.draft_len, args.mask_vocabs, mask_iters)),
    )
    section("spec", lambda: bench_speculative(setup, cases, batch_sizes, max_tokens, rows, engines))
    section(
        "eagle",
        lambda: eagle.extend(
            bench_eagle_graphs(
                setup, cases, eagle_batches, max_tokens, args.eagle_head, args.trace_dir, args.eagle_variants
            )
        ),
    )
    print("\n" + (args.output / "gpu.md").read_text())
    print(f"wrote {args.output / 'gpu.json'} and {args.output / 'gpu.md'}")
    if errors:
        raise SystemExit(f"sections failed: {', '.join(errors)}")


if __name__ == "__main__":
    main()
