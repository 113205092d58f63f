"""Starting the engine the ways users do: the CLI, and a script without a __main__ guard."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_cli_generate_prints_output_and_figures() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "guidespec.entrypoints.cli", "generate", "--prompt", "Say hello.", "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "### prompt: Say hello." in result.stdout and "tok/s" in result.stdout


def test_main_job_guided_speculative_output_validates_and_prints_figures() -> None:
    import json

    import jsonschema

    schema_path = Path(__file__).resolve().parents[2] / "examples" / "person.schema.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "guidespec.entrypoints.cli",
            "generate",
            "--json-schema",
            str(schema_path),
            "--speculative",
            "ngram",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    output = result.stdout.split("\n")[1]  # the line after "### prompt: ..."
    jsonschema.validate(json.loads(output), json.loads(schema_path.read_text()))
    assert "accepted tokens/step=" in result.stdout and "finish=stop" in result.stdout


def test_cli_rejects_bad_parameters_with_a_message() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "guidespec.entrypoints.cli", "generate", "--top-p", "1.5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "top_p must be in (0, 1]" in result.stderr


def test_script_without_main_guard(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(
        textwrap.dedent("""
        from guidespec import LLM, SamplingParams
        llm = LLM(max_batch_size=1, show_progress=False)
        print("OUT", llm.generate("Hi", SamplingParams(max_tokens=3, temperature=0.0))[0].finish_reason)
        llm.close()
    """)
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "OUT length" in result.stdout or "OUT stop" in result.stdout


def test_sweep_validates_outputs_and_resumes(tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    command = [
        sys.executable,
        "-m",
        "guidespec.entrypoints.cli",
        "sweep",
        "--prefix",
        "JME_",
        "--limit",
        "2",
        "--temperature",
        "0",
        "--max-tokens",
        "200",
        "--results",
        str(results),
        "--speculative",
        "ngram",
    ]
    first = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    assert "valid among compiled: 2/2 = 100.0%" in first.stdout
    assert len(results.read_text().splitlines()) == 2
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)  # nothing left to run
    assert again.returncode == 0 and "valid among compiled: 2/2 = 100.0%" in again.stdout
    assert len(results.read_text().splitlines()) == 2


def test_sweep_counts_a_backends_refusal_as_a_compile_error() -> None:
    """Refusals seen in the sweep (the xgrammar backend's own, with no "compile" in them) are
    compile errors, not engine errors."""
    from guidespec.entrypoints.sweep import is_grammar_refusal

    for message in (
        "request req-56: xgrammar cannot combine 'if' of a composition with the 'if' beside it",
        "request r: no branch of this json_schema's anyOf fits the keywords beside it: no value can match",
        "request r: grammar compilation took longer than 30 s",
        "request r: llguidance cannot compile this json_schema: oneOf is not supported",
    ):
        assert is_grammar_refusal(message), message
    assert not is_grammar_refusal("the engine is dead: worker rank 0 (pid 22242) died")


def test_sweep_checks_multiple_of_on_the_decimal_digits() -> None:
    """jsonschema divides floats and calls 1283.34 not a multiple of 0.01 (a sampled llguidance
    output, Snowplow sp_32); the sweep checks multipleOf on the digits as written."""
    from guidespec.entrypoints.sweep import validate_output

    schema = {
        "type": "object",
        "properties": {"price": {"type": "number", "multipleOf": 0.01}, "n": {"type": "integer", "multipleOf": 3}},
    }
    assert validate_output('{"price": 1283.34, "n": 9}', schema) is None
    assert validate_output('{"price": 0.3, "n": 0}', schema) is None
    assert "multiple" in (validate_output('{"price": 1283.345}', schema) or "")
    assert "multiple" in (validate_output('{"n": 10}', schema) or "")
    assert validate_output('{"price": "1.5"}', schema) is not None  # other keywords still apply


_EARLY_ZYGOTE = """
import argparse, sys, time
from guidespec.entrypoints import cli
from guidespec.launch import zygote
cli._start_the_zygote(argparse.Namespace(device="cuda", distributed_executor="mp", url=None))
on_cuda = zygote._zygote
cli._start_the_zygote(argparse.Namespace(device="cpu", distributed_executor="mp", url=None))
deadline = time.monotonic() + 120
while zygote._zygote is None and time.monotonic() < deadline:  # (the start runs on a thread of its own)
    time.sleep(0.05)
started = zygote._zygote
print(on_cuda is None, started is not None and started.alive, "torch" in sys.modules)
"""


def test_a_cpu_command_starts_its_zygote_before_its_own_imports() -> None:
    """A command of an engine on the CPU starts its zygote before anything else, so that the
    zygote's imports run beside the command's own: the zygote is ready while this process has not
    imported torch. A CUDA one leaves it to the engine's config (it forks no CUDA engine by
    default)."""
    result = subprocess.run([sys.executable, "-c", _EARLY_ZYGOTE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "False"]
