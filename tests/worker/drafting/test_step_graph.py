"""Fused steps (worker/drafting/step_graph.py) the way CUDA runs them, on the CPU: with stand-in graphs for
``capture_graph`` (its two warm-ups and the captured run call the step's code, the captured run
recording the ops it launches; a replay calls the code again and fails where it launches
anything else, as a host value read at replay would: ``_Launches``), a fused step takes its
capture-mode branches: the target's padded forward, two graphs per key with padding-only
warm-ups, the draft graphs inside. Over three greedy verify steps, for an EAGLE head (a random
one: drafts rejected) and a draft model sharing the target's cache (the target itself: every
draft accepted), unguided and guided (verify masks and draft-step masks from a scheduler thread
through the real draft channel), it gives what the eager fused step gives (what the CPU runs,
and the engine tests check against plain greedy): the target's greedy continuation, or tokens
the fake grammar allows."""

from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from guidespec import cuda_ext
from guidespec.cuda_ext.channel import VERIFY, ChannelLayout, DraftChannel
from guidespec.protocol import StepInputs
from guidespec.worker.drafting import draft_graph, step_graph
from guidespec.worker.drafting.draft_model import DraftRunner
from guidespec.worker.drafting.eagle import EagleRunner
from guidespec.worker.drafting.step_graph import StepGraphs
from guidespec.worker.verify import verify_padded
from guidespec.worker.forward_batch import ForwardBatch
from guidespec.worker.model import LlamaModel
from tests.worker.drafting.test_draft_graph import MAX_LEN, PROMPTS, VOCAB, WORDS, _mask, _scheduling, make_setup
from tests.worker.drafting.test_eagle import Exchange
from tests.worker.drafting.test_draft_model import _greedy

pytestmark = pytest.mark.skipif(cuda_ext.library() is None, reason="no C compiler: the host library is not built")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaModel, object, Path]:
    return make_setup(tmp_path_factory.mktemp("fused"))


class _StandIn:
    """A captured graph, as the CPU can have one: a replay runs the step's code again and fails
    where that run would launch anything else than the capture did (see :class:`_Launches`):
    a host value read at replay instead of a device buffer."""

    def __init__(self, run: Callable[[], object], launches: list[tuple[object, ...]]) -> None:
        self.run, self.launches = run, launches
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        again = _Launches.of(self.run)
        for i, (captured, replayed) in enumerate(zip(self.launches, again)):
            assert captured == replayed, f"launch {i} differs from the capture's:\n  {captured}\n  {replayed}"
        assert len(again) == len(self.launches), f"{len(again)} launches, the capture had {len(self.launches)}"


def _capture(device: torch.device, pool: Any, run: Callable[[], object]) -> _StandIn:
    for _ in range(2):  # two warm-ups, then the captured run, as capture_graph does (on padding)
        run()
    return _StandIn(run, _Launches.of(run))


class _Launches(TorchDispatchMode):
    """The ops a run of the step's code launches, as a CUDA graph keeps them: each op with its
    host arguments (Python numbers, shapes, dtypes: fixed in the kernel at capture) and its
    tensors' addresses (a replay reads and writes the same memory: a device buffer the step
    writes before the replay is seen, a host value the code turned into a tensor or a number is
    the capture's). A tensor made by the run itself is named by the op that made it (a graph
    allocates it once, from its pool; run again here it lands elsewhere). A device value read on
    the host (``.item()``) fails at once: CUDA refuses the synchronisation inside a capture.
    (The CPU kernels' C calls are not ops: what they take besides tensors goes unchecked.)"""

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[tuple[object, ...]] = []
        self.made: dict[int, int] = {}  # storage address -> the launch that made it
        self.kept: list[torch.Tensor] = []  # (alive to the end of the run: no address reused in it)

    @classmethod
    def of(cls, run: Callable[[], object]) -> list[tuple[object, ...]]:
        with cls() as mode:
            run()
        return mode.launches

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default):
            raise AssertionError(f"{func}: a device value read on the host inside a captured graph")
        out = func(*args, **(kwargs or {}))
        inputs = tree_flatten((args, kwargs or {}))[0]
        read = {a.untyped_storage().data_ptr() for a in inputs if isinstance(a, torch.Tensor)}
        if func is torch.ops.aten.lift_fresh.default:  # host data made a tensor: its values, as captured
            self.launches.append((str(func), args[0].dtype, tuple(args[0].shape), args[0].tolist()))
            read = set()
        else:
            self.launches.append((str(func), *(self._describe(a) for a in inputs)))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in read:
                self.made.setdefault(t.untyped_storage().data_ptr(), len(self.launches) - 1)
                self.kept.append(t)
        return out

    def _describe(self, value: object) -> object:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage().data_ptr()
            where = ("made by", self.made[storage]) if storage in self.made else ("at", storage)
            return (*where, value.storage_offset(), tuple(value.shape), value.stride(), value.dtype)
        if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout)):
            return repr(value)
        if isinstance(value, torch.Generator):  # (a new Python object at each op: named by its seed)
            return f"generator {value.device} seeded {value.initial_seed()}"
        return f"{type(value).__name__} {id(value):x}"


GUIDED = [0, 2]  # the guided rows (the others unguided), where a test guides
VERIFY_INDEX = 50  # the fake grammar's index for the verify masks (draft steps': 0, 1, ...)


SAMPLED = 1  # the row that samples (at temperature 1), where a test samples
SEED = 1234  # its seed, where a test seeds it


def _inputs(
    step: int,
    rows: list[list[int]],
    starts: list[int],
    logits: list[int],
    k: int,
    guided: bool,
    sampled: bool | str = False,
    produced: list[int] | None = None,
) -> StepInputs:
    """``sampled``: row SAMPLED samples, seeded with SEED where it is "seeded"; ``produced``:
    each row's output tokens so far (the seeded draws' output indices)."""
    n = len(rows)
    seeds = np.full(n, -1, np.int64)
    if sampled == "seeded":
        seeds[SAMPLED] = SEED
    masked = np.zeros(n, np.int32)
    if guided:
        masked[GUIDED] = k
    return StepInputs(
        step=step,
        slots=np.arange(n, dtype=np.int32),
        start_positions=np.array(starts, np.int32),
        num_new_tokens=np.array([len(r) for r in rows], np.int32),
        token_ids=np.array([t for r in rows for t in r], np.int32),
        num_logits=np.array(logits, np.int32),
        temperature=np.array([float(sampled and b == SAMPLED) for b in range(n)], np.float32),
        top_k=np.zeros(n, np.int32),
        top_p=np.ones(n, np.float32),
        seeds=seeds,
        sample_index=np.array(produced or [0] * n, np.int32),
        num_prompt_tokens=np.array([len(p) for p in PROMPTS], np.int32),
        penalties=np.tile(np.array([1.0, 0.0, 0.0], np.float32), (n, 1)),  # (none)
        draft_lens=np.full(n, k, np.int32),
        has_bitmask=guided,
        draft_masked=masked,
    )


def _fused_steps(  # type: ignore[no-untyped-def]
    setup, drafter: str, captured: bool, guided: bool, sampled: bool | str = False
) -> tuple[list[list[int]], list[Any]]:
    """The prompts' prefill (and first proposals), then three fused steps: each row's produced
    tokens, and each step's (tokens, counts, proposals). ``guided``: rows 0 and 2 under the fake
    grammar, their verify masks and draft-step masks served by a scheduler thread."""
    folder, model, hf, head = setup
    kv = model.create_kv_cache(5)  # (4 rows and the scratch slot)
    channel = DraftChannel.create(ChannelLayout(f"gs-fused-{uuid.uuid4().hex[:8]}", 16, 512, WORDS))
    try:
        runner: EagleRunner | DraftRunner
        if drafter == "eagle":
            runner = EagleRunner(head, model, folder, hf, max_batch_size=4, max_model_len=MAX_LEN)
        else:
            runner = DraftRunner("self", folder, torch.float32, 4, MAX_LEN, VOCAB, (model, kv))
        runner.use_graphs(channel, 10.0, os.getpid(), capture=False)
        assert runner.graphs is not None
        runner.graphs.capture = captured  # (CUDA's branches, with stand-in graphs)
        runner.sampling.greedy = True  # (as the worker sets it where steps fuse)
        fused = StepGraphs(runner, model, kv, max_logits_rows=16, verify_timeout_s=10.0)
        batch = ForwardBatch.create(
            np.array([t for p in PROMPTS for t in p]), [0, 1, 2], [0, 0, 0], [len(p) for p in PROMPTS], [1, 1, 1]
        )
        logits = model.compute_logits(model.forward(batch, kv, runner.capture))
        assert logits is not None
        runner.follow(batch, model.captured)
        newest = logits.argmax(dim=-1).numpy().astype(np.int32)
        prefill = _inputs(1, PROMPTS, [0, 0, 0], [1, 1, 1], 3, guided, sampled)
        served: list = []  # the draft steps the scheduler thread served: (index, rows, sequences)
        with _scheduling(channel, served, answer_step=1, step=1):
            flat, counts = runner.propose(prefill, newest, np.ones(3, np.int32), Exchange(_not_called))
        drafts = np.split(flat, np.cumsum(counts)[:-1])
        produced = [[int(t)] for t in newest]
        starts = [len(p) for p in PROMPTS]
        history = []
        for step in range(2, 5):
            rows = [[produced[b][-1], *drafts[b].tolist()] for b in range(3)]
            inputs = _inputs(step, rows, starts, [len(r) for r in rows], 3, guided, sampled, [len(p) for p in produced])
            assert fused.fits(inputs)
            if guided:  # the scheduler's verify masks (sent while the target runs), logits row by row
                ids = [4 * b + j for b in GUIDED for j in range(4)]
                masks = [_mask(VERIFY_INDEX, produced[b] + rows[b][1 : 1 + j]) for b in GUIDED for j in range(4)]
                assert channel.answer_verify(step, np.array(ids), np.stack(masks))
            with _scheduling(channel, served, answer_step=step, step=step):  # (leaving it: DONE, as the worker sends)
                out = fused.run(inputs)
            assert out.proposals is not None
            # the trampolines timed their waits: the verify masks', then each masked draft step's
            assert out.mask_waits[:, 0].tolist() == ([VERIFY, 0, 1, 2] if guided else [])
            assert (out.mask_waits[:, 1] <= out.mask_waits[:, 2]).all()
            history.append((out.tokens.tolist(), out.counts.tolist(), [a.tolist() for a in out.proposals]))
            tokens = np.split(out.tokens, np.cumsum(out.counts)[:-1])
            for b in range(3):
                produced[b] += tokens[b].tolist()
                starts[b] += int(out.counts[b])
            drafts = np.split(out.proposals[0], np.cumsum(out.proposals[1])[:-1])
        # only the guided rows' draft steps asked for masks, each of them (4 proposals of 3 drafts)
        assert [(index, rows) for index, rows, _ in served] == ([(j, GUIDED) for j in range(3)] * 4 if guided else [])
        graphs = list(fused.graphs.values())
        if captured:  # every key captured (two graphs each) and replayed
            assert graphs and all(g.graph.replays > 0 and g.draft_graph.replays > 0 for g in graphs)
        else:
            assert graphs and all(g.graph is None for g in graphs)
        return produced, history
    finally:
        channel.close()


def _not_called(*_: object) -> np.ndarray:
    raise AssertionError("the graphs exchange masks through the channel's trampolines, not this")


@pytest.mark.parametrize("guided", [False, True], ids=["unguided", "guided"])
@pytest.mark.parametrize("drafter", ["eagle", "draft model"])
def test_captured_fused_steps_equal_eager_ones_and_plain_greedy(setup, drafter: str, guided: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Guided: the capture's padding-only runs wait for no mask; every token a guided row produced
    in a fused step is one its verify mask allowed; the unguided rows stay plain greedy."""
    _, model, _, _ = setup
    eager = _fused_steps(setup, drafter, captured=False, guided=guided)
    monkeypatch.setattr(step_graph, "capture_graph", _capture)
    monkeypatch.setattr(draft_graph, "capture_graph", _capture)
    captured = _fused_steps(setup, drafter, captured=True, guided=guided)
    assert captured == eager
    produced, history = captured
    for b, (prompt, tokens) in enumerate(zip(PROMPTS, produced)):
        if guided and b in GUIDED:
            for i in range(1, len(tokens)):  # (the first came from the prefill, unmasked here)
                assert (tokens[i] + sum(tokens[:i]) + VERIFY_INDEX) % 3 == 0
        else:
            assert tokens == _greedy(model, prompt, len(tokens))
    if guided:
        return
    # the target drafting for itself: every draft accepted; a random head: few (rejections tested)
    assert all(counts == [4, 4, 4] for _, counts, _ in history) == (drafter == "draft model")


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_a_sampled_row_beside_greedy_ones_fuses(setup, captured: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An unseeded sampled row in the fused steps (its drafts the drafter's argmax, verified by
    rejection sampling on the device): the greedy rows beside it stay the target's greedy
    continuation, and it produces tokens of the vocabulary, eagerly and captured."""
    _, model, _, _ = setup
    if captured:
        monkeypatch.setattr(step_graph, "capture_graph", _capture)
        monkeypatch.setattr(draft_graph, "capture_graph", _capture)
    produced, _ = _fused_steps(setup, "draft model", captured, guided=False, sampled=True)
    for b, (prompt, tokens) in enumerate(zip(PROMPTS, produced)):
        if b != SAMPLED:
            assert tokens == _greedy(model, prompt, len(tokens))
    assert len(produced[SAMPLED]) >= 4 and all(0 <= t < VOCAB for t in produced[SAMPLED])


@pytest.mark.parametrize("drafter", ["eagle", "draft model"])
def test_a_seeded_row_draws_alike_eager_and_captured(setup, drafter: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A seeded sampled row's numbers come from its seed (copied into the graph's inputs), so
    the captured steps give what the eager ones give, token for token, guided and not."""
    eager = [_fused_steps(setup, drafter, False, guided, sampled="seeded") for guided in (False, True)]
    monkeypatch.setattr(step_graph, "capture_graph", _capture)
    monkeypatch.setattr(draft_graph, "capture_graph", _capture)
    captured = [_fused_steps(setup, drafter, True, guided, sampled="seeded") for guided in (False, True)]
    assert captured == eager
    assert len(eager[0][0][SAMPLED]) >= 4


def test_the_stand_in_fails_a_host_value_read_at_replay() -> None:
    """What a replay of a real graph would not see, the stand-in refuses: a Python number or a
    host array the code reads again, a device value read on the host; what the step writes into
    a device buffer before the replay is seen."""
    x, out, device_scale = torch.arange(3.0), torch.zeros(3), torch.ones(1)
    host: dict[str, Any] = {"scale": 1.0, "array": np.ones(3, np.float32)}
    for reads_the_host in (
        lambda: out.copy_(x * host["scale"]),
        lambda: out.copy_(x * torch.from_numpy(host["array"])),
    ):
        graph = _capture(torch.device("cpu"), None, reads_the_host)
        host["scale"], host["array"] = 2.0, np.full(3, 2.0, np.float32)
        with pytest.raises(AssertionError, match="differs from the capture's"):
            graph.replay()
        host["scale"], host["array"] = 1.0, np.ones(3, np.float32)
        graph.replay()  # (the capture's values again: the same launches)
    with pytest.raises(AssertionError, match="read on the host inside a captured graph"):
        _capture(torch.device("cpu"), None, lambda: out.fill_(float(device_scale)))
    graph = _capture(torch.device("cpu"), None, lambda: torch.mul(x, device_scale, out=out))
    device_scale.fill_(2.0)
    graph.replay()
    assert out.tolist() == [0.0, 2.0, 4.0]


def test_a_fused_step_reading_its_draft_counts_from_the_host_is_caught(setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The classic graph bug, made on purpose: acceptance reads each row's draft count from the
    host (the step's inputs) instead of the device buffer the step writes. Eagerly nothing
    changes; a real graph would keep the capture's counts (padding: 0) at every replay, and the
    stand-in fails at the first replay (a stand-in that only ran the code again did not)."""
    expected = _fused_steps(setup, "draft model", captured=False, guided=False)
    known: dict[str, np.ndarray] = {}
    write, write_padding = StepGraphs._write, StepGraphs._write_padding

    def write_known(self: StepGraphs, graph: Any, inputs: StepInputs, *rest: Any) -> None:
        known["draft_count"] = np.zeros(graph.key.verify.batch, np.int64)
        known["draft_count"][: inputs.batch_size] = inputs.num_logits - 1
        write(self, graph, inputs, *rest)

    def write_padding_known(self: StepGraphs, graph: Any) -> None:
        known["draft_count"] = np.zeros(graph.key.verify.batch, np.int64)
        write_padding(self, graph)

    def verify_reading_the_host(logits: torch.Tensor, drafts: torch.Tensor, _: torch.Tensor, sampling: Any) -> Any:
        return verify_padded(logits, drafts, torch.from_numpy(known["draft_count"]), sampling)

    monkeypatch.setattr(StepGraphs, "_write", write_known)
    monkeypatch.setattr(StepGraphs, "_write_padding", write_padding_known)
    monkeypatch.setattr(step_graph, "verify_padded", verify_reading_the_host)
    assert _fused_steps(setup, "draft model", captured=False, guided=False) == expected
    monkeypatch.setattr(step_graph, "capture_graph", _capture)
    monkeypatch.setattr(draft_graph, "capture_graph", _capture)
    with pytest.raises(AssertionError, match="differs from the capture's"):
        _fused_steps(setup, "draft model", captured=True, guided=False)


def test_which_steps_fuse() -> None:
    """Verify steps fuse, greedy or sampled (seeded or not), penalties or not; a prefill chunk
    (logits for its last token only) or a row at position 0 keeps the step unfused; the key says
    which rows sample or ask for penalties."""
    rows = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14]]
    base = _inputs(3, rows, [6, 4, 7], [4, 4, 2], 3, guided=False)
    fits = lambda inputs: step_graph.fusable(inputs, 4, 16, MAX_LEN)  # noqa: E731
    assert fits(base)
    key = step_graph.step_key(base, 4, MAX_LEN)
    assert not key.sampled and not key.penalized and key.verify.tokens_per_row == 4 and key.drafts.drafts == 3
    sampled = dataclasses.replace(base, temperature=np.array([0.0, 0.7, 0.0], np.float32))
    assert fits(sampled) and step_graph.step_key(sampled, 4, MAX_LEN).sampled
    seeded = dataclasses.replace(sampled, seeds=np.array([-1, 3, -1], np.int64))
    assert fits(seeded) and step_graph.step_key(seeded, 4, MAX_LEN).sampled
    penalties = base.penalties.copy()
    penalties[2] = [1.2, 0.0, 0.0]
    penalized = dataclasses.replace(base, penalties=penalties)
    assert fits(penalized) and step_graph.step_key(penalized, 4, MAX_LEN).penalized
    assert not fits(dataclasses.replace(base, num_logits=np.array([4, 1, 2], np.int32)))  # a prefill chunk
    assert not fits(dataclasses.replace(base, start_positions=np.array([6, 0, 7], np.int32)))


@pytest.mark.parametrize("drafter", ["eagle", "draft model"])
def test_draft_step_0_is_published_before_the_drafter_follows(setup, drafter: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A guided fused step sends the scheduler its produced tokens (draft step 0's publish) as
    soon as acceptance has them, so mask 0 is filled while the drafter follows the step: in
    stream order, the verify masks' wait, draft 0's publish, the follow run, draft 0's wait."""
    from guidespec.cuda_ext.host_functions import HostFunctions

    order: list[str] = []
    enqueue = HostFunctions.enqueue
    runner_class = EagleRunner if drafter == "eagle" else DraftRunner
    follow = runner_class.follow_padded

    def enqueued(self: HostFunctions, name: str, args: Any) -> None:
        order.append(name.removeprefix("gs_cb_"))
        enqueue(self, name, args)

    def followed(self: Any, *args: Any) -> Any:
        order.append("follow")
        return follow(self, *args)

    monkeypatch.setattr(HostFunctions, "enqueue", enqueued)
    monkeypatch.setattr(runner_class, "follow_padded", followed)
    produced, _ = _fused_steps(setup, drafter, captured=False, guided=True)
    steps = " ".join(order).split("verify_wait")[1:]  # each fused step, from its verify wait on
    assert len(steps) == 3
    for step in steps:
        assert step.split() == ["graph_publish", "follow", "graph_wait"] + ["graph_publish", "graph_wait"] * 2
    for b in GUIDED:
        assert all((produced[b][i] + sum(produced[b][:i]) + VERIFY_INDEX) % 3 == 0 for i in range(1, len(produced[b])))
