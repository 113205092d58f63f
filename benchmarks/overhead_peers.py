"""The reference systems of the host-overhead benchmark: llama.cpp and Hugging Face ``generate``
on the tiny random Llama's weights, batch 1, greedy, on CPU.

    python -m benchmarks.overhead_peers [--max-tokens 256] [--threads 2]

The tiny model (``random_model.py``'s "tiny" preset: 2 layers, hidden 64) costs microseconds a
forward, so a step's time is nearly all the runtime around the model: what each system spends
per token outside its matrix products. llama.cpp (llama-cpp-python, the ``peers`` extra) runs
the same weights written as an f32 GGUF file (``write_gguf``), the tokenizer's metadata taken
from the default model's GGUF (SmolLM2, the same 49,152 tokens); transformers runs the
safetensors in fp32. Both decode exactly ``max_tokens`` tokens, EOS ignored, and report the
decode steps alone (the prompt's cost left out). ``check_same_tokens`` says whether the two
produce the same greedy tokens, and ``prompt_logits_error`` how close their logits are (the
sharper test of the GGUF file). guidespec itself is measured elsewhere (``overhead.py``); this
module only provides the figures it is held against.

Give ``--threads`` no more than the idle cores: the threads of both wait on each other, and a
step beside another job slows manyfold (2 threads on 2 shared cores: llama.cpp 10 to 60 ms a
step, where 1 thread took 2 ms).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import fmt  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def write_gguf(hf_dir: Path, out: Path) -> Path:
    """``out`` as an f32 GGUF file ("llama") of the weights in ``hf_dir`` (kept while newer than
    the safetensors), with the default model's tokenizer metadata."""
    import gguf
    from safetensors.torch import load_file

    weights = hf_dir / "model.safetensors"
    if out.exists() and out.stat().st_mtime > weights.stat().st_mtime:
        return out
    config = json.loads((hf_dir / "config.json").read_text())
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, "llama")
    _add_hyperparameters(writer, config)
    _copy_tokenizer_fields(writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for name, tensor in load_file(str(weights)).items():
        if name == "lm_head.weight":  # tied: llama.cpp reads token_embd as the output when output is absent
            continue
        gguf_name = names.get_name(name.removesuffix(".weight"))
        if gguf_name is None:
            raise ValueError(f"{name} has no GGUF name")
        array = tensor.float().numpy()
        short = gguf_name.rsplit(".", 1)[-1]
        if short in heads:  # llama.cpp's converter permutes q and k rows for its rotary layout
            array = _permute_rows(array, heads[short])
        writer.add_tensor(gguf_name + ".weight", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


def llama_cpp_ms_per_step(gguf: Path, prompt_ids: list[int], max_tokens: int, threads: int = 2) -> dict[str, Any]:
    """llama.cpp's greedy decode of ``max_tokens`` tokens after ``prompt_ids``, EOS ignored: the
    time of the steps after the prompt's (the first token comes with the prompt)."""
    llm = _llama(gguf, threads)
    _llama_greedy(llm, prompt_ids, 8)  # warm-up
    tokens, seconds = _llama_greedy(llm, prompt_ids, max_tokens)
    return _step_figures(seconds, tokens)


def hf_generate_ms_per_step(hf_dir: Path, prompt_ids: list[int], max_tokens: int, threads: int = 2) -> dict[str, Any]:
    """transformers' ``generate`` in fp32, greedy, held to ``max_tokens`` new tokens: its time
    less that of a 1-token ``generate`` (the prompt's cost)."""
    model = _hf_model(hf_dir, threads)
    _hf_greedy(model, prompt_ids, 8)  # warm-up
    _, prompt_seconds = _hf_greedy(model, prompt_ids, 1)
    tokens, seconds = _hf_greedy(model, prompt_ids, max_tokens)
    return _step_figures(seconds - prompt_seconds, tokens)


def model_alone_ms_per_step(
    hf_dir: Path, batches: list[int], context: int, threads: int, steps: int = 100
) -> dict[int, dict[str, Any]]:
    """guidespec's own model code without the engine around it, in this process, at each of
    ``batches``: the worker's forward (``LlamaModel.forward``: on the CPU the C decoder stack) and
    greedy picks (``compute_picks``: the LM head's int8 copy, checked) of that many decode rows,
    each at ``context`` positions, the kernels on ``threads`` threads as a CPU worker runs them
    (torch on one). The cache is by slot (the engine's is paged: the same attention kernel, its
    keys in blocks). Each step writes the same positions again, so every step reads ``context``
    keys; the median of ``steps``. A step of the engine beyond this is the runtime's."""
    import torch

    from benchmarks.quantized import load
    from guidespec.worker import kernels
    from guidespec.worker.forward_batch import ForwardBatch

    kernels.set_threads(threads)
    torch.set_num_threads(1)
    model = load(False, context + 8, hf_dir)
    kv = model.create_kv_cache(max(batches))
    rng = np.random.default_rng(0)
    vocab, slots = model.cfg.vocab_size, list(range(max(batches)))
    for slot in slots:  # (each row's keys: a prompt of ``context`` tokens)
        prompt = rng.integers(0, vocab, context)
        model.forward(ForwardBatch.create(prompt, [slot], [0], [context], [1]), kv)
    out: dict[int, dict[str, Any]] = {}
    for batch in batches:
        times = []
        for _ in range(steps + 5):  # (5 warm-up steps)
            tokens = rng.integers(0, vocab, batch)
            start = time.perf_counter()
            decode = ForwardBatch.create(tokens, slots[:batch], [context] * batch, [1] * batch, [1] * batch)
            hidden = model.forward(decode, kv)
            if model.compute_picks(hidden) is None:  # (no int8 head here: the logits, then their argmax)
                logits = model.compute_logits(hidden)
                assert logits is not None  # (one rank)
                logits.argmax(-1)
            times.append(time.perf_counter() - start)
        ms = 1000 * float(np.median(times[5:]))
        out[batch] = {"ms_per_step": ms, "tok_per_s": 1000 * batch / ms, "context": context, "threads": threads}
    return out


def check_same_tokens(
    hf_dir: Path, gguf: Path, prompt_ids: list[int], max_tokens: int = 32, threads: int = 2
) -> tuple[list[int], list[int]]:
    """The greedy tokens of llama.cpp on ``gguf`` and of transformers on ``hf_dir``: the same
    weights, so the same tokens, but for late divergences where random weights leave two logits
    within rounding of each other, or where EOS wins (transformers, held to its length, skips it)."""
    llama_tokens, _ = _llama_greedy(_llama(gguf, threads), prompt_ids, max_tokens)
    hf_tokens, _ = _hf_greedy(_hf_model(hf_dir, threads), prompt_ids, max_tokens)
    return llama_tokens, hf_tokens


def prompt_logits_error(hf_dir: Path, gguf: Path, prompt_ids: list[int], threads: int = 2) -> float:
    """The relative error (Frobenius norm) of llama.cpp's logits over the prompt against
    transformers': the sharper test of the GGUF file. Weights this small leave attention nearly
    uniform, so the greedy tokens follow the embeddings: q and k rows left unpermuted give the
    same 32 tokens, but an error of 6e-3 where the right file's is 2e-4 (f16 KV cache)."""
    import torch

    llm = _llama(gguf, threads, logits_all=True)
    llm.eval(prompt_ids)
    ours = llm.scores[: len(prompt_ids)]
    with torch.no_grad():
        reference = _hf_model(hf_dir, threads)(torch.tensor([prompt_ids])).logits[0].numpy()
    return float(np.linalg.norm(ours - reference) / np.linalg.norm(reference))


def main() -> None:
    from transformers import AutoTokenizer

    from benchmarks.random_model import build_random_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    hf_dir = build_random_model("tiny", Path("out/tiny-model"))
    gguf = write_gguf(hf_dir, Path("out/tiny-model.f32.gguf"))
    prompt_ids = AutoTokenizer.from_pretrained(hf_dir).encode(PROMPT)
    llama_tokens, hf_tokens = check_same_tokens(hf_dir, gguf, prompt_ids, threads=args.threads)
    agreed = next((i for i, (a, b) in enumerate(zip(llama_tokens, hf_tokens)) if a != b), len(hf_tokens))
    error = prompt_logits_error(hf_dir, gguf, prompt_ids, args.threads)
    print(f"greedy tokens agree for {agreed} of {len(hf_tokens)}; the prompt's logits within {error:.1e}")
    rows = {
        "llama.cpp (f32 GGUF)": llama_cpp_ms_per_step(gguf, prompt_ids, args.max_tokens, args.threads),
        "HF generate (fp32)": hf_generate_ms_per_step(hf_dir, prompt_ids, args.max_tokens, args.threads),
    }
    print(f"\n{args.threads} threads, batch 1, greedy\n\n| system | ms/step | tok/s | tokens |\n|---|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {fmt(r['ms_per_step'], '.3f')} | {fmt(r['tok_per_s'])} | {r['tokens']} |")


# ---------------------------------------------------------------- helpers


def _add_hyperparameters(writer: Any, config: dict[str, Any]) -> None:
    import gguf

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}  # (transformers 4 wrote rope_theta at the top)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)


def _copy_tokenizer_fields(writer: Any) -> None:
    """The default model's ``tokenizer.*`` fields (vocabulary, merges, special ids, chat template)."""
    import gguf

    from guidespec.model_files import default_model_path

    for key, field in gguf.GGUFReader(default_model_path()).fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)


def _permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Each head's rows from halves (Hugging Face's rotate_half) to interleaved pairs (llama.cpp's)."""
    n = weight.shape[0]
    return weight.reshape(heads, 2, n // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _llama(gguf: Path, threads: int, logits_all: bool = False) -> Any:
    from llama_cpp import Llama

    return Llama(
        model_path=str(gguf),
        n_ctx=2048,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=logits_all,
        verbose=False,
    )


def _llama_greedy(llm: Any, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    """``max_tokens`` greedy tokens (``generate`` never stops at EOS itself), and the seconds of
    the steps after the prompt's."""
    llm.reset()  # no prefix from the previous call: generate would reuse it
    tokens: list[int] = []
    for token in llm.generate(prompt_ids, temp=0.0, repeat_penalty=1.0):
        tokens.append(token)
        if len(tokens) == 1:
            start = time.perf_counter()
        if len(tokens) == max_tokens:
            break
    return tokens, time.perf_counter() - start


def _hf_model(hf_dir: Path, threads: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def _hf_greedy(model: Any, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    import torch

    ids = torch.tensor([prompt_ids])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=2)
    return out[0, ids.shape[1] :].tolist(), time.perf_counter() - start


def _step_figures(seconds: float, tokens: list[int]) -> dict[str, Any]:
    steps = len(tokens) - 1  # the first token comes with the prompt
    return {"ms_per_step": 1e3 * seconds / steps, "tok_per_s": steps / seconds, "tokens": len(tokens)}


if __name__ == "__main__":
    main()
