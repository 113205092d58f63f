"""Speculative decoding through the whole engine: greedy speculative output equals greedy plain
output token for token, for every drafter, guided and unguided, TP=1 and TP=2; sampled guided
outputs stay valid; per-request switches and figures."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from guidespec import LLM, RequestError, SamplingParams
from guidespec.entrypoints.sweep import validate_output
from guidespec.llm import GenerationOutput
from guidespec.protocol import GuidedDecoding

pytestmark = pytest.mark.slow
WORKLOAD = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "jsonschemabench" / "workload.jsonl"
UNGUIDED = [
    "Repeat after me exactly, three times: the quick brown fox jumps over the lazy dog.",
    [{"role": "user", "content": "List the days of the week, one per line."}],
]
DRAFTERS = {
    "ngram": dict(method="ngram"),
    "ngram-fixed-length": dict(method="ngram", adaptive=False, max_draft_len=4),
    "forced": dict(method="forced"),
    "user": dict(method="user", user_drafter="tests.scheduler.speculation.test_drafters:_Echo"),
    "draft-model-self": dict(method="draft_model", draft_model="self", adaptive=False),  # every draft right
    "draft-model-layers": dict(method="draft_model", draft_model="layers:8"),  # many drafts wrong
    "draft-model-int8": dict(method="draft_model", draft_model="int8", adaptive=False),  # nearly every draft right
}
# draft steps as the fixed-shape sequence a CUDA graph replays, grammar waits in the C trampolines
ENGINE_OPTIONS: dict[str, dict[str, Any]] = {"draft-model-int8": dict(graph_grammar=True)}


def _jme_cases(n: int) -> list[dict[str, Any]]:
    cases = [json.loads(line) for line in WORKLOAD.read_text().splitlines()]
    return [c for c in cases if c["id"].startswith("JME_")][:n]


def _requests(backend: str = "xgrammar", temperature: float = 0.0) -> list[tuple[Any, SamplingParams]]:
    guided = [
        (
            c["messages"],
            SamplingParams(
                max_tokens=160,
                temperature=temperature,
                seed=i,
                guided=GuidedDecoding(json_schema=c["schema"], backend=backend),
            ),
        )
        for i, c in enumerate(_jme_cases(3))
    ]
    # (32 tokens: the longest rows, every test's steps; the repeated sentence comes back within them)
    plain = [(p, SamplingParams(max_tokens=32, temperature=temperature, ignore_eos=True)) for p in UNGUIDED]
    return guided + plain


def _run(llm: LLM, requests: list[tuple[Any, SamplingParams]]) -> list[GenerationOutput]:
    async def run() -> list[GenerationOutput]:
        return list(await asyncio.gather(*(llm.agenerate(p, sp) for p, sp in requests)))

    return asyncio.run(run())


BACKENDS = ("xgrammar", "llguidance")


def _run_backends(llm: LLM, backends: tuple[str, ...] = BACKENDS) -> dict[str, list[GenerationOutput]]:
    """``_requests(backend)`` of every backend, sent together (one engine serves both, as requests
    choose theirs): the outputs by backend."""
    outs = _run(llm, [request for backend in backends for request in _requests(backend)])
    per_backend = len(outs) // len(backends)
    return {backend: outs[i * per_backend : (i + 1) * per_backend] for i, backend in enumerate(backends)}


@pytest.fixture(scope="module")
def references() -> dict[str, list[list[int]]]:
    """Plain greedy decoding, per grammar backend: no drafts, and no jump-forward (what every
    way of drafting, jump-forward's forced tokens included, must give). One engine serves both
    backends, as requests choose theirs."""
    with LLM(max_batch_size=8, show_progress=False, jump_forward=False) as llm:
        return {backend: [out.token_ids for out in outs] for backend, outs in _run_backends(llm).items()}


@pytest.fixture(scope="module")
def reference(references: dict[str, list[list[int]]]) -> list[list[int]]:
    return references["xgrammar"]


@pytest.fixture(scope="module")
def tp2_references() -> dict[str, list[list[int]]]:
    """Plain greedy decoding at TP=2, per backend: two ranks add their shards' sums in another
    order than one rank does, so TP=2's output may leave TP=1's at a near tie; speculative
    decoding at TP=2 must give TP=2's."""
    with LLM(max_batch_size=8, show_progress=False, jump_forward=False, tensor_parallel_size=2) as llm:
        return {backend: [out.token_ids for out in outs] for backend, outs in _run_backends(llm).items()}


def test_jump_forward_changes_nothing_the_model_says(references: dict[str, list[list[int]]], default_llm: LLM) -> None:
    """Jump-forward as it is by default (no drafter): the grammar's forced tokens are drafts the
    model verifies in the same forward, so greedy output equals greedy output without it, on
    both backends."""
    assert default_llm.config.jump_forward == "verified"
    outs = _run_backends(default_llm)
    for backend in BACKENDS:
        assert [o.token_ids for o in outs[backend]] == references[backend], backend
        guided = outs[backend][:3]
        assert sum(o.stats.num_accepted_tokens for o in guided) > 0  # forced tokens went through as verified drafts
        assert sum(o.stats.num_steps for o in guided) < sum(len(o.token_ids) for o in guided)


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_speculative_equals_greedy_plain(
    references: dict[str, list[list[int]]], drafter: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every drafter on xgrammar's requests; n-gram and the int8 draft model on llguidance's too
    (sent with xgrammar's, to the same engine: a request picks its backend); the int8 draft model
    with its draft steps as graphs and its greedy steps fused (``graph_grammar``: verify,
    acceptance and the draft steps in one sequence, the draft model sharing the target's cache).
    Some engines check more first, on the same engine (``CHECKED_ON_THE_SAME_ENGINE``: each a
    function of its own, below)."""
    backends = BACKENDS if drafter in ("ngram", "draft-model-int8") else BACKENDS[:1]
    options = ENGINE_OPTIONS.get(drafter, {})
    monkeypatch.setenv("GUIDESPEC_TRACE", str(tmp_path / "trace.json"))
    with LLM(max_batch_size=8, show_progress=False, speculative=DRAFTERS[drafter], **options) as llm:
        for check in CHECKED_ON_THE_SAME_ENGINE.get(drafter, ()):
            check(llm, references)
        runs = _run_backends(llm, backends)
    for backend, outs in runs.items():
        assert [o.token_ids for o in outs] == references[backend], backend
    fused_steps = json.loads((tmp_path / "trace.json").read_text())["summary"]["fused_steps"]
    assert (fused_steps > 0) == bool(options.get("graph_grammar")), fused_steps
    outs = runs["xgrammar"]
    assert sum(o.stats.num_spec_steps for o in outs) > 0
    accepted, drafted = (sum(getattr(o.stats, f) for o in outs) for f in ("num_accepted_tokens", "num_draft_tokens"))
    if drafter == "draft-model-self":  # the target drafting for itself: greedy drafts are always accepted
        assert accepted == drafted > 0
    elif drafter == "draft-model-int8":  # the target's own weights, rounded: it nearly always agrees
        assert accepted > 0.8 * drafted
    elif drafter not in ("user", "draft-model-layers"):  # those are rarely right; the others must be, often
        assert accepted > 0.2 * drafted


def test_tensor_parallel_speculative_equals_plain_and_llguidance(
    tp2_references: dict[str, list[list[int]]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """TP=2: the draft model (on rank 0 alone) keeps its own cache and follows the target; prompt
    lookup drafts beside it (the longer valid draft wins). With ``graph_grammar`` (as on CUDA by
    default) greedy steps run fused: rank 0 the whole step, its draft model following the step's
    tokens in its own cache, rank 1 the target's part."""
    monkeypatch.setenv("GUIDESPEC_TRACE", str(tmp_path / "trace.json"))
    # (8 of the target's layers: a draft step at a quarter of the int8 model's cost, TP=1 runs that one)
    speculative = {"method": "draft_model", "draft_model": "layers:8", "combine_ngram": True}
    with LLM(
        max_batch_size=8,
        show_progress=False,
        tensor_parallel_size=2,
        grammar_backend="llguidance",
        speculative=speculative,
        graph_grammar=True,
    ) as llm:
        outs = _run(llm, _requests(backend="llguidance"))
    assert [o.token_ids for o in outs] == tp2_references["llguidance"]
    assert json.loads((tmp_path / "trace.json").read_text())["summary"]["fused_steps"] > 0
    for case, out in zip(_jme_cases(3), outs):
        assert out.finish_reason == "stop" and validate_output(out.text, case["schema"]) is None
    assert sum(o.stats.num_accepted_tokens for o in outs) > 0


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny EAGLE-3 head for the default model, trained for a few seconds by ``train-eagle``'s
    own code on the target's generations in the committed sweep results (JME cases left out). The
    features' time budget of 0 keeps the first 2 of the 8 generations (64 output tokens and 48 of
    the prompt's each); 16 updates: the tests need drafts, right or wrong, not a good head."""
    from guidespec.entrypoints.train_eagle import TrainConfig, train

    results = sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "results").glob("sweep-*.jsonl"))
    folder = tmp_path_factory.mktemp("eagle") / "head"
    info = train(
        TrainConfig(
            folder,
            from_results=results,
            max_sequences=8,
            draft_vocab_size=2048,
            max_minutes=0.15,
            max_updates=16,
            max_output_tokens=64,
            prompt_window=48,
            max_feature_minutes=0.0,
            num_heads=3,
            num_kv_heads=1,
            intermediate_size=256,
            threads=2,  # (nothing else runs while a fixture sets up)
        ),
        log=lambda *_: None,
    )
    assert info["updates"] > 0 and info["draft_vocab_size"] == 2048
    assert (info["sequences"], info["held_out"]) == (1, 1)
    return folder


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_eagle_equals_greedy_plain(
    reference: list[list[int]],
    tp2_references: dict[str, list[list[int]]],
    eagle_head: Path,
    tp: int,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """TP=2 also combines the head with prompt lookup (the longer valid draft wins), lets the
    adaptive plan turn drafting on and off (the head then follows lazily, from a backlog) and runs
    whole greedy steps fused (``graph_grammar``: rank 0 runs the step, rank 1 the target's part of
    it; a fused step first runs the positions the head held back), masking only each guided row's
    first draft step (``draft_mask_steps``: one round trip to the scheduler a proposal)."""
    monkeypatch.setenv("GUIDESPEC_TRACE", str(tmp_path / "trace.json"))
    speculative = dict(
        method="eagle",
        draft_model=str(eagle_head),
        adaptive=tp == 2,
        combine_ngram=tp == 2,
        draft_mask_steps=1 if tp == 2 else None,
    )
    with LLM(
        max_batch_size=8, show_progress=False, tensor_parallel_size=tp, speculative=speculative, graph_grammar=tp == 2
    ) as llm:
        outs = _run(llm, _requests())
    assert [o.token_ids for o in outs] == (reference if tp == 1 else tp2_references["xgrammar"])
    for case, out in zip(_jme_cases(3), outs):
        assert out.finish_reason == "stop" and validate_output(out.text, case["schema"]) is None
    assert sum(o.stats.num_draft_tokens for o in outs) > 0
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert (trace["summary"]["fused_steps"] > 0) == (tp == 2), trace["summary"]
    fills = {e["name"] for e in trace["traceEvents"] if str(e["name"]).startswith("fill draft step")}
    assert fills == ({"fill draft step 0 masks"} if tp == 2 else {f"fill draft step {j} masks" for j in range(3)})


@pytest.mark.parametrize("exchange", ["stream", "graph", "python"])
def test_every_draft_exchange_gives_the_same_greedy_eagle_output(
    reference: list[list[int]], eagle_head: Path, exchange: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Rank 0's draft steps through the C host stream (the trampolines a CUDA graph calls back), as
    the fixed-shape sequence a CUDA graph replays (``graph_grammar``: run eagerly here, the
    trampolines in stream order), or as messages over ZeroMQ and the ring give what the default
    (the C channel, called directly) gives: plain greedy output. The step trace shows the
    scheduler filling each draft step's masks, where the channel serves them, and rank 0 waiting
    for them."""
    monkeypatch.setenv("GUIDESPEC_DRAFT_CHANNEL", "c" if exchange == "graph" else exchange)
    monkeypatch.setenv("GUIDESPEC_TRACE", str(tmp_path / "trace.json"))
    # (the graph engine plans its draft lengths adaptively: its fused steps meet draft lengths that
    # vary, and steps where no row drafts, whose fused graph has no draft steps)
    speculative = dict(method="eagle", draft_model=str(eagle_head), adaptive=exchange == "graph")
    with LLM(max_batch_size=8, show_progress=False, speculative=speculative, graph_grammar=exchange == "graph") as llm:
        channel = llm._engine.processes.drafts
        assert (channel is not None) == (exchange != "python")
        outs = _run(llm, _requests())
    assert [o.token_ids for o in outs] == reference
    assert sum(o.stats.num_draft_tokens for o in outs) > 0
    trace = json.loads((tmp_path / "trace.json").read_text())
    fills = [e for e in trace["traceEvents"] if str(e["name"]).startswith("fill draft step")]
    assert (len(fills) > 0) == (exchange != "python")
    assert {e["name"] for e in fills} <= {f"fill draft step {j} masks" for j in range(8)}
    assert (trace["summary"]["draft_fill_fraction"] > 0) == (exchange != "python")
    # graph_grammar on one rank: steady-state steps ran whole as one graph (worker/drafting/step_graph.py)
    fused = [e for e in trace["traceEvents"] if str(e["name"]).startswith("fused step")]
    assert (len(fused) > 0) == (exchange == "graph")
    assert trace["summary"]["fused_steps"] == len(fused)
    # a fused step times its draft steps apart (the adaptive plan's draft cost learns from them)
    assert (any(e["name"] == "draft steps" for e in trace["traceEvents"])) == (exchange == "graph")
    # rank 0's waits for masks, whichever way they come (in graphs: timed by the trampolines)
    waits = {e["name"] for e in trace["traceEvents"] if e["pid"] == 2 and str(e["name"]).startswith("wait for ")}
    assert "wait for draft 0 masks" in waits  # (unfused steps wait for their bitmask: where every
    assert ("wait for bitmask" in waits) or exchange == "graph"  # guided step fused, none did)
    assert waits <= {"wait for bitmask", "wait for verify masks"} | {f"wait for draft {j} masks" for j in range(8)}
    assert ("wait for verify masks" in waits) == (exchange == "graph")
    assert trace["summary"]["mask_wait_fraction"] > 0


def test_sampled_requests_run_fused_steps(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With ``graph_grammar`` the model drafter drafts its argmax for sampled rows too (one-hot
    q'), so steps of sampled rows run fused, verified by rejection sampling on the device
    (``verify_padded``, whose distribution a unit test checks): guided outputs stay valid and
    drafts are accepted. A seeded row fuses too (its numbers are its seed's, copied into the
    graph's inputs) and draws the same tokens alone and among other requests (one engine, alone
    first: the trace's times tell the two runs apart)."""
    unseeded = [(p, dataclasses.replace(sp, seed=None)) for p, sp in _requests(temperature=1.0)]
    seeded = _requests(temperature=1.0)[1]
    speculative = dict(method="draft_model", draft_model="self", adaptive=False)
    monkeypatch.setenv("GUIDESPEC_TRACE", str(tmp_path / "trace.json"))
    with LLM(max_batch_size=8, show_progress=False, speculative=speculative, graph_grammar=True) as llm:
        alone = llm.generate(*seeded)[0]
        alone_done = time.time()
        *outs, among = _run(llm, [*unseeded, seeded])
    fused = [e["ts"] for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if _is_fused(e)]
    assert any(ts < alone_done * 1e6 for ts in fused), "the seeded row alone ran no fused step"
    assert any(ts > alone_done * 1e6 for ts in fused), "the rows together ran no fused step"
    for case, out in zip(_jme_cases(3), outs):
        assert out.finish_reason == "stop" and validate_output(out.text, case["schema"]) is None, out.text
    assert sum(o.stats.num_accepted_tokens for o in outs) > 0
    assert among.token_ids == alone.token_ids and alone.stats.num_accepted_tokens > 0


def _is_fused(event: dict[str, Any]) -> bool:
    return str(event["name"]).startswith("fused step")


def test_a_request_with_penalties_fuses_with_speculating_ones(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A request with repetition, frequency and presence penalties does not speculate, yet its
    steps fuse beside speculating ones (its token history recorded and applied on the device):
    every output, its own included, is what the engine without fused steps gives (greedy)."""
    penalties = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3)
    penalized = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, **penalties)
    requests = _requests()[:2] + [(UNGUIDED[0], penalized)]
    speculative = dict(method="draft_model", draft_model="int8", adaptive=False)
    runs = {}
    for fused in (True, False):
        monkeypatch.setenv("GUIDESPEC_TRACE", str(tmp_path / f"trace-{fused}.json"))
        with LLM(max_batch_size=8, show_progress=False, speculative=speculative, graph_grammar=fused) as llm:
            runs[fused] = _run(llm, requests)
    assert [o.token_ids for o in runs[True]] == [o.token_ids for o in runs[False]]
    assert runs[True][2].stats.num_draft_tokens == 0 and len(runs[True][2].token_ids) == 40
    events = json.loads((tmp_path / "trace-True.json").read_text())["traceEvents"]
    # steps of all three rows (the penalized one among them) ran fused
    assert any(str(e["name"]).startswith("fused step") and e["args"]["batch"] == 3 for e in events)


def test_a_closed_draft_gate_drafts_forced_tokens_alone_and_changes_no_token(
    references: dict[str, list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An n-gram engine whose draft gate starts closed (``scheduler/speculation/gate.py``: as where
    drafts cost more than they give) drafts the grammars' forced tokens alone and lets its steps
    run ahead, until a trial of drafting (after 64 steps measured: the guided requests' later
    steps): every token is plain greedy decoding's, and the unguided requests, done before any
    trial, got no drafts."""
    monkeypatch.setenv("GUIDESPEC_DRAFT_GATE", "closed")
    with LLM(max_batch_size=8, show_progress=False, speculative=DRAFTERS["ngram"]) as llm:
        outs = _run(llm, _requests())
    assert [o.token_ids for o in outs] == references["xgrammar"]
    assert [o.stats.num_draft_tokens for o in outs[3:]] == [0, 0]
    assert sum(o.stats.num_accepted_tokens for o in outs[:3]) > 0  # (forced tokens, verified as drafts)


def test_bad_speculative_options_are_refused_in_the_client() -> None:
    with pytest.raises(ValueError, match="speculative method"):
        LLM(speculative="medusa")
    with pytest.raises(ValueError, match="max_draft_len"):
        LLM(speculative={"method": "ngram", "max_draft_len": 0})
    with pytest.raises(ValueError, match="unknown speculative option"):
        LLM(speculative={"method": "ngram", "draft_len": 3})
    with pytest.raises(ModuleNotFoundError):
        LLM(speculative={"method": "user", "user_drafter": "no_such_module:Drafter"})
    with pytest.raises(ValueError, match="needs draft_model"):
        LLM(speculative={"method": "draft_model"})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(speculative={"method": "draft_model", "draft_model": "/no/such/draft"})
    with pytest.raises(ValueError, match="needs draft_model"):
        LLM(speculative={"method": "eagle"})
    with pytest.raises(FileNotFoundError, match="train-eagle"):
        LLM(speculative={"method": "eagle", "draft_model": "/no/such/head"})
    with pytest.raises(ValueError, match="max_draft_len"):
        SamplingParams(max_draft_len=-1).validate()


def test_a_drafter_that_fails_fails_its_request_alone() -> None:
    """A drafter that raises, or proposes a token id past the vocabulary, for one request: that
    request fails with a 500-class RequestError (no traceback in it); the others finish."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(
        max_batch_size=4,
        show_progress=False,
        speculative=dict(
            method="user", user_drafter="tests.scheduler.speculation.test_drafters:_Faulty", adaptive=False
        ),
    ) as llm:

        async def run() -> list[GenerationOutput | BaseException]:
            prompts = [
                {"prompt_token_ids": [1, 2, 7777]},
                {"prompt_token_ids": [1, 2, 3]},
                {"prompt_token_ids": [1, 2, 8888]},
                {"prompt_token_ids": [4, 5, 6]},
            ]
            return list(await asyncio.gather(*(llm.agenerate(p, params) for p in prompts), return_exceptions=True))

        raised, ok, past_vocabulary, ok_too = asyncio.run(run())
        assert isinstance(raised, RequestError) and raised.status == 500
        assert "drafter failed: KeyError" in str(raised) and "Traceback" not in str(raised)
        assert isinstance(past_vocabulary, RequestError) and "outside the vocabulary" in str(past_vocabulary)
        assert isinstance(ok, GenerationOutput) and isinstance(ok_too, GenerationOutput)
        assert len(ok.token_ids) == len(ok_too.token_ids) == 12
        assert llm.is_healthy


# ---- checks run on the engine of a test above, before its own (test_greedy_speculative_equals_greedy_plain)


def _requests_that_do_not_speculate_still_jump_forward(llm: LLM, references: dict[str, list[list[int]]]) -> None:
    """On an n-gram engine, requests with ``speculative=False`` get no drafter drafts, but a guided
    one still drafts its grammar's forced tokens (jump-forward is the engine's, on by default):
    the same greedy output, in fewer steps than tokens."""
    requests = [(p, dataclasses.replace(sp, speculative=False)) for p, sp in _requests()]
    outs = _run(llm, requests)
    assert [o.token_ids for o in outs] == references["xgrammar"], "speculative=False changed the output"
    guided, plain = outs[:3], outs[3:]
    assert all(o.stats.num_accepted_tokens > 0 for o in guided), "no forced tokens verified without speculation"
    assert sum(o.stats.num_steps for o in guided) < sum(len(o.token_ids) for o in guided)
    assert all(o.stats.num_draft_tokens == 0 and o.stats.num_steps == len(o.token_ids) for o in plain)


def _sampled_drafts_of_the_target_itself_are_all_accepted_with_their_q(
    llm: LLM, references: dict[str, list[list[int]]]
) -> None:
    """The target as its own draft model, sampling: each draft is drawn from q' = p' (same model,
    same grammar mask), so rejection sampling accepts practically every one — only if rank 0 keeps
    the right q' for the right drafts; with one-hot q' acceptance would be p'(draft), far lower."""
    outs = _run(llm, _requests(temperature=1.0))
    for case, out in zip(_jme_cases(3), outs):
        assert out.finish_reason == "stop" and validate_output(out.text, case["schema"]) is None, out.text
    accepted, drafted = (sum(getattr(o.stats, f) for o in outs) for f in ("num_accepted_tokens", "num_draft_tokens"))
    assert drafted > 50 and accepted > 0.95 * drafted, f"sampled self-drafts: {accepted} of {drafted} accepted"


def _sampled_guided_outputs_stay_valid_and_switches_work(llm: LLM, references: dict[str, list[list[int]]]) -> None:
    """On the n-gram engine: sampled guided outputs valid, drafts accepted; a request's
    ``speculative=False`` and ``max_draft_len=1`` switches."""
    outs = _run(llm, _requests(temperature=1.0))
    for case, out in zip(_jme_cases(3), outs):
        assert out.finish_reason == "stop", out.text
        assert validate_output(out.text, case["schema"]) is None, out.text
    assert sum(o.stats.num_accepted_tokens for o in outs) > 0
    off_params = SamplingParams(max_tokens=24, temperature=0.0, speculative=False, ignore_eos=True)
    off = llm.generate(UNGUIDED[0], off_params)[0]
    assert off.stats.num_spec_steps == 0 and off.stats.mean_accepted_tokens_per_step == 1.0
    one = llm.generate(UNGUIDED[0], SamplingParams(max_tokens=48, temperature=0.0, max_draft_len=1, ignore_eos=True))[0]
    assert one.stats.num_spec_steps > 0 and len(one.stats.accepted_histogram) <= 2
    assert one.token_ids[:24] == off.token_ids


def _the_prefill_step_verifies_drafts(llm: LLM, references: dict[str, list[list[int]]]) -> None:
    """The prompt's last step verifies drafts too: with its grammar ready (compiled by an earlier
    request), the grammar's forced opening (``{"`` and a required first property's name) comes
    out of the prefill step, not one step per token after it. (A grammar still compiling when the
    prefill starts gets its first token there, and the forced opening in the next step.) The
    drafts are the opening's own tokenization (``{"start``, ``Date``); the model may spell it
    otherwise (``{"``, ``start``: case 1 since the GGUF kernel's sums changed order, a near tie),
    and then the prefill step accepts none: at least one of the three cases must come out whole.
    (The first run on its engine: its grammars are not compiled yet.)"""
    firsts = []
    for i, (messages, params) in enumerate(_requests()[:3]):
        compiling = list(llm.stream(messages, params))
        deltas = list(llm.stream(messages, params))
        assert [t for d in compiling for t in d.token_ids] == references["xgrammar"][i], "compiled meanwhile"
        assert [t for d in deltas for t in d.token_ids] == references["xgrammar"][i], "compiled before"
        firsts.append(len(deltas[0].token_ids))
    assert max(firsts) > 2, f"no forced opening came out of a prefill step: {firsts}"


CheckOnEngine = Callable[[LLM, dict[str, list[list[int]]]], None]
# what the engines of test_greedy_speculative_equals_greedy_plain check first (one engine, not two or three)
CHECKED_ON_THE_SAME_ENGINE: dict[str, tuple[CheckOnEngine, ...]] = {
    "ngram": (_requests_that_do_not_speculate_still_jump_forward, _sampled_guided_outputs_stay_valid_and_switches_work),
    "forced": (_the_prefill_step_verifies_drafts,),  # (first: its grammars must still be compiling)
    "draft-model-self": (_sampled_drafts_of_the_target_itself_are_all_accepted_with_their_q,),
}
