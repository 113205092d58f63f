"""guidespec against the runtimes a user would pick instead, side by side in one run, on CPU.

    python benchmarks/peers.py [--model MODEL] [--cases 10] [--max-tokens 256] [--threads 2]
                               [--sets jme rephrased] [--systems llama.cpp hf guidespec guidespec-fp32]
                               [--repeats 3] [--concurrency 1 4 16 64] [--output DIR]

Batch 1, greedy, one case after another, on the same model: the default SmolLM2-135M-Instruct
GGUF for llama.cpp (llama-cpp-python, the optional ``peers`` extra: ``pip install -e '.[peers]'``
builds llama.cpp from source, ~10 min on 2 cores), its fp32 conversion for Hugging Face
``generate`` (guided only, by xgrammar's logits processor) and guidespec (``--dtype``, auto by
default: the file's own blocks; ``guidespec-fp32``: its weights dequantized). For each system and
mode (unguided; guided by the case's JSON schema; guided + prompt lookup / n-gram drafts) and
each case set (the workload's first JME cases as written, and the same facts rephrased by
``benchmarks/rephrase.py``): output tokens per second including prefill, time per task (a case's
prompt to its last token) and how many outputs are JSON valid under the schema. Goals (issue
25): guidespec unguided >= llama.cpp unguided; guided + n-gram >= 1.5x llama.cpp unguided and
>= 2.5x llama.cpp with a grammar; guided / unguided >= 0.98; every guided output valid.

Unguided outputs run to ``max_tokens`` where guided ones stop after the JSON (~60 tokens), so
their prefill weighs less per token: guided / unguided is also measured at the same lengths,
unguided run to each guided output's token count with EOS ignored ("unguided, guided's length"),
which leaves the grammar's own cost.

Every system's every mode runs case by case (case 1 in each, then case 2, ...), so the ratios
between systems meet the same moments of a noisy machine; each mode has a model or engine of its
own (llama.cpp reuses its previous call's prompt, and no mode may find a prompt another computed).
guidespec's engines run with prefix caching on as users run it (the cases share a chat template
and system prompt, as llama.cpp's consecutive calls share a prefix), fresh for each case set.
Its guided runs then alternate with their same-length twins case by case, with prefix caching
off (the twin computes the prompt its guided run just computed), ``--repeats`` times, each on a
fresh engine, so every schema's compile counts as a first one; their figures are the sums, with
each repeat's ratio beside them.

``--concurrency``: guidespec alone, guided + n-gram, that many requests at once (one engine per
level, ``max(c, 8)`` requests over the cases, prefix caching off since the cases repeat):
throughput, and the scheduler's share of a step (its work the workers wait for, from the step
trace; goal <= 5% at 16).

``--model``: another model than the default (a GGUF file, or a name ``guidespec`` knows such as
``gemma-3-270m``; llama.cpp needs the GGUF the folder was converted from). A model whose tokenizer
has no chat template (a base model) gets each case as a few-shot completion instead of chat
messages (``guidespec sweep``'s ``few_shot_prompt``: one worked example, then the case; the same
prompt for every system).

Writes peers.json and peers.md into ``--output``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import commit, fmt, machine  # noqa: E402

Run = Callable[[dict[str, Any]], tuple[str, int]]  # case -> (text, output tokens)
# "unguided, guided's length": the guided output's token count, EOS ignored: guided ÷ this is the
# grammar's own cost (unguided outputs run longer, to max_tokens, so their prefill weighs less)
SAME_LENGTH = "unguided, guided's length"
MODES = ("unguided", "guided", SAME_LENGTH, "guided+lookup")


def case_sets(names: list[str], n: int) -> dict[str, list[dict[str, Any]]]:
    """The first ``n`` JME cases as written ("jme"), and the same cases rephrased ("rephrased"),
    case i in ``rephrase.py``'s style i mod 4 (sentences, key: value lines, shuffled, prose)."""
    from benchmarks.rephrase import STYLES, jme_cases, rephrase

    cases = jme_cases(n)
    rephrased = [rephrase(case, STYLES[i % len(STYLES)]) for i, case in enumerate(cases)]
    return {name: cases if name == "jme" else rephrased for name in names}


def schema_of(case: dict[str, Any]) -> dict[str, Any]:
    schema = case["schema"]
    return json.loads(schema) if isinstance(schema, str) else schema


def with_completion_prompts(cases: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """``cases`` with a ``prompt``: the few-shot completion a base model gets (``few_shot_prompt``),
    its example the first JME case after the ``n`` measured ones."""
    from guidespec.entrypoints.sweep import few_shot_prompt

    example = case_sets(["jme"], n + 1)["jme"][-1]
    return [dict(case, prompt=few_shot_prompt(case, example)) for case in cases]


# ---------------------------------------------------------------- systems


def gguf_file(model: str | None) -> Path:
    """The GGUF file llama.cpp runs for ``model`` (the one guidespec converted its folder from)."""
    from guidespec.model_files import resolve_model_dir
    from guidespec.worker.checkpoint import gguf_source

    source = gguf_source(resolve_model_dir(model, show_progress=False))
    if source is None:
        raise ImportError(f"{model} is not a GGUF file (llama.cpp runs GGUF files only)")
    return source


def llama_cpp_runs(model: str | None, threads: int, max_tokens: int) -> dict[str, Run]:
    from llama_cpp import Llama, LlamaGrammar
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    path = str(gguf_file(model))
    kw = dict(model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, seed=0, verbose=False)
    # a model per mode: the modes run case by case, and llama.cpp reuses its previous call's prompt
    plain, constrained = Llama(**kw), Llama(**kw)
    # logits_all: with a draft model llama-cpp-python (0.3.36) keeps every position's logits, yet
    # sizes their buffer by n_batch unless asked: past 512 tokens a step's drafts overflow it
    lookup = Llama(**kw, logits_all=True, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))

    def run(llm: Any, case: dict[str, Any], guided: bool) -> tuple[str, int]:
        grammar = LlamaGrammar.from_json_schema(json.dumps(schema_of(case)), verbose=False) if guided else None
        if "prompt" in case:  # a base model: the few-shot completion
            out = llm.create_completion(case["prompt"], max_tokens=max_tokens, temperature=0.0, grammar=grammar, seed=0)
            return out["choices"][0]["text"] or "", int(out["usage"]["completion_tokens"])
        out = llm.create_chat_completion(
            case["messages"], max_tokens=max_tokens, temperature=0.0, grammar=grammar, seed=0
        )
        return out["choices"][0]["message"]["content"] or "", int(out["usage"]["completion_tokens"])

    return {
        "unguided": lambda case: run(plain, case, False),
        "guided": lambda case: run(constrained, case, True),
        "guided+lookup": lambda case: run(lookup, case, True),
    }


def hf_runs(model: str | None, threads: int, max_tokens: int) -> dict[str, Run]:
    import torch
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from guidespec.model_files import resolve_model_dir

    torch.set_num_threads(threads)
    folder = resolve_model_dir(model, show_progress=False)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size)
    compiler = xgr.GrammarCompiler(info)

    def run(case: dict[str, Any], guided: bool) -> tuple[str, int]:
        if "prompt" in case:
            ids = tokenizer(case["prompt"], return_tensors="pt").input_ids
        else:
            ids = tokenizer.apply_chat_template(case["messages"], add_generation_prompt=True, return_tensors="pt")
            ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        processors = []
        if guided:
            processors.append(xgr.contrib.hf.LogitsProcessor(compiler.compile_json_schema(json.dumps(schema_of(case)))))
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=max_tokens, do_sample=False, logits_processor=processors, pad_token_id=0
            )
        new = out[0, ids.shape[1] :]
        return tokenizer.decode(new, skip_special_tokens=True), int(new.shape[0])

    return {"guided": lambda case: run(case, True)}  # (its unguided decode: benchmarks/decode.py)


class GuidespecSystem:
    """guidespec's runs. The modes measured beside the peers (unguided, guided + n-gram) run each
    on an engine of its own, with prefix caching on as users run it, fresh for each case set
    (``reset``): no mode finds a prompt another mode computed. The guided runs and their
    same-length twins share an engine without prefix caching (``pair_runs``), fresh for each
    repeat (``reset("pairs")``)."""

    def __init__(self, model: str | None, dtype: str, max_tokens: int) -> None:
        self.model, self.dtype, self.max_tokens = model, dtype, max_tokens
        self.engines: dict[str, Any] = {}  # "unguided", "guided+lookup", "pairs" -> LLM
        self.guided_lengths: dict[str, int] = {}

    def runs(self) -> dict[str, Run]:
        return {
            "unguided": lambda case: self._run("unguided", case, False, False),
            "guided+lookup": lambda case: self._run("guided+lookup", case, True, True),
        }

    def pair_runs(self) -> dict[str, Run]:
        return {
            "guided": lambda case: self._run("pairs", case, True, False),
            SAME_LENGTH: lambda case: self._run("pairs", case, False, False, self.guided_lengths[case["id"]]),
        }

    def reset(self, key: str | None = None) -> None:
        """Close the engine of ``key`` (None: every one); the next run starts a fresh one."""
        for name in [key] if key is not None else list(self.engines):
            engine = self.engines.pop(name, None)
            if engine is not None:
                engine.close()

    def _engine(self, key: str) -> Any:
        from guidespec import LLM

        if key not in self.engines:
            self.engines[key] = LLM(
                model=self.model,
                dtype=self.dtype,
                show_progress=False,
                speculative="ngram",
                max_batch_size=8,
                enable_prefix_caching=key != "pairs",
            )
        return self.engines[key]

    def _run(
        self, key: str, case: dict[str, Any], guided: bool, speculative: bool, length: int | None = None
    ) -> tuple[str, int]:
        from guidespec import SamplingParams
        from guidespec.protocol import GuidedDecoding

        params = SamplingParams(
            max_tokens=length or self.max_tokens,
            temperature=0.0,
            speculative=speculative,
            guided=GuidedDecoding(json_schema=json.dumps(schema_of(case))) if guided else None,
            ignore_eos=length is not None,
        )
        out = self._engine(key).generate([prompt_of(case)], params)[0]
        if key == "pairs" and guided:
            self.guided_lengths[case["id"]] = len(out.token_ids)
        return out.text, len(out.token_ids)


def prompt_of(case: dict[str, Any]) -> Any:
    """What guidespec is given: the few-shot completion for a base model, else the chat messages."""
    return case.get("prompt", case["messages"])


def measure(run: Run, cases: list[dict[str, Any]], guided: bool) -> dict[str, Any]:
    return measure_each({"mode": run}, cases, {"mode": guided})["mode"]


def measure_each(runs: dict[Any, Run], cases: list[dict[str, Any]], guided: dict[Any, bool]) -> dict[Any, Any]:
    """Each mode of ``runs`` on every case, case by case (case 1 in every mode, then case 2, ...):
    modes compared with each other, whatever system runs them, meet the same moments of a noisy
    machine."""
    from guidespec.entrypoints.sweep import validate_output

    for run in runs.values():
        run(cases[0])  # warm-up (grammar compiler caches, first-call costs)
    tallies: dict[Any, dict[str, Any]] = {m: {"tokens": 0, "valid": 0, "walls": [], "failures": []} for m in runs}
    for case in cases:
        for mode, run in runs.items():
            tally = tallies[mode]
            start = time.perf_counter()
            try:
                text, n = run(case)
            except Exception as e:  # a peer that crashes on a case is a result, not the end of the run
                tally["failures"].append(f"{case['id']}: {type(e).__name__}: {str(e)[:120]}")
                continue
            tally["walls"].append(time.perf_counter() - start)
            tally["tokens"] += n
            tally["valid"] += validate_output(text, schema_of(case)) is None
    out = {}
    for mode, t in tallies.items():
        wall = sum(t["walls"])
        out[mode] = {
            "tok_s": t["tokens"] / wall if wall else None,
            "s_per_task": wall / len(t["walls"]) if t["walls"] else None,
            "tokens": t["tokens"],
            "wall_s": wall,
            "valid": t["valid"],
            "cases": len(cases),
            "failures": t["failures"],
            "guided": guided[mode],
        }
    return out


def measure_same_length(
    pairs: dict[str, Run], cases: list[dict[str, Any]], repeats: int, restart: Callable[[], None]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Guided, and unguided held to each guided output's length, case by case, ``repeats`` times,
    each time on a fresh engine without prefix caching (every schema compiled anew, and the twin
    computes the prompt its guided run just computed): the summed figures, and each repeat's
    guided ÷ unguided in ``ratios``."""
    each = []
    for _ in range(repeats):
        restart()
        each.append(measure_each(pairs, cases, {"guided": True, SAME_LENGTH: True}))
    merged = []
    for mode in pairs:
        parts = [e[mode] for e in each]
        tokens, wall = sum(p["tokens"] for p in parts), sum(p["wall_s"] for p in parts)
        merged.append(
            dict(
                parts[0],
                tokens=tokens,
                wall_s=wall,
                tok_s=tokens / wall if wall else None,
                s_per_task=wall / max(1, sum(p["cases"] - len(p["failures"]) for p in parts)),
                valid=sum(p["valid"] for p in parts),
                cases=sum(p["cases"] for p in parts),
                failures=[f for p in parts for f in p["failures"]],
            )
        )
    merged[0]["ratios"] = [ratio(e["guided"], e[SAME_LENGTH]) for e in each]
    return merged[0], merged[1]


# ---------------------------------------------------------------- concurrency


def concurrency_sweep(
    levels: list[int], cases: list[dict[str, Any]], model: str | None, dtype: str, max_tokens: int
) -> list[dict]:
    from guidespec import LLM, SamplingParams
    from guidespec.protocol import GuidedDecoding

    rows = []
    for c in levels:
        trace = Path(tempfile.mkdtemp()) / "trace.json"
        os.environ["GUIDESPEC_TRACE"] = str(trace)
        try:
            engine = dict(
                model=model, dtype=dtype, show_progress=False, speculative="ngram", enable_prefix_caching=False
            )
            with LLM(**engine, max_batch_size=max(c, 8)) as llm:
                picked = [cases[i % len(cases)] for i in range(max(c, 8))]
                params = [
                    SamplingParams(
                        max_tokens=max_tokens,
                        temperature=0.0,
                        guided=GuidedDecoding(json_schema=json.dumps(schema_of(case))),
                    )
                    for case in picked
                ]
                outs, wall = asyncio.run(_at_once(llm, picked, params, c))
        finally:
            os.environ.pop("GUIDESPEC_TRACE", None)
        summary = json.loads(trace.read_text())["summary"] if trace.exists() else {}
        tokens = sum(len(o.token_ids) for o in outs)
        rows.append(
            {
                "concurrency": c,
                "requests": len(outs),
                "tok_s": tokens / wall,
                "scheduler_share": summary.get("outside_forward_fraction"),
                "mean_step_ms": summary.get("mean_step_ms"),
            }
        )
        print(f"[concurrency {c}] {rows[-1]}", flush=True)
    return rows


async def _at_once(llm: Any, cases: list[dict[str, Any]], params: list[Any], limit: int) -> tuple[list[Any], float]:
    gate = asyncio.Semaphore(limit)

    async def one(case: dict[str, Any], p: Any) -> Any:
        async with gate:
            return await llm.agenerate(prompt_of(case), p)

    start = time.perf_counter()
    outs = await asyncio.gather(*(one(case, p) for case, p in zip(cases, params)))
    return list(outs), time.perf_counter() - start


# ---------------------------------------------------------------- report


def fmt_ratios(ratios: list[float | None]) -> str:
    return ", ".join(fmt(r, ".3f") for r in ratios)


def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    if not a or not b or not a.get("tok_s") or not b.get("tok_s"):
        return None
    return a["tok_s"] / b["tok_s"]


def goals(results: dict[str, dict[str, dict[str, Any]]]) -> list[tuple[str, float | None, float]]:
    llama, out = results.get("llama.cpp", {}), []
    for name in [s for s in results if s.startswith("guidespec")]:
        g = results[name]
        out += [
            (f"{name} unguided ÷ llama.cpp unguided", ratio(g.get("unguided"), llama.get("unguided")), 1.0),
            (f"{name} guided + n-gram ÷ llama.cpp unguided", ratio(g.get("guided+lookup"), llama.get("unguided")), 1.5),
            (f"{name} guided + n-gram ÷ llama.cpp guided", ratio(g.get("guided+lookup"), llama.get("guided")), 2.5),
            (
                f"{name} guided ÷ unguided, the same lengths",
                ratio(g.get("guided"), g.get("unguided, guided's length")),
                0.98,
            ),
            (f"{name} guided ÷ unguided, each its own length", ratio(g.get("guided"), g.get("unguided")), 0.98),
        ]
    return out


def has_chat_template(model: str | None) -> bool:
    from guidespec.model_files import load_tokenizer, resolve_model_dir

    return bool(getattr(load_tokenizer(resolve_model_dir(model, show_progress=False)), "chat_template", None))


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        "# guidespec against its peers (CPU, batch 1, greedy)",
        "",
        f"- model {meta.get('model', 'default')}, prompts: {meta.get('prompts', 'chat')}",
        f"- {meta['date']}, commit {meta['commit']}; {meta['machine']}; {meta['threads']} threads each",
        f"- {meta['cases']} cases per set, max_tokens {meta['max_tokens']}; guidespec dtype {meta['dtype']}; "
        f"llama.cpp: llama-cpp-python {meta.get('llama_cpp', '–')} on the GGUF (prompt lookup: 10 tokens; "
        f"build: {meta.get('llama_cpp_build', '–')})",
        f"- every system's modes case by case, each on an engine of its own (guidespec: prefix caching on); "
        f"guidespec's guided and same length then case by case without prefix caching, "
        f"{meta.get('repeats', 1)} time(s), each on a fresh engine (summed)",
        "",
    ]
    for name, results in report["sets"].items():
        lines += [
            f"## {name}",
            "",
            "| system | mode | tok/s | s per task | valid JSON | failures |",
            "|---|---|---:|---:|---:|---|",
        ]
        for system, modes in results.items():
            for mode, r in modes.items():
                valid = f"{r['valid']}/{r['cases']}"
                failures = f"{len(r['failures'])}: {r['failures'][0]}" if r["failures"] else ""
                lines.append(
                    f"| {system} | {mode} | {fmt(r['tok_s'])} | {fmt(r['s_per_task'], '.2f')} | {valid} | {failures} |"
                )
        for system, modes in results.items():
            if "ratios" in modes.get("guided", {}):
                lines += ["", f"{system}: guided ÷ same length per repeat: {fmt_ratios(modes['guided']['ratios'])}"]
        lines += ["", "| goal | measured | target | met |", "|---|---:|---:|---|"]
        for label, value, target in goals(results):
            met = "–" if value is None else ("yes" if value >= target else "no")
            lines.append(f"| {label} | {fmt(value, '.2f')} | {target} | {met} |")
        lines.append("")
    if report["concurrency"]:
        lines += [
            "## guidespec, guided + n-gram, requests at once",
            "",
            "| concurrency | requests | tok/s | scheduler's share of a step | mean step ms |",
            "|---:|---:|---:|---:|---:|",
        ]
        for row in report["concurrency"]:
            share = row["scheduler_share"]
            lines.append(
                f"| {row['concurrency']} | {row['requests']} | {fmt(row['tok_s'])} | "
                f"{fmt(None if share is None else 100 * share)}% | {fmt(row['mean_step_ms'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file or a model name guidespec knows (default: SmolLM2)")
    parser.add_argument("--cases", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dtype", default="auto", help="guidespec's: auto (the GGUF's own blocks on the CPU) or float32"
    )
    parser.add_argument("--sets", nargs="+", default=["jme", "rephrased"], choices=["jme", "rephrased"])
    parser.add_argument(
        "--systems",
        nargs="+",
        default=["llama.cpp", "hf", "guidespec", "guidespec-fp32"],
        choices=["llama.cpp", "hf", "guidespec", "guidespec-fp32"],
        help="guidespec: --dtype (auto: the file's own blocks); guidespec-fp32: its weights dequantized",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="guidespec's guided and same-length runs, case by case, this many times on fresh engines",
    )
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16, 64])
    parser.add_argument("--output", type=Path, default=Path("out/peers"))
    args = parser.parse_args()

    sets = case_sets(args.sets, args.cases)
    if not has_chat_template(args.model):  # a base model: each case as a few-shot completion
        sets = {name: with_completion_prompts(cases, args.cases) for name, cases in sets.items()}
    systems: dict[str, dict[str, Run]] = {}
    meta: dict[str, Any] = {}
    ours: dict[str, GuidespecSystem] = {}
    for system in args.systems:
        try:
            if system == "llama.cpp":
                import llama_cpp

                meta["llama_cpp"] = llama_cpp.__version__
                # which build: the CPU features it was compiled for (AVX-512 / AMX builds crash on some Xeons)
                meta["llama_cpp_build"] = llama_cpp.llama_print_system_info().decode().strip(" |")
                systems[system] = llama_cpp_runs(args.model, args.threads, args.max_tokens)
            elif system == "hf":
                systems[system] = hf_runs(args.model, args.threads, args.max_tokens)
            elif system in ("guidespec", "guidespec-fp32"):
                dtype = "float32" if system == "guidespec-fp32" else args.dtype
                ours[system] = GuidespecSystem(args.model, dtype, args.max_tokens)
                systems[system] = ours[system].runs()
            else:
                raise SystemExit(f"unknown system {system!r}")
        except ImportError as e:
            print(f"[{system}] skipped: {e} (pip install -e '.[peers]' for llama.cpp)", flush=True)
    report: dict[str, Any] = {"sets": {}, "concurrency": []}
    try:
        for name, cases in sets.items():
            for gs in ours.values():
                gs.reset()  # fresh engines: no prompt of the other case set cached
            # every system's every mode, case by case: the ratios between systems meet the same noise
            runs = {(system, mode): run for system, modes in systems.items() for mode, run in modes.items()}
            measured = measure_each(runs, cases, {key: key[1] != "unguided" for key in runs})
            results: dict[str, dict[str, Any]] = {system: {} for system in systems}
            for (system, mode), r in measured.items():
                results[system][mode] = r
            for system, gs in ours.items():
                try:
                    results[system]["guided"], results[system][SAME_LENGTH] = measure_same_length(
                        gs.pair_runs(),
                        cases,
                        args.repeats,
                        lambda gs=gs: gs.reset("pairs"),  # type: ignore[misc]
                    )
                except Exception:
                    traceback.print_exc()
                gs.reset()
            for system in results:
                results[system] = {m: results[system][m] for m in MODES if m in results[system]}
                for mode, r in results[system].items():
                    each = f", guided ÷ same length per repeat {fmt_ratios(r['ratios'])}" if "ratios" in r else ""
                    print(
                        f"[{name}] {system} {mode}: {fmt(r['tok_s'])} tok/s, "
                        f"{fmt(r['s_per_task'], '.2f')} s/task, valid {r['valid']}/{r['cases']}, "
                        f"failures {len(r['failures'])}{each}",
                        flush=True,
                    )
            report["sets"][name] = results
    finally:
        for gs in ours.values():
            gs.reset()
    if args.concurrency:
        report["concurrency"] = concurrency_sweep(
            args.concurrency, sets[args.sets[0]], args.model, args.dtype, args.max_tokens
        )
    report["meta"] = dict(
        meta,
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        commit=commit(),
        machine=machine(),
        threads=args.threads,
        cases=args.cases,
        repeats=args.repeats,
        max_tokens=args.max_tokens,
        dtype=args.dtype,
        model=args.model or "SmolLM2-135M-Instruct (default)",
        prompts="few-shot completions" if not has_chat_template(args.model) else "chat",
    )
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "peers.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (args.output / "peers.md").write_text(text)
    print("\n" + text)


if __name__ == "__main__":
    main()
