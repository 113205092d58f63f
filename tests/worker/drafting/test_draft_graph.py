"""Draft steps of an EAGLE head or a draft model as one fixed-shape graph (worker/drafting/draft_graph.py),
run on the CPU the way a CUDA graph replays them: the draft channel's C trampolines publish each
draft step and wait for its mask in stream order, against a scheduler on another thread of the
real channel. The drafts equal the step-by-step path's; a missing, stale or dead scheduler's mask
forbids acceptance, reports the error, and never hangs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from guidespec import cuda_ext
from guidespec.config import ModelConfig
from guidespec.cuda_ext.channel import DONE, PEER_GONE, STALE, TIMEOUT, ChannelLayout, DraftChannel, DraftChannelError
from guidespec.model_files import load_hf_config
from guidespec.protocol import StepInputs
from guidespec.worker.drafting.draft_model import DraftRunner
from guidespec.worker.drafting.eagle import EagleRunner
from guidespec.worker.drafting.eagle_head import default_aux_layers, save_head
from guidespec.entrypoints.train_eagle import head_config
from guidespec.worker.kv_cache import KVCache
from guidespec.worker.forward_batch import ForwardBatch
from guidespec.worker.model import LlamaModel
from guidespec.worker.tp import TPInfo
from tests.conftest import make_tiny_model
from tests.worker.drafting.test_eagle import Exchange, _random_head

pytestmark = pytest.mark.skipif(cuda_ext.library() is None, reason="no C compiler: the host library is not built")
VOCAB, MAX_LEN = 300, 64
WORDS = -(-VOCAB // 32)
PROMPTS = [[5, 9, 13, 7, 3], [11, 2, 17], [4, 8, 15, 16, 23, 42]]
PRODUCED = [[40, 41], [42], [43, 44, 45]]  # this step's accepted tokens and bonus token, per row


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaModel, object, Path]:
    return make_setup(tmp_path_factory.mktemp("draft-graph"))


def make_setup(root: Path) -> tuple[Path, LlamaModel, object, Path]:
    """A tiny target (its folder, the model, its HF config) and a random EAGLE-3 head's folder."""
    folder = make_tiny_model(root / "llama", "llama")
    hf = load_hf_config(folder)
    model = LlamaModel(ModelConfig.from_hf(hf), TPInfo(), torch.float32, MAX_LEN)
    model.load(folder, hf, show_progress=False)
    trained = _random_head(model, hf, torch.arange(0, VOCAB, 2))  # a pruned vocabulary read through d2t
    save_head(root / "head", trained.state_for_checkpoint(VOCAB), head_config(trained.cfg, VOCAB, 150, (0, 1, 1), {}))
    assert default_aux_layers(model.cfg.num_layers)
    return folder, model, hf, root / "head"


def _mask(index: int, sequence: list[int]) -> np.ndarray:
    """The fake grammar: after ``sequence``, token t is allowed where (t + sum + index) % 3 == 0."""
    allowed = np.flatnonzero((np.arange(VOCAB) + sum(sequence) + index) % 3 == 0)
    row = np.zeros(WORDS, dtype=np.uint32)
    np.bitwise_or.at(row, allowed >> 5, (np.uint32(1) << (allowed & 31).astype(np.uint32)))
    return row.view(np.int32)


def _runner(setup, channel: DraftChannel | None, timeout_s: float = 10.0, peer: int = 0) -> EagleRunner:  # type: ignore[no-untyped-def]
    folder, model, hf, head = setup
    runner = EagleRunner(head, model, folder, hf, max_batch_size=4, max_model_len=MAX_LEN)
    if channel is not None:
        runner.use_graphs(channel, timeout_s, peer or os.getpid(), capture=False)
    return runner


def _draft_model(  # type: ignore[no-untyped-def]
    setup, spec: str, shared: bool, channel: DraftChannel | None, timeout_s: float = 10.0, peer: int = 0
) -> tuple[DraftRunner, KVCache]:
    """A draft model and the target's cache (one slot more than the batch: the scratch slot),
    which it shares (``shared``: the target's own layers at TP=1) or not (a cache of its own)."""
    folder, model, _, _ = setup
    kv = model.create_kv_cache(5)
    runner = DraftRunner(spec, folder, torch.float32, 4, MAX_LEN, VOCAB, (model, kv) if shared else None)
    assert runner.shared == shared
    if channel is not None:
        runner.use_graphs(channel, timeout_s, peer or os.getpid(), capture=False)
    return runner, kv


def _propose(  # type: ignore[no-untyped-def]
    runner: EagleRunner | DraftRunner,
    model: LlamaModel,
    wanted: list[int],
    masked: list[int],
    masks=None,
    kv: KVCache | None = None,
):
    """A verify step of three rows (slots 0-2): each runs its prompt and drafts, all accepted
    (``PRODUCED``: the drafts, then the bonus token); then ``wanted`` drafts are proposed, the
    first ``masked`` of each row's under its grammar."""
    kv = kv if kv is not None else model.create_kv_cache(4)
    rows = [p + d[:-1] for p, d in zip(PROMPTS, PRODUCED)]
    tokens = np.array([t for r in rows for t in r], dtype=np.int32)
    n = len(rows)
    num_logits = np.array([len(d) for d in PRODUCED], np.int32)
    batch = ForwardBatch.create(tokens, [0, 1, 2], [0, 0, 0], [len(r) for r in rows], num_logits)
    model.forward(batch, kv, capture=runner.capture)
    runner.follow(batch, model.captured)
    inputs = StepInputs(
        step=7,
        slots=np.arange(n, dtype=np.int32),
        start_positions=np.zeros(n, np.int32),
        num_new_tokens=np.array([len(r) for r in rows], np.int32),
        token_ids=tokens,
        num_logits=num_logits,
        temperature=np.zeros(n, np.float32),
        top_k=np.zeros(n, np.int32),
        top_p=np.ones(n, np.float32),
        seeds=np.full(n, -1, np.int64),
        sample_index=np.zeros(n, np.int32),
        num_prompt_tokens=np.array([len(p) for p in PROMPTS], np.int32),
        penalties=np.ones((n, 3), np.float32),
        draft_lens=np.array(wanted, np.int32),
        draft_masked=np.array(masked, np.int32),
    )
    produced = np.array([t for p in PRODUCED for t in p], np.int32)
    return runner.propose(inputs, produced, num_logits, masks)


DRAFTERS = ["eagle", "draft model, shared cache", "int8 draft model, own cache"]


def _drafter(setup, drafter: str, channel: DraftChannel | None, timeout_s: float = 10.0, peer: int = 0):  # type: ignore[no-untyped-def]
    """(runner, the target's cache for the step) of one of ``DRAFTERS``."""
    if drafter == "eagle":
        return _runner(setup, channel, timeout_s, peer), None
    spec = "layers:1" if "shared" in drafter else "int8"
    return _draft_model(setup, spec, "shared" in drafter, channel, timeout_s, peer)


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("mask_steps", ["all", "first"])
def test_graph_drafts_equal_step_by_step_drafts_under_the_grammar(setup, mask_steps: str, drafter: str) -> None:  # type: ignore[no-untyped-def]
    """Every draft step masked, or only the first (``draft_mask_steps=1``: one round trip); an
    EAGLE head (draft 0 from its follow run) or a draft model (the newest token's forward inside
    the graph, with its own cache or the target's)."""
    _, model, _, _ = setup
    wanted, masked = [3, 1, 2], ([3, 0, 2] if mask_steps == "all" else [1, 0, 1])
    logs: dict[str, list] = {"steps": [], "graph": []}
    with _channel() as channel, _scheduling(channel, logs["steps"]):
        runner, kv = _drafter(setup, drafter, None)
        step_by_step = _propose(
            runner,
            model,
            wanted,
            masked,
            Exchange(lambda j, rows, seqs: channel.exchange(7, j, rows, seqs, 10.0, os.getpid())),
            kv,
        )
    with _channel() as channel:  # (a step's exchanges happen once: a new channel for the second run)
        runner, kv = _drafter(setup, drafter, channel)
        with _scheduling(channel, logs["graph"]):
            graph = _propose(runner, model, wanted, masked, Exchange(lambda *_: pytest.fail("not the graph")), kv)
    assert runner.graphs is not None and runner.graphs.runs == 1
    assert [list(a) for a in graph] == [list(a) for a in step_by_step]
    assert graph[1].tolist() == wanted
    # the scheduler saw the same draft steps: rows 0 and 2 at draft 0 and 1, row 0 alone at 2,
    # each with its tokens past the final ones (this step's produced tokens, then its drafts)
    assert logs["graph"] == logs["steps"]
    served = [(0, [0, 2]), (1, [0, 2]), (2, [0])] if mask_steps == "all" else [(0, [0, 2])]
    assert [(index, rows) for index, rows, _ in logs["graph"]] == served
    assert logs["graph"][0][2] == [PRODUCED[0], PRODUCED[2]]
    # every masked draft is one the fake grammar allows after the tokens before it
    flat, counts = graph
    chains = np.split(flat, np.cumsum(counts)[:-1])
    for b in (0, 2):
        for j, token in enumerate(chains[b].tolist()[: masked[b]]):
            assert (token + sum(PRODUCED[b]) + sum(chains[b][:j].tolist()) + j) % 3 == 0


def test_step_by_step_drafts_ask_for_each_mask_before_the_forward_it_follows(setup) -> None:  # type: ignore[no-untyped-def]
    """Off the graph, a draft step's tokens go up to the scheduler before the head's forward
    (draft 0's before the follow run), so the mask is filled while the head runs; the mask is
    taken after it. The drafts are the one-call exchange's."""
    _, model, _, _ = setup
    events: list[tuple[str, int]] = []

    class Recorder:
        def post(self, draft_index: int, rows: np.ndarray, sequences: list[list[int]]) -> None:
            events.append(("post", draft_index))
            self.masks = np.stack([_mask(draft_index, s) for s in sequences])

        def take(self, draft_index: int) -> np.ndarray:
            events.append(("take", draft_index))
            return self.masks

    runner = _runner(setup, None)
    forward = runner.head.forward
    runner.head.forward = lambda *a: (events.append(("forward", -1)), forward(*a))[1]  # type: ignore[method-assign]
    got = _propose(runner, model, [2, 1, 2], [2, 0, 2], Recorder())
    order = [("post", 0), ("forward", -1), ("take", 0), ("post", 1), ("forward", -1), ("take", 1)]
    assert events == order
    one_call = Exchange(lambda j, rows, seqs: np.stack([_mask(j, s) for s in seqs]))
    expected = _propose(_runner(setup, None), model, [2, 1, 2], [2, 0, 2], one_call)
    assert [list(a) for a in got] == [list(a) for a in expected]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_unguided_graph_drafts_never_touch_the_channel(setup, drafter: str) -> None:  # type: ignore[no-untyped-def]
    _, model, _, _ = setup
    runner, kv = _drafter(setup, drafter, None)
    expected = _propose(runner, model, [2, 3, 1], [0] * 3, None, kv)
    with _channel() as channel:
        runner, kv = _drafter(setup, drafter, channel, timeout_s=0.05)  # no scheduler: a wait would time out
        got = _propose(runner, model, [2, 3, 1], [0] * 3, None, kv)
        assert channel.last_error()[0] == 0
    assert [list(a) for a in got] == [list(a) for a in expected]
    assert runner.graphs is not None and runner.graphs.runs == 1


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("fault", ["missing", "stale", "dead scheduler"])
def test_a_mask_that_does_not_come_right_fails_the_proposal_and_says_so(setup, fault: str, drafter: str) -> None:  # type: ignore[no-untyped-def]
    _, model, _, _ = setup
    expected = {"missing": TIMEOUT, "stale": STALE, "dead scheduler": PEER_GONE}[fault]
    log: list = []
    with _channel() as channel:
        peer, answer_step = 0, {"missing": None, "stale": 8, "dead scheduler": None}[fault]
        if fault == "dead scheduler":
            process = subprocess.Popen(["true"])
            process.wait()
            peer = process.pid  # gone: the wait ends at once, not at its 30 s deadline
        runner, kv = _drafter(setup, drafter, channel, timeout_s=30.0 if peer else 0.3, peer=peer)
        with _scheduling(channel, log, answer_step=answer_step) if not peer else contextlib.nullcontext():
            started = time.monotonic()
            with pytest.raises(DraftChannelError) as failure:
                not_called = Exchange(lambda *_: pytest.fail("not the graph"))
                _propose(runner, model, [3, 1, 2], [3, 0, 2], not_called, kv)
            assert time.monotonic() - started < 10
        assert failure.value.code == expected and failure.value.step == 7
        assert channel.last_error() == (expected, 7, 0)
    # nothing after the failed draft step was published: the scheduler saw draft 0 alone
    assert [entry[0] for entry in log] == ([] if peer else [0])


@contextlib.contextmanager
def _channel() -> Iterator[DraftChannel]:
    channel = DraftChannel.create(ChannelLayout(f"gs-graph-{uuid.uuid4().hex[:8]}", 4, 256, WORDS))
    try:
        yield channel
    finally:
        channel.close()


@contextlib.contextmanager
def _scheduling(channel: DraftChannel, log: list, answer_step: int | None = 7, step: int = 7) -> Iterator[None]:
    """A scheduler thread answering ``step``'s draft steps (as ``answer_step``; None: never) until
    rank 0's DONE, which leaving the block sends (as the worker does after a proposal)."""

    def run() -> None:
        last = -1
        while True:
            got = channel.next_drafts(step, last, 10.0, os.getpid())
            if got is None or got[0] == DONE:
                return
            index, rows, sequences = got
            log.append((index, rows.tolist(), sequences))
            if answer_step is not None:
                channel.answer(answer_step, index, np.stack([_mask(index, s) for s in sequences]))
            last = index

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        channel.done(step)
        thread.join(15)
        assert not thread.is_alive()


def test_where_draft_steps_run_as_graphs() -> None:
    """``graph_grammar``: None (the default) is on where CUDA graphs are; True or False decides,
    also on the CPU; --enforce-eager wins on CUDA; only model drafters (an EAGLE head, a draft
    model) draft in graphs. The CLI flag reaches the engine's arguments."""
    import argparse

    from guidespec.config import EngineConfig, SpeculativeConfig
    from guidespec.entrypoints.args import add_engine_args, device_from_args
    from guidespec.launch.launcher import _draft_graphs

    eagle = SpeculativeConfig(method="eagle", draft_model="head")

    def graphs(**kw: object) -> bool:
        base = dict(
            model_dir=Path("m"),
            tensor_parallel_size=1,
            dtype="float32",
            max_batch_size=4,
            max_model_len=64,
            max_num_batched_tokens=64,
            eos_token_ids=(0,),
            speculative=eagle,
        )
        return _draft_graphs(EngineConfig(**{**base, **kw}))  # type: ignore[arg-type]

    assert graphs(device="cuda") and not graphs(device="cpu")
    assert graphs(device="cpu", graph_grammar=True) and not graphs(device="cuda", graph_grammar=False)
    assert not graphs(device="cuda", enforce_eager=True) and not graphs(
        device="cuda", graph_grammar=True, enforce_eager=True
    )
    assert not graphs(device="cuda", speculative=SpeculativeConfig(method="ngram"))
    assert graphs(device="cuda", speculative=SpeculativeConfig(method="draft_model", draft_model="int8"))
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for flags, expected in (([], None), (["--graph-grammar"], True), (["--no-graph-grammar"], False)):
        assert device_from_args(parser.parse_args(flags))["graph_grammar"] is expected
