"""The whole engine, real processes, real model: equality with Hugging Face, batching,
tensor parallelism, abort, shutdown, bad input (a dying engine and its restart:
``tests/launch/test_supervisor.py``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from guidespec import LLM, SamplingParams
from guidespec.ipc import codec
from guidespec.llm import GenerationOutput, _RequestStream
from guidespec.protocol import BAD_REQUEST, GenerateRequest, RequestOutput
from tests.conftest import leftovers

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=32, temperature=0.0)
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "user", "content": "List three prime numbers."}],
    [
        {"role": "system", "content": "You answer in JSON."},
        {"role": "user", "content": "Give a person with a name and an age."},
    ],
    [{"role": "user", "content": "Explain in one sentence what a compiler does, and why it matters to programmers."}],
]


def _together(engine: LLM, requests: list[tuple[Any, SamplingParams]]) -> list[GenerationOutput]:
    """Every request's output, the requests sent together (``agenerate``)."""

    async def together() -> list[GenerationOutput]:
        return await asyncio.gather(*(engine.agenerate(prompt, params) for prompt, params in requests))

    return asyncio.run(together())


def _traced_then_plain(
    monkeypatch: pytest.MonkeyPatch, trace: Path, engine: dict[str, Any], run: Any, off: str
) -> tuple[Any, Any, list[dict[str, Any]]]:
    """``run`` on an engine that writes its step trace to ``trace``, then on one with the
    environment variable ``off`` set to 0 and no trace: both results, and the first one's
    scheduler spans."""
    monkeypatch.setenv("GUIDESPEC_TRACE", str(trace))
    with LLM(**engine) as traced:
        first = run(traced)
    monkeypatch.delenv("GUIDESPEC_TRACE")
    monkeypatch.setenv(off, "0")
    with LLM(**engine) as plain:
        second = run(plain)
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and e["pid"] == 1]
    return first, second, spans


@pytest.fixture(scope="module")
def llm() -> LLM:
    # fp32 weights: Hugging Face's, to compare outputs with (the default on the CPU keeps the GGUF's blocks)
    with LLM(max_batch_size=8, show_progress=False, dtype="float32") as engine:
        yield engine


@pytest.fixture(scope="module")
def hf(real_model_dir: Path) -> Any:
    """Hugging Face's model of the real model's folder, fp32: the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()


def hf_greedy(hf: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face's greedy outputs of ``prompts`` in one batch, left-padded (a third of the time
    of one ``generate`` each; the same tokens here), each cut after its first end-of-sequence
    token as one ``generate`` of it alone ends."""
    width = max(map(len, prompts))
    ends = hf.generation_config.eos_token_id
    ends = set(ends if isinstance(ends, list) else [ends])
    pad = next(iter(ends))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    refs = []
    for row in out[:, width:].tolist():
        end = next((i for i, token in enumerate(row) if token in ends), len(row) - 1)
        refs.append(row[: end + 1])
    return refs


def test_greedy_equals_hugging_face_generate(llm: LLM, hf: Any) -> None:
    ours = llm.generate(CHATS, GREEDY)
    refs = hf_greedy(hf, [llm.encode_prompt(chat) for chat in CHATS], GREEDY.max_tokens)
    for out, ref in zip(ours, refs):
        assert out.token_ids == ref[: len(out.token_ids)]
        assert len(out.token_ids) == len(ref) or out.finish_reason == "stop"


def test_penalties_equal_hugging_face_beside_requests_without_them(llm: LLM, hf: Any) -> None:
    """A repetition penalty over prompt and output tokens, as Hugging Face applies it; the workers
    keep token history for penalized requests only, so one shares its steps with plain ones."""
    penalized = SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3)

    async def together() -> list:
        return list(
            await asyncio.gather(
                llm.agenerate(CHATS[1], penalized), llm.agenerate(CHATS[0], GREEDY), llm.agenerate(CHATS[2], GREEDY)
            )
        )

    outs = asyncio.run(together())
    ids = torch.tensor([llm.encode_prompt(CHATS[1])])
    ref = hf.generate(ids, max_new_tokens=24, do_sample=False, repetition_penalty=1.3)[0, ids.shape[1] :].tolist()
    assert outs[0].token_ids == ref[: len(outs[0].token_ids)] and len(outs[0].token_ids) >= 8
    assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in llm.generate(CHATS[:3:2], GREEDY)]


def test_concurrent_requests_equal_each_request_alone(llm: LLM) -> None:
    prompts = [f"Count from 1 to {n}:" + " please" * n for n in range(1, 9)]
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(8)]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    with_others: list[list[int]] = [[] for _ in prompts]

    async def run_all() -> None:
        outs = await asyncio.gather(*(llm.agenerate(p, sp) for p, sp in zip(prompts, params)))
        for i, out in enumerate(outs):
            with_others[i] = out.token_ids

    asyncio.run(run_all())
    assert with_others == alone
    assert [len(t) for t in alone] == [sp.max_tokens for sp in params]


def test_streaming_gives_the_same_text_as_generate(llm: LLM) -> None:
    full = llm.generate(CHATS[1], GREEDY)[0]
    deltas = list(llm.stream(CHATS[1], GREEDY))
    assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])
    assert "".join(d.text for d in deltas) == full.text
    assert [t for d in deltas for t in d.token_ids] == full.token_ids


def test_stop_string_and_seeded_sampling(llm: LLM) -> None:
    out = llm.generate("1, 2, 3, 4, 5, 6, 7,", SamplingParams(max_tokens=40, temperature=0.0, stop=["10"]))[0]
    assert out.finish_reason == "stop" and "10" not in out.text and "9" in out.text
    sampled = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234)
    first, second = (llm.generate(CHATS[1], sampled)[0].token_ids for _ in range(2))
    assert first == second
    other = llm.generate(CHATS[1], SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=99))[0].token_ids
    assert other != first


def test_a_stop_string_is_found_by_the_client_which_aborts_the_request(llm: LLM) -> None:
    """The engine sends token ids; the client makes the text and finds stop strings
    (``output_text``): streamed or not, the output ends at the token that completes one, the
    text is cut before it and no part of it is streamed, and the engine drops the request."""
    prompt, stop = "1, 2, 3, 4, 5, 6, 7,", SamplingParams(max_tokens=40, temperature=0.0, stop=["10"])
    plain = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0))[0]
    cut = plain.text.index("10")
    whole = llm.generate(prompt, stop)[0]
    deltas = list(llm.stream(prompt, stop))
    assert whole.finish_reason == "stop" and whole.text == plain.text[:cut]
    assert "".join(d.text for d in deltas) == whole.text and deltas[-1].finish_reason == "stop"
    assert all("1" not in d.text[-1:] for d in deltas[:-1] if d.text)  # (a "1" could start "10": held back)
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    # the token that completes the stop string is the output's last
    assert whole.token_ids == plain.token_ids[: len(whole.token_ids)]
    assert "10" in llm.tokenizer.decode(whole.token_ids) and "10" not in llm.tokenizer.decode(whole.token_ids[:-1])
    assert whole.stats.num_steps == len(whole.token_ids)
    # (decoded with a tokenizer of the client's receiver thread alone: prompts are encoded meanwhile)
    assert llm._decoding_tokenizer() is not llm.tokenizer
    assert llm._decoding_tokenizer().decode(whole.token_ids) == llm.tokenizer.decode(whole.token_ids)
    deadline = time.monotonic() + 10.0
    while llm.scheduler_stats.running and time.monotonic() < deadline:  # (aborted: it leaves the engine)
        time.sleep(0.05)
    assert llm.scheduler_stats.running == 0


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
    ],
)
def test_bad_sampling_parameters_raise_in_the_client(llm: LLM, bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate("hello", SamplingParams(**bad))


def test_bad_prompts_raise_in_the_client(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", GREEDY)
    with pytest.raises(ValueError, match="model length"):
        llm.generate({"prompt_token_ids": [1] * llm.config.max_model_len}, GREEDY)
    assert llm.generate("Hi", SamplingParams(max_tokens=2))[0].finished  # the engine still serves


def test_bad_models_raise_before_any_process_starts(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(tmp_path / "gpt2"))
    with pytest.raises(ValueError, match="dtype"):
        LLM(dtype="float8")


def test_tensor_parallel_2_equals_tp_1(llm: LLM) -> None:
    """Two CPU ranks on this host: their collectives through shared memory (``ipc/collectives.py``),
    its segment removed with the engine."""
    expected = [o.token_ids for o in llm.generate(CHATS[:3], GREEDY)]
    with LLM(tensor_parallel_size=2, max_batch_size=4, show_progress=False, dtype="float32") as tp2:
        collectives = tp2._processes.collectives
        assert collectives is not None
        segment = Path(f"/dev/shm/{collectives.layout.name}")
        assert [o.token_ids for o in tp2.generate(CHATS[:3], GREEDY)] == expected
        one_by_one = [tp2.generate(chat, GREEDY)[0] for chat in CHATS[:3]]  # each after a finished one: prefix caching
        assert [o.token_ids for o in one_by_one] == expected
        assert all(o.stats.num_cached_tokens > 0 for o in one_by_one)
        assert segment.exists() and collectives._seq.min() > 100  # (each rank's collectives so far)
    assert not segment.exists()


def test_prefix_caching_maps_cached_blocks_and_changes_no_output(llm: LLM) -> None:
    """A request maps the cached full blocks its prompt starts with and computes only the rest
    (those of requests that finished, and those of requests sent together: the first computes,
    the others wait for its blocks); outputs equal an engine's that computes every prompt whole."""
    system = {"role": "system", "content": "You are a careful assistant. Answer briefly and precisely, in plain words."}
    chats = [
        [system, {"role": "user", "content": q}]
        for q in ("Name a planet.", "Name a river in Europe.", "Name a river in Europe.")
    ]
    penalized = SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3)
    cached = [llm.generate(chat, GREEDY)[0] for chat in chats] + [llm.generate(chats[1], penalized)[0]]
    colours = [[system, {"role": "user", "content": f"Name {n} colours."}] for n in range(2, 6)]
    together = llm.generate(colours, GREEDY)

    async def all_at_once(engine: LLM) -> list[GenerationOutput]:  # (without prefix caching, order is moot)
        requests = [(chat, GREEDY) for chat in chats] + [(chats[1], penalized)] + [(chat, GREEDY) for chat in colours]
        return list(await asyncio.gather(*(engine.agenerate(chat, params) for chat, params in requests)))

    with LLM(max_batch_size=8, show_progress=False, enable_prefix_caching=False, dtype="float32") as whole:
        outs = asyncio.run(all_at_once(whole))
    expected, expected_together = outs[:4], outs[4:]
    assert [o.token_ids for o in cached] == [o.token_ids for o in expected]
    assert [o.token_ids for o in together] == [o.token_ids for o in expected_together]
    block = llm.kv_block_size
    # the system turn's full blocks, at least one (its encoding ends with an assistant turn's start, not shared)
    shared = max(block, (len(llm.encode_prompt([system])) - 8) // block * block)
    assert all(o.stats.num_cached_tokens >= shared for o in cached[1:3] + together)
    # the same prompt again: every full block but one that would leave no token to compute
    assert cached[2].stats.num_cached_tokens == (len(cached[2].prompt_token_ids) - 1) // block * block
    assert cached[3].stats.num_cached_tokens == 0  # penalties: the workers' token history starts with the prompt
    assert all(o.stats.num_cached_tokens == 0 for o in expected)


def test_out_of_kv_blocks_requests_are_preempted_and_finish_as_they_would(llm: LLM) -> None:
    """A pool of two sequences' blocks for four requests that outgrow it: the latest are preempted
    (sent back to the queue, recomputed later) and every output equals the roomy engine's."""
    params = SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(CHATS[:4], params)]
    with LLM(max_batch_size=4, max_model_len=128, kv_cache_tokens=160, show_progress=False, dtype="float32") as small:
        assert small.num_kv_blocks == 10
        outs = small.generate(CHATS[:4], params)
        time.sleep(0.3)  # (the scheduler's figures come every 0.1 s)
        assert small.scheduler_stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    assert sum(o.stats.num_preemptions for o in outs) > 0


def test_rank_reading_steps_over_zeromq_tcp_equals_tp_1(llm: LLM) -> None:
    """Rank 1 reads the step broadcast as a remote host would (signed ZeroMQ over TCP)."""
    expected = [o.token_ids for o in llm.generate(CHATS[:2], GREEDY)]
    with LLM(tensor_parallel_size=2, max_batch_size=2, remote_ranks=[1], show_progress=False, dtype="float32") as mixed:
        assert [o.token_ids for o in mixed.generate(CHATS[:2], GREEDY)] == expected


def _chunks_to_workers(llm: LLM) -> int:
    """Chunks the scheduler has written into the ring its workers read (every step's inputs go
    through it): a message that reached a worker moved it."""
    ring = llm._processes.ring
    assert ring is not None  # (local workers)
    return int(ring.slot_seq.max()) + 1


def _listen(llm: LLM, request_id: str) -> _RequestStream:
    """Where the LLM routes the scheduler's replies to ``request_id``, a request sent past it (the
    way it routes those of its own requests)."""
    stream = _RequestStream(GenerationOutput(request_id, []))
    llm._streams[request_id] = stream
    return stream


def _send_raw(llm: LLM, frames: list[bytes]) -> None:
    """Frames straight onto the scheduler's client socket, in order (one ZeroMQ connection keeps it)."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(llm._processes.endpoints.client_in)
    for frame in frames:
        sock.send(frame)
    sock.close(linger=1000)
    ctx.term()


def _assert_refused(stream: _RequestStream, message: str) -> None:
    reply = stream.queue.get(timeout=30)  # type: ignore[call-arg]  # (a thread's queue: no event loop)
    assert isinstance(reply, RequestOutput) and reply.finished and reply.finish_reason == "error", reply
    assert reply.error_status == BAD_REQUEST and message in (reply.error or ""), reply
    assert not reply.new_token_ids


def test_scheduler_survives_malformed_frames(llm: LLM) -> None:
    """Frames that decode to no message are dropped where they arrive, and nothing reaches a worker:
    a refused request sent after them shows the scheduler read past them, and the ring to the
    workers has not moved."""
    marker = _listen(llm, "raw-after-garbage")
    written = _chunks_to_workers(llm)
    after = GenerateRequest("raw-after-garbage", np.array([60000], dtype=np.int64), GREEDY, time.time())
    _send_raw(llm, [b"", b"garbage", b"\x10\x00\x00\x00" + b"\xc1" * 16, codec.encode(after)])
    _assert_refused(marker, "vocabulary")
    assert _chunks_to_workers(llm) == written
    assert llm.generate("Hi", SamplingParams(max_tokens=3, temperature=0.0))[0].finished
    assert _chunks_to_workers(llm) > written  # (the measure: a request that does reach the workers moves it)


def test_abort_a_pause_past_the_step_timeout_and_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    """One engine of one slot, in turn: leaving a stream aborts its request and frees the slot; all
    the engine's processes stopped (SIGSTOP) mid-generation for longer than the step timeout, then
    resumed: the request completes with the tokens it has unpaused (the scheduler's and the
    workers' timeouts count running time, not the pause); ``close()`` leaves no process and no
    shared memory."""
    monkeypatch.setenv("GUIDESPEC_STEP_TIMEOUT_S", "3")  # 60x this engine's steps (a busy machine's can be slow)
    endless = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    engine = LLM(max_batch_size=1, show_progress=False)
    try:
        stream = engine.stream("Tell me a very long story.", endless)
        next(stream)
        stream.close()  # leaving the stream aborts the request
        start = time.monotonic()
        out = engine.generate("Hi", SamplingParams(max_tokens=4, temperature=0.0))[0]
        assert out.finished and time.monotonic() - start < 30, "the aborted request still holds the only slot"

        params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        expected = engine.generate("Tell me a long story.", params)[0].token_ids
        paused = engine.stream("Tell me a long story.", params)
        tokens = list(next(paused).token_ids)
        pids = [process.pid for process in engine._processes.processes.values()]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(4.5)  # past the step timeout
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        for delta in paused:
            tokens += delta.token_ids
        assert tokens == expected and len(tokens) == 60, "a pause past the step timeout changed the output"

        p = engine._processes
        names = [f"/dev/shm/{p.ring.layout.name}", f"/dev/shm/{p.arena.layout.name}"] + [
            e.removeprefix("ipc://") for e in vars(p.endpoints).values()
        ]
        assert leftovers(names, pids) != ([], [])
    finally:
        engine.close()
    assert leftovers(names, pids) == ([], []), "close() left processes or shared files"


def _signal_state(pid: int) -> str:
    """Each thread's blocked, ignored, caught and pending signal masks (hex, bit n-1 for signal n)."""
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            fields = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        lines.append(
            f"{task.name} {fields.get('Name', '?')}: "
            + " ".join(f"{k}={fields.get(k, '?')}" for k in ("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))
        )
    return "\n".join(lines)


def test_ctrl_c_leaves_no_process_and_no_shared_memory(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import faulthandler, json, os, signal, sys
        # a Python started by a terminal handles Ctrl-C; this one may have been spawned while another
        # thread of the test process was inside C's system(), which ignores SIGINT and SIGQUIT
        # process-wide for a moment, and then it starts with both ignored (seen in a full run:
        # SigIgn 0x1001006, so SIGINT never arrived)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from guidespec import LLM, SamplingParams
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks where it hangs, if it does
        with LLM(max_batch_size=2, show_progress=False) as llm:
            p = llm._processes
            names = [f"/dev/shm/{p.ring.layout.name}", f"/dev/shm/{p.arena.layout.name}"]
            names += [e.removeprefix("ipc://") for e in vars(p.endpoints).values()]
            print(json.dumps({"pids": [x.pid for x in p.processes.values()], "names": names}), flush=True)
            llm.generate("Tell me a long story.", SamplingParams(max_tokens=5000, ignore_eos=True))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    info = json.loads(proc.stdout.readline())
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # say where every thread of the client is stuck, and its signal state, then fail
        masks = _signal_state(proc.pid)
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(
            f"the client did not exit within 60 s of SIGINT; its signal masks:\n{masks}\nits threads:\n{err[-6000:]}"
        )
    assert "KeyboardInterrupt" in err
    time.sleep(0.5)
    assert leftovers(info["names"], info["pids"]) == ([], [])


def test_the_scheduler_refuses_what_a_client_did_not_check(llm: LLM) -> None:
    """A GenerateRequest straight onto the scheduler's socket, past the client's validation: the
    scheduler's own ``validate_request`` refuses it with a 400 naming the problem, and nothing
    reaches a worker (the ring to the workers does not move)."""
    raw = {
        "raw-vocabulary": ([60000, 1, 2], GREEDY, "vocabulary"),
        "raw-top-k": ([1, 2], SamplingParams(max_tokens=4, top_k=2**40), "top_k"),
        "raw-temperature": ([1], SamplingParams(max_tokens=4, temperature=float("inf")), "temperature"),
    }
    streams = {request_id: _listen(llm, request_id) for request_id in raw}
    written = _chunks_to_workers(llm)
    _send_raw(
        llm,
        [
            codec.encode(GenerateRequest(request_id, np.array(ids, dtype=np.int64), params, time.time()))
            for request_id, (ids, params, _) in raw.items()
        ],
    )
    for request_id, (_, _, message) in raw.items():
        _assert_refused(streams[request_id], message)
    assert _chunks_to_workers(llm) == written
    assert llm.is_healthy and llm.generate("Hi", SamplingParams(max_tokens=3, temperature=0.0))[0].finished


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"prompt_token_ids": [60000, 1, 2]}, "vocabulary"),
        ({"prompt_token_ids": [27070147699068784]}, "vocabulary"),
        ({"prompt_token_ids": [-1]}, "vocabulary"),
        ({"prompt_token_ids": [True, 2]}, "integers"),
        ({"prompt_token_ids": "12"}, "list of token ids"),
    ],
)
def test_token_ids_outside_the_vocabulary_raise_in_the_client(llm: LLM, prompt: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, GREEDY)


def test_astream_yields_the_same_tokens_as_generate(llm: LLM) -> None:
    expected = llm.generate(CHATS[2], GREEDY)[0].token_ids

    async def collect() -> list[int]:
        return [t async for delta in llm.astream(CHATS[2], GREEDY) for t in delta.token_ids]

    assert asyncio.run(collect()) == expected


def test_the_gguf_files_own_blocks_serve_guided_requests() -> None:
    """The default on the CPU (``dtype="auto"``, as ``"gguf"``): the default model's linear weights
    stay the file's Q4_1 blocks (``worker/kernels/gguf_weights.py``; their arithmetic is tested in
    ``tests/worker/test_quantized.py``); tensor parallel ranks cut them and give TP=1's output."""
    from guidespec.entrypoints.sweep import validate_output
    from guidespec.protocol import GuidedDecoding

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    params = SamplingParams(max_tokens=60, temperature=0.0, guided=GuidedDecoding(json_schema=schema))
    chat = [{"role": "user", "content": "Give a person named Ann aged 31 as JSON."}]
    with LLM(max_batch_size=2, show_progress=False) as llm:
        assert llm.config.quantized_weights and llm.config.dtype == "float32"
        out = llm.generate(chat, params)[0]
        plain = [o.token_ids for o in llm.generate(CHATS[:2], GREEDY)]
    assert out.finish_reason == "stop" and validate_output(out.text, schema) is None, out.text
    with LLM(dtype="gguf", tensor_parallel_size=2, max_batch_size=2, show_progress=False) as tp2:
        assert tp2.generate(chat, params)[0].token_ids == out.token_ids
        split = [o.token_ids for o in tp2.generate(CHATS[:2], GREEDY)]
    # the ranks' partial sums are added in another order than one rank's (logits within 1e-4: test_quantized);
    # rounded to int8 again in the next layer, where a value sits at a rounding edge, such differences grow to
    # ~1% of the logits after some tokens (two summation orders on one rank: 0.1-0.3 at the haiku's token 10,
    # whose top two are 0.24 apart), so a greedy output may part late (at token 10 of chat 1, 16 of chat 0)
    for a, b in zip(split, plain):
        assert a[:8] == b[:8]


def test_async_scheduling_equals_steps_one_after_another(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A batch whose requests end mid-step-ahead (a stop string, EOS, max_tokens 1 and 3), get
    jump-forward tokens after a sampled one (a JSON schema's keys, unverified jump-forward: no
    drafts, so every step runs ahead), end by their grammar (a choice), or sample with a seed:
    the engine that runs each step ahead of the one before's outputs gives every request the
    tokens that the engine running them one after another does, and its trace shows the steps
    overlapping."""
    from guidespec.protocol import GuidedDecoding

    person = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    requests = [
        (CHATS[0], SamplingParams(max_tokens=40, temperature=0.0)),
        ("1, 2, 3, 4, 5, 6, 7,", SamplingParams(max_tokens=40, temperature=0.0, stop=["10"])),
        (CHATS[2], SamplingParams(max_tokens=1, temperature=0.0)),
        (CHATS[4], SamplingParams(max_tokens=3, temperature=0.0)),
        (CHATS[3], SamplingParams(max_tokens=60, temperature=0.0, guided=GuidedDecoding(json_schema=person))),
        (CHATS[2], SamplingParams(max_tokens=8, temperature=0.0, guided=GuidedDecoding(choice=("two", "three")))),
        (CHATS[1], SamplingParams(max_tokens=24, temperature=0.9, seed=7)),
    ]

    def run(engine: LLM) -> list[list[int]]:
        return [out.token_ids for out in _together(engine, requests)]

    engine = dict(max_batch_size=8, show_progress=False, dtype="float32", jump_forward="unverified")
    overlapped, serial, spans = _traced_then_plain(
        monkeypatch, tmp_path / "trace.json", engine, run, "GUIDESPEC_ASYNC_SCHEDULING"
    )
    assert serial == overlapped
    sent = {e["args"]["step"]: e["ts"] + e["dur"] for e in spans if e["name"] == "schedule + write inputs"}
    emitted = {e["args"]["step"]: e["ts"] for e in spans if e["name"] == "emit"}
    assert any(sent[step + 1] < emitted[step] for step in emitted if step + 1 in sent)


def test_guided_steps_run_ahead_while_forced_drafts_are_rare(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Verified jump-forward (the default): rows whose grammars force nothing (a pattern of free
    letters) let the next step run ahead of their outputs once the engine has seen forced drafts
    to be rare, and a JSON document's names are still drafted where its grammar forces them;
    every request gets the tokens of the engine that runs its steps one after another."""
    from guidespec.protocol import GuidedDecoding

    person = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "hobby": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "hobby", "age"],
    }
    letters = GuidedDecoding(regex="[a-z ]+")
    requests = [
        (CHATS[i], SamplingParams(max_tokens=112, temperature=0.0, ignore_eos=True, guided=letters)) for i in range(3)
    ]
    named = GuidedDecoding(json_schema=person)
    requests.append((CHATS[3], SamplingParams(max_tokens=80, temperature=0.0, guided=named)))

    def run(engine: LLM) -> list[GenerationOutput]:
        return _together(engine, requests)

    engine = dict(max_batch_size=8, show_progress=False, dtype="float32")
    overlapped, in_turn, spans = _traced_then_plain(
        monkeypatch, tmp_path / "trace.json", engine, run, "GUIDESPEC_ASYNC_SCHEDULING"
    )
    assert [out.token_ids for out in in_turn] == [out.token_ids for out in overlapped]
    assert json.loads(overlapped[3].text).keys() == person["properties"].keys()
    assert overlapped[3].stats.num_draft_tokens > 0  # (its names: forced drafts)
    sent = {e["args"]["step"]: e["ts"] + e["dur"] for e in spans if e["name"] == "schedule + write inputs"}
    emitted = {e["args"]["step"]: e["ts"] for e in spans if e["name"] == "emit"}
    assert sum(sent[step + 1] < emitted[step] for step in emitted if step + 1 in sent) >= 10


def test_overlapped_decode_steps_equal_steps_one_after_another(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A worker that launches each greedy decode step before the one before's tokens reach the
    host (``GUIDESPEC_OVERLAP_STEPS=1``: CUDA's default, forced here on the CPU), those tokens
    read where they were picked: the same tokens as steps one after another, requests ending
    mid-overlap (max_tokens 1 and 5, a stop string, a long one), and a sampled request in the batch
    for some of its steps (not overlapped); the trace shows a step's forward starting before the
    step before's outputs left."""
    requests = [
        (CHATS[0], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)),
        ("1, 2, 3, 4, 5, 6, 7,", SamplingParams(max_tokens=30, temperature=0.0, stop=["10"])),
        (CHATS[2], SamplingParams(max_tokens=1, temperature=0.0)),
        (CHATS[4], SamplingParams(max_tokens=5, temperature=0.0)),
        (CHATS[1], SamplingParams(max_tokens=3, temperature=0.9, seed=7)),
    ]

    def run(engine: LLM) -> list[list[int]]:
        return [out.token_ids for out in _together(engine, requests)]

    engine = dict(max_batch_size=8, show_progress=False, dtype="float32")
    runs, trace = {}, tmp_path / "trace.json"
    for overlap in ("1", "0"):
        monkeypatch.setenv("GUIDESPEC_OVERLAP_STEPS", overlap)
        if overlap == "1":
            monkeypatch.setenv("GUIDESPEC_TRACE", str(trace))
        else:
            monkeypatch.delenv("GUIDESPEC_TRACE")
        with LLM(**engine) as llm:  # type: ignore[arg-type]
            runs[overlap] = run(llm)
    assert runs["1"] == runs["0"]
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and e["pid"] == 2]
    forward = {e["args"]["step"]: e["ts"] for e in spans if e["name"] == "forward"}
    outputs = {e["args"]["step"]: e["ts"] + e["dur"] for e in spans if e["name"] == "mask + sample"}
    assert any(forward[step + 1] < outputs[step] for step in outputs if step + 1 in forward)


def test_steady_decode_steps_go_as_step_next_and_change_no_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Steps whose rows are the step before's (or some of them), each a token on, go as a
    StepNext (``protocol.py``: every rank derives the step's inputs from the last one's): requests
    of different prompt lengths ending at different steps (the rows that end drop out), one guided (the
    bitmask flag), one seeded (its sample index), one penalized, outputs long enough to cross
    KV blocks (table updates with a StepNext), on two tensor-parallel ranks (both derive): every
    token as the engine that sends every step's inputs whole gives, and most steps as StepNext."""
    from guidespec.protocol import GuidedDecoding

    letters = GuidedDecoding(regex="[a-z ]+")
    requests = [
        (CHATS[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)),
        (CHATS[4], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, guided=letters)),
        (CHATS[1], SamplingParams(max_tokens=36, temperature=0.9, seed=11, ignore_eos=True)),
        (CHATS[2], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)),
        ("1, 2, 3,", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)),
    ]

    def run(engine: LLM) -> list[list[int]]:
        return [out.token_ids for out in _together(engine, requests)]

    engine = dict(max_batch_size=8, show_progress=False, dtype="float32", tensor_parallel_size=2)
    derived, whole, spans = _traced_then_plain(monkeypatch, tmp_path / "trace.json", engine, run, "GUIDESPEC_STEP_NEXT")
    assert whole == derived
    assert [len(tokens) for tokens in derived] == [params.max_tokens for _, params in requests]
    sent = [(e["args"]["inputs"], e["args"]["batch"]) for e in spans if e["name"] == "schedule + write inputs"]
    assert [kind for kind, _ in sent].count("StepNext") > len(sent) / 2, sent
    # a request that ended drops out of a StepNext (its ``keep``): fewer rows than the step before
    assert any(kind == "StepNext" and rows < before for (kind, rows), (_, before) in zip(sent[1:], sent)), sent
