"""The ``guidespec`` command line: ``generate``, ``serve``, ``bench``, ``sweep``, ``train-eagle``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from guidespec.entrypoints.args import add_engine_args, add_jump_forward_args, engine_from_args

if TYPE_CHECKING:
    from guidespec.llm import GenerationOutput
    from guidespec.protocol import GuidedDecoding

    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _start_the_zygote(args)
    try:
        return _COMMANDS[args.command][1](args)
    except (ValueError, FileNotFoundError) as e:
        print(f"guidespec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("guidespec: interrupted; the engine was shut down", file=sys.stderr)
        return 130


def _start_the_zygote(args: argparse.Namespace) -> None:
    """A command that starts an engine here, on the CPU, starts this process's zygote first
    (``zygote.warm_up``, a thread): its imports (torch, transformers, xgrammar: ~3 s of CPU) then
    run beside this process's own (~2.4 s), not after them (``create_engine_config`` starts it
    once it knows the device, which with ``auto`` asks torch). Where a GPU may be there (its
    device nodes: ``zygote.warm_up_before_torch``), or ranks run under Ray, or ``bench`` loads a
    server, that is left as it was."""
    device = getattr(args, "device", None)
    if device is None or getattr(args, "distributed_executor", "") == "ray" or getattr(args, "url", None):
        return
    from guidespec.launch import zygote

    zygote.warm_up_before_torch(device)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="guidespec", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for add_parser, _ in _COMMANDS.values():
        add_parser(commands)
    return parser


# ------------------------------------------------------------------ each command's flags


def _generate_parser(commands: Subparsers) -> None:
    gen = commands.add_parser("generate", help="generate text for one or more prompts and print figures")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a built-in chat prompt")
    gen.add_argument("--raw", action="store_true", help="send prompts as plain text, without the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--stream", action="store_true", help="print tokens as they arrive (first prompt only)")
    constraint = gen.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE", help="constrain the output to this JSON schema")
    constraint.add_argument("--json-object", action="store_true", help="constrain the output to a JSON object")
    constraint.add_argument("--regex", metavar="R", help="constrain the output to this regular expression")
    constraint.add_argument("--grammar", metavar="FILE", help="EBNF (xgrammar) or Lark (llguidance) grammar file")
    constraint.add_argument("--choice", nargs="+", metavar="S", help="the output is one of these strings")
    add_jump_forward_args(gen)


def _sweep_parser(commands: Subparsers) -> None:
    sweep = commands.add_parser("sweep", help="validity sweep of the JSON-schema workload")
    add_engine_args(sweep)
    sweep.add_argument("--workload", default=None, help="workload.jsonl (default: ../shared/data/jsonschemabench)")
    sweep.add_argument("--prefix", default=None, help="only cases whose id starts with this (e.g. JME_)")
    sweep.add_argument("--limit", type=int, default=None)
    sweep.add_argument("--every", type=int, default=1, metavar="N", help="every Nth case only (a spread-out sample)")
    sweep.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    sweep.add_argument("--max-tokens", type=int, default=1024)
    sweep.add_argument("--concurrency", type=int, default=16)
    sweep.add_argument("--compile-timeout", type=float, default=30.0)
    sweep.add_argument("--repetition-penalty", type=float, default=1.0)
    sweep.add_argument(
        "--results",
        default=None,
        metavar="FILE.jsonl",
        help="append each case's result here; cases already there are not run again (resume)",
    )
    sweep.add_argument("--summarize", default=None, metavar="FILE.jsonl", help="print the tables of a --results file")


def _serve_parser(commands: Subparsers) -> None:
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    serve.add_argument("--served-model-name", default=None, help="the model name clients use (default: the folder's)")
    add_jump_forward_args(serve)
    serve.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM, how long requests in flight may take to finish before the engine stops",
    )
    serve.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engines (replicas) behind the server, each a scheduler and its --tensor-parallel-size ranks; with "
        "--distributed-executor ray, a Ray Serve application on the cluster",
    )
    serve.add_argument(
        "--routing",
        default="cache_aware",
        choices=["cache_aware", "round_robin"],
        help="data-parallel replicas: send a request where its prompt's prefix and its grammar are cached "
        "(bounded by load), or to each replica in turn",
    )
    serve.add_argument(
        "--routing-balance",
        type=_balance,
        default=1.5,  # (routing.DEFAULT_BALANCE: the CLI imports no routing module before it parses)
        help="cache_aware routing's load bound: a replica takes a request while its requests in flight stay within "
        "this multiple of the mean (or one past the mean); higher keeps more requests where their prefix is "
        "cached, lower spreads them more evenly",
    )
    serve.add_argument(
        "--no-restart",
        action="store_true",
        help="exit non-zero when the engine dies (default: restart it; a crash loop exits non-zero)",
    )


def _balance(text: str) -> float:
    from guidespec.launch.routing import check_balance

    try:
        return check_balance(float(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bench_parser(commands: Subparsers) -> None:
    bench = commands.add_parser("bench", help="load generator: a concurrency sweep with a table and plots")
    add_engine_args(bench)
    bench.add_argument("--url", default=None, help="a running server (guidespec serve) instead of an in-process engine")
    bench.add_argument("--api-key", default=None)
    bench.add_argument("--served-model-name", default=None)
    bench.add_argument(
        "--configs",
        nargs="+",
        default=["unguided", "guided", "guided+spec"],
        help="unguided, guided (the case's schema), guided+spec (schema and the engine's drafter)",
    )
    bench.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    bench.add_argument("--num-prompts", type=int, default=32, help="requests per configuration and level")
    bench.add_argument("--max-tokens", type=int, default=256)
    bench.add_argument("--workload", default=None, help="workload.jsonl (default: ../shared/data/jsonschemabench)")
    bench.add_argument("--synthetic", action="store_true", help="synthetic prompts instead of the workload")
    bench.add_argument("--input-len", type=int, default=128, help="words per synthetic prompt")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--output-dir", default="out/bench", help="bench.json, bench.md and bench.png go here")


def _train_eagle_parser(commands: Subparsers) -> None:
    train = commands.add_parser(
        "train-eagle", help="train an EAGLE-3 draft head for a model on CPU, from its own generations"
    )
    train.add_argument("--model", default=None, help="the target (default: SmolLM2-135M-Instruct)")
    train.add_argument("--output", required=True, metavar="DIR", help="the head folder to write")
    train.add_argument(
        "--from-results",
        nargs="*",
        default=[],
        metavar="FILE.jsonl",
        help="the target's generations: validity-sweep result files (valid cases' text)",
    )
    train.add_argument(
        "--generate",
        type=int,
        default=0,
        metavar="N",
        help="also generate up to N outputs now (greedy, guided by the workload's schemas)",
    )
    train.add_argument(
        "--exclude-prefix", default="JME_", help="leave out cases whose id starts with this ('' for none)"
    )
    train.add_argument("--max-sequences", type=int, default=400)
    train.add_argument("--draft-vocab-size", type=int, default=8192)
    train.add_argument("--ttt-steps", type=int, default=3, help="draft steps unrolled in training")
    train.add_argument("--max-minutes", type=float, default=9.0, help="training time (the data comes before it)")
    train.add_argument(
        "--max-feature-minutes",
        type=float,
        default=5.0,
        help="the target's features of as many generations as this time allows (before training)",
    )
    train.add_argument("--lr", type=float, default=2e-3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    train.add_argument("--max-updates", type=int, default=None, help="stop after this many updates")
    train.add_argument("--prompt-window", type=int, default=96, help="prompt tokens before the output trained over")
    train.add_argument(
        "--prompt-loss-weight",
        type=float,
        default=0.0,
        help="weight of those prompt tokens in the loss (the output's: 1)",
    )


# ------------------------------------------------------------------ each command's run


def _train_eagle(args: argparse.Namespace) -> int:
    from guidespec.entrypoints.train_eagle import TrainConfig, train as train_head

    train_head(
        TrainConfig(
            Path(args.output),
            args.model,
            [Path(f) for f in args.from_results],
            args.generate,
            args.exclude_prefix or None,
            args.max_sequences,
            args.draft_vocab_size,
            args.ttt_steps,
            max_minutes=args.max_minutes,
            max_feature_minutes=args.max_feature_minutes,
            lr=args.lr,
            seed=args.seed,
            threads=args.threads,
            max_updates=args.max_updates,
            prompt_window=args.prompt_window,
            prompt_loss_weight=args.prompt_loss_weight,
        )
    )
    return 0


def _bench(args: argparse.Namespace) -> int:
    from guidespec.entrypoints.bench import run_bench

    return run_bench(args)


def _sweep(args: argparse.Namespace) -> int:
    from guidespec.entrypoints.sweep import print_saved_results, run_sweep

    return print_saved_results(Path(args.summarize)) if args.summarize else run_sweep(args)


def _serve(args: argparse.Namespace) -> int:
    from guidespec import LLM
    from guidespec.entrypoints.server import run_server
    from guidespec.entrypoints.data_parallel import EngineGroup

    name = args.served_model_name or (args.model and Path(args.model).name) or "SmolLM2-135M-Instruct"
    if args.data_parallel_size > 1 and args.distributed_executor == "ray":
        from guidespec.entrypoints.ray_serve import serve_on_ray

        return serve_on_ray(args, name)
    engine_args = dict(restart_on_failure=not args.no_restart, **engine_from_args(args))
    engine = (
        EngineGroup(
            args.data_parallel_size,
            args.model,
            routing=args.routing,
            routing_balance=args.routing_balance,
            **engine_args,
        )
        if args.data_parallel_size > 1
        else LLM(args.model, **engine_args)
    )
    with engine as llm:
        replicas = f" ({args.data_parallel_size} replicas)" if args.data_parallel_size > 1 else ""
        print(f"guidespec: serving {name} on http://{args.host}:{args.port}/v1{replicas}", file=sys.stderr, flush=True)
        code = run_server(llm, name, args.host, args.port, args.api_key, args.log_level, args.shutdown_timeout)
    if code:
        print("guidespec: the engine died in a crash loop; exiting for the supervisor", file=sys.stderr)
    return code


def _generate(args: argparse.Namespace) -> int:
    from guidespec import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        guided=_guided(args),
        repetition_penalty=args.repetition_penalty,
    )
    params.validate()
    texts = args.prompt or [_DEFAULT_JSON_PROMPT if (args.json_schema or args.json_object) else _DEFAULT_PROMPT]
    prompts = texts if args.raw else [[{"role": "user", "content": t}] for t in texts]
    start = time.perf_counter()
    with LLM(args.model, **engine_from_args(args)) as llm:
        print(
            f"engine ready in {time.perf_counter() - start:.1f} s (tensor_parallel_size={args.tensor_parallel_size}, "
            f"device={llm.config.device}, weights={_weights(llm.config)})",
            file=sys.stderr,
        )
        if args.stream:
            for delta in llm.stream(prompts[0], params):
                print(delta.text, end="", flush=True)
            print()
            return 0
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
    total = 0
    for text, out in zip(texts, outputs):
        total += len(out.token_ids)
        print(f"### prompt: {text}\n{out.text}\n")
        print(
            f"[{len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} output tokens, "
            f"finish={out.finish_reason}, ttft={out.time_to_first_token_s * 1000:.0f} ms, "
            f"decode={out.decode_tokens_per_s:.1f} tok/s{_spec_figures(out)}]\n"
        )
    print(f"total: {total} output tokens in {wall:.2f} s = {total / wall:.1f} tok/s")
    return 0


# each command: the function adding its parser, and the one running it
_COMMANDS: dict[str, tuple[Callable[[Subparsers], None], Callable[[argparse.Namespace], int]]] = {
    "generate": (_generate_parser, _generate),
    "sweep": (_sweep_parser, _sweep),
    "serve": (_serve_parser, _serve),
    "bench": (_bench_parser, _bench),
    "train-eagle": (_train_eagle_parser, _train_eagle),
}

_DEFAULT_PROMPT = "Give three short tips for writing clear Python code."
_DEFAULT_JSON_PROMPT = (
    "Ada Lovelace was born in 1815 in London. She was a mathematician and writer, known for her notes "
    "on the Analytical Engine and for the first published computer program. Give her record as JSON."
)


def _spec_figures(out: GenerationOutput) -> str:
    s = out.stats
    if not s.num_spec_steps:
        return ""
    return (
        f", speculative steps={s.num_spec_steps}/{s.num_steps}, accepted tokens/step="
        f"{s.mean_accepted_tokens_per_step:.2f}, mean draft length {s.mean_draft_length:.2f}, "
        f"steps by drafts accepted {s.accepted_histogram}"
    )


def _guided(args: argparse.Namespace) -> GuidedDecoding | None:
    from guidespec.protocol import GuidedDecoding

    if args.json_schema:
        return GuidedDecoding(json_schema=Path(args.json_schema).read_text())
    if args.json_object:
        return GuidedDecoding(json_object=True)
    if args.regex:
        return GuidedDecoding(regex=args.regex)
    if args.grammar:
        return GuidedDecoding(grammar=Path(args.grammar).read_text())
    if args.choice:
        return GuidedDecoding(choice=tuple(args.choice))
    return None


def _weights(config: Any) -> str:
    """The weights' form as the workers hold them: the GGUF file's own blocks, or the dtype."""
    from guidespec.worker.checkpoint import gguf_source

    if config.quantized_weights and config.device == "cpu" and gguf_source(config.model_dir) is not None:
        return "the GGUF file's quantized blocks"
    return str(config.dtype)


if __name__ == "__main__":
    raise SystemExit(main())
