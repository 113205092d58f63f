"""``guidespec train-eagle``: an EAGLE-3 head for a target model, trained on CPU from the
target's own generations.

1. **Generations.** The target's outputs for the workload's prompts: read from validity-sweep
   result files (``--from-results``; the text of every valid case) and/or generated now with the
   engine (``--generate N``, greedy, guided by each case's schema). Cases whose id starts with
   ``--exclude-prefix`` (default ``JME_``: the speculative benchmark's cases) are left out.
2. **Draft vocabulary.** The ``--draft-vocab-size`` most frequent tokens of the outputs (EOS
   included): the head's LM head has only those rows, and ``d2t`` maps them to target ids.
3. **Features.** The target (our own decoder, fp32) runs each prompt + output once; the inputs of
   layers (2, L/2, L-3) at every position of the output and of a window of prompt before it
   are kept.
4. **Training.** The head learns to predict token ``t+2`` from the features at ``t`` and token
   ``t+1`` (cross-entropy over the draft vocabulary), unrolled over ``--ttt-steps`` draft steps
   as EAGLE-3's training-time test: step ``k`` reads the head's own hidden output of step ``k-1``
   and attends, as at inference, to the true entries before it and to its own chain. AdamW,
   cosine schedule, stopped at ``--max-minutes``.
5. The head is saved as an EAGLE-3 folder (``config.json`` + ``model.safetensors``) that
   ``speculative={"method": "eagle", "draft_model": FOLDER}`` loads (``eagle.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from guidespec.config import ModelConfig
from guidespec.worker.drafting.eagle_head import default_aux_layers, save_head
from guidespec.worker.model import rotary_tables


@dataclass
class TrainConfig:
    output: Path
    model: str | None = None
    from_results: list[Path] = field(default_factory=list)
    generate: int = 0
    exclude_prefix: str | None = "JME_"
    max_sequences: int = 400
    draft_vocab_size: int = 8192
    ttt_steps: int = 3
    prompt_window: int = 96  # prompt tokens before the output the head trains over
    max_output_tokens: int = 320
    max_minutes: float = 9.0
    max_feature_minutes: float = 5.0  # the target's features of as many sequences as this allows
    max_updates: int | None = None  # stop after this many updates (the schedule follows whichever ends first)
    prompt_loss_weight: float = 0.0  # weight of the prompt window's tokens in the loss (outputs: 1)
    lr: float = 2e-3
    seed: int = 0
    workload: Path | None = None
    num_heads: int | None = None  # the head's attention and MLP shape (default: the target's layer)
    num_kv_heads: int | None = None
    intermediate_size: int | None = None
    threads: int | None = None  # torch threads (default: every core; 1 beside other busy processes)


@dataclass
class Sequence:
    token_ids: list[int]
    output_start: int  # index of the first output token


# ---------------------------------------------------------------------- generations


def load_generations(cfg: TrainConfig, tokenizer: Any, model_dir: Path, eos: int, log: Any = print) -> list[Sequence]:
    from guidespec.entrypoints.sweep import default_workload, load_workload

    workload = load_workload(cfg.workload or default_workload())
    by_id = {case["id"]: case for case in workload}
    wanted = [c for c in workload if not (cfg.exclude_prefix and c["id"].startswith(cfg.exclude_prefix))]
    texts: dict[str, str] = {}
    for path in cfg.from_results:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            if row.get("status") == "valid" and row.get("text") and row["case_id"] in by_id:
                if not (cfg.exclude_prefix and row["case_id"].startswith(cfg.exclude_prefix)):
                    texts.setdefault(row["case_id"], row["text"])
    log(f"train-eagle: {len(texts)} generations read from {len(cfg.from_results)} result file(s)")
    todo = [c for c in wanted if c["id"] not in texts][: cfg.generate]
    if todo:
        texts.update(_generate(todo, model_dir, log))
    sequences = []
    for case_id, text in texts.items():
        prompt = _encode_chat(tokenizer, by_id[case_id]["messages"])
        output = list(tokenizer.encode(text, add_special_tokens=False))[: cfg.max_output_tokens] + [eos]
        sequences.append(Sequence(prompt + output, len(prompt)))
    random.Random(cfg.seed).shuffle(sequences)
    return sequences[: cfg.max_sequences]


def _encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _generate(cases: list[dict[str, Any]], model_dir: Path, log: Any) -> dict[str, str]:
    """The target's greedy guided outputs for ``cases``, through the validity sweep's runner; the
    valid ones are kept, as from ``--from-results``."""
    import asyncio

    from tqdm import tqdm

    from guidespec import LLM
    from guidespec.entrypoints.sweep import run_cases

    log(f"train-eagle: generating {len(cases)} outputs with the target (greedy, guided by each case's schema)")
    with (
        LLM(str(model_dir), max_batch_size=16, show_progress=False) as llm,
        tqdm(total=len(cases), desc="train-eagle: generating", unit="case") as bar,
    ):
        results = asyncio.run(run_cases(llm, cases, "xgrammar", 0.0, 384, 16, progress=bar))
    return {r.case_id: r.text for r in results if r.status == "valid"}


# ---------------------------------------------------------------------- features


def draft_vocabulary(sequences: list[Sequence], size: int, vocab_size: int, eos: int) -> torch.Tensor:
    """The ``size`` most frequent output tokens (EOS first), ascending target ids."""
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(seq.token_ids[seq.output_start :])
    chosen = {eos}
    for token, _ in counts.most_common():
        if len(chosen) >= size:
            break
        chosen.add(token)
    for token in range(vocab_size):  # fill up with the lowest ids (bytes, punctuation) if outputs are few
        if len(chosen) >= size:
            break
        chosen.add(token)
    return torch.tensor(sorted(chosen), dtype=torch.long)


@torch.inference_mode()
def target_features(
    model_dir: Path,
    sequences: list[Sequence],
    aux_layers: tuple[int, ...],
    window: int,
    log: Any = print,
    budget_s: float | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """Per sequence: (features [N, 3H] bf16, tokens [N], first absolute position, output start in
    the window) over the window (the prompt's last ``window`` tokens and the output). With
    ``budget_s``, the sequences (in their shuffled order) whose features fit in that time: a
    prompt of thousands of tokens costs seconds on a 2-core CPU."""
    from tqdm import tqdm

    from guidespec.model_files import load_hf_config
    from guidespec.worker.model import ForwardBatch, LlamaModel
    from guidespec.worker.tp import TPInfo

    hf_config = load_hf_config(model_dir)
    cfg = ModelConfig.from_hf(hf_config)
    max_len = max(len(s.token_ids) for s in sequences)
    model = LlamaModel(cfg, TPInfo(), torch.float32, max_len)
    model.load(model_dir, hf_config, show_progress=False)
    kv = model.create_kv_cache(1)
    out: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []
    start = time.perf_counter()
    for seq in tqdm(sequences, desc="train-eagle: target features", unit="seq"):
        if budget_s is not None and time.perf_counter() - start > budget_s and len(out) >= 2:
            log(
                f"train-eagle: the features' {budget_s / 60:.1f} minutes are spent: {len(out)} of "
                f"{len(sequences)} sequences"
            )
            break
        n = len(seq.token_ids)
        batch = ForwardBatch.create(seq.token_ids, [0], [0], [n], [0])
        model.forward(batch, kv, capture=aux_layers)
        assert model.captured is not None
        first = max(0, seq.output_start - window)
        out.append(
            (
                model.captured[first:].to(torch.bfloat16).clone(),
                torch.tensor(seq.token_ids[first:]),
                first,
                seq.output_start - first,
            )
        )
    return out


# ---------------------------------------------------------------------- the head being trained


class TrainableHead(nn.Module):
    """EAGLE-3's head as ``eagle_head.EagleHead`` runs it, with autograd and the training-time test."""

    embed: torch.Tensor
    draft_ids: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self, cfg: ModelConfig, hf_config: Any, embed: torch.Tensor, draft_ids: torch.Tensor, num_aux: int, max_len: int
    ) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.fc = nn.Linear(num_aux * h, h, bias=False)
        self.q_proj = nn.Linear(2 * h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.input_norm = nn.Parameter(torch.ones(h))
        self.post_norm = nn.Parameter(torch.ones(h))
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Parameter(embed[draft_ids].clone())  # the target's rows of the draft vocabulary
        with torch.no_grad():
            for lin in (
                self.q_proj,
                self.k_proj,
                self.v_proj,
                self.o_proj,
                self.gate_proj,
                self.up_proj,
                self.down_proj,
            ):
                lin.weight.normal_(0, 0.02)
            # start fc as the mean of the layers' features, so step 1 begins near the target's own state
            self.fc.weight.copy_(torch.cat([torch.eye(h) / num_aux] * num_aux, dim=1))
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("draft_ids", draft_ids, persistent=False)
        cos, sin = rotary_tables(hf_config, max_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, w.shape, w, self.cfg.rms_norm_eps)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def unroll(
        self, features: torch.Tensor, tokens: torch.Tensor, first_position: int, steps: int
    ) -> list[torch.Tensor]:
        """The head's hidden output at every index for draft steps 1..``steps`` ([n-1, hidden] each).

        Index ``t`` reads feature ``t`` and token ``t+1`` at step 1, its own step ``k-1`` output and
        token ``t+k`` at step ``k`` (position ``t+k-1``); it attends to the step-1 entries up to
        ``t`` and to its own chain's entries, as the inference KV cache holds them.
        """
        c, n = self.cfg, tokens.shape[0]
        t = n - 1
        g, d = c.num_heads // c.num_kv_heads, c.head_dim
        hidden = self.fc(features[:t].float())
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        index = torch.arange(t)
        outputs = []
        for k in range(1, steps + 1):
            ids = tokens[(index + k).clamp(max=n - 1)]  # past the end: padding, never in the loss
            x = torch.cat(
                [self._rms(F.embedding(ids, self.embed), self.input_norm), self._rms(hidden, self.hidden_norm)], -1
            )
            positions = first_position + index + k - 1
            q = self._rope(self.q_proj(x).view(t, c.num_heads, d), positions)
            keys.append(self._rope(self.k_proj(x).view(t, c.num_kv_heads, d), positions).repeat_interleave(g, dim=1))
            values.append(self.v_proj(x).view(t, c.num_kv_heads, d).repeat_interleave(g, dim=1))
            if k == 1:
                attn = F.scaled_dot_product_attention(
                    q.transpose(0, 1), keys[0].transpose(0, 1), values[0].transpose(0, 1), is_causal=True
                ).transpose(0, 1)
            else:
                main = torch.einsum("thd,shd->hts", q, keys[0]) * d**-0.5
                main = main.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
                diag = torch.stack([(q * kj).sum(-1) for kj in keys[1:]], dim=-1).transpose(0, 1) * d**-0.5
                probs = torch.cat([main, diag], dim=-1).softmax(-1)  # [heads, t, t + k - 1]
                attn = torch.einsum("hts,shd->thd", probs[..., :t], values[0])
                attn = attn + torch.einsum("htj,jthd->thd", probs[..., t:], torch.stack(values[1:]))
            hidden = hidden + self.o_proj(attn.reshape(t, -1))
            m = self._rms(hidden, self.post_norm)
            hidden = hidden + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))
            outputs.append(hidden)
        return outputs

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._rms(hidden, self.norm) @ self.lm_head.T

    def forward(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        first_position: int,
        output_start: int,
        t2d: torch.Tensor,
        steps: int,
        prompt_weight: float = 0.0,
    ) -> tuple[torch.Tensor, list[float]]:
        """Loss over ``steps`` unrolled draft steps (weights 0.8^(k-1)), and each step's accuracy
        on the output tokens (targets outside the draft vocabulary count as misses). With
        ``prompt_weight`` the prompt tokens in the window count too, at that weight."""
        n = tokens.shape[0]
        index = torch.arange(n - 1)
        total = torch.zeros(())
        accuracy = []
        for k, hidden in enumerate(self.unroll(features, tokens, first_position, steps), start=1):
            target = index + k + 1
            in_output = target >= output_start
            use = torch.nonzero((target < n) & (in_output | (prompt_weight > 0))).squeeze(1)
            labels = t2d[tokens[target[use]]]
            known = labels >= 0
            if not bool(known.any()):
                accuracy.append(float("nan"))
                continue
            logits = self.logits(hidden[use])
            weights = torch.where(in_output[use], 1.0, prompt_weight)[known]
            losses = F.cross_entropy(logits[known], labels[known], reduction="none")
            total = total + 0.8 ** (k - 1) * (losses * weights).sum() / weights.sum().clamp(min=1e-6)
            output_rows = in_output[use]
            if bool(output_rows.any()):
                accuracy.append(float((logits[output_rows].argmax(-1) == labels[output_rows]).float().mean()))
            else:
                accuracy.append(float("nan"))
        return total, accuracy

    def state_for_checkpoint(self, vocab_size: int) -> dict[str, torch.Tensor]:
        p = "midlayer."
        d2t = self.draft_ids - torch.arange(len(self.draft_ids))
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[self.draft_ids] = True
        state = {
            "fc.weight": self.fc.weight,
            p + "self_attn.q_proj.weight": self.q_proj.weight,
            p + "self_attn.k_proj.weight": self.k_proj.weight,
            p + "self_attn.v_proj.weight": self.v_proj.weight,
            p + "self_attn.o_proj.weight": self.o_proj.weight,
            p + "mlp.gate_proj.weight": self.gate_proj.weight,
            p + "mlp.up_proj.weight": self.up_proj.weight,
            p + "mlp.down_proj.weight": self.down_proj.weight,
            p + "hidden_norm.weight": self.hidden_norm,
            p + "input_layernorm.weight": self.input_norm,
            p + "post_attention_layernorm.weight": self.post_norm,
            "norm.weight": self.norm,
            "lm_head.weight": self.lm_head,
        }
        out = {k: v.detach().float().clone() for k, v in state.items()}
        out["d2t"] = d2t.long()
        out["t2d"] = t2d
        return out


def head_config(
    cfg: ModelConfig, vocab_size: int, draft_vocab_size: int, aux_layers: tuple[int, ...], info: dict[str, Any]
) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers)},
        "guidespec_training": info,
    }


def train(cfg: TrainConfig, log: Any = print) -> dict[str, Any]:
    """The whole run; returns its figures (also written into the head's config.json)."""
    threads = torch.get_num_threads()
    try:
        return _train(cfg, log)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: TrainConfig, log: Any) -> dict[str, Any]:
    from guidespec.model_files import load_hf_config, load_tokenizer, resolve_model_dir
    from guidespec.worker.checkpoint import ShardReader

    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model_dir = resolve_model_dir(cfg.model, show_progress=False)
    hf_config = load_hf_config(model_dir)
    model_cfg = ModelConfig.from_hf(hf_config)
    tokenizer = load_tokenizer(model_dir)
    eos = int(tokenizer.eos_token_id)  # the token chat outputs end with (SmolLM2: <|im_end|>)
    sequences = load_generations(cfg, tokenizer, model_dir, eos, log)
    if len(sequences) < 2:
        raise ValueError("train-eagle needs generations: give --from-results FILE (a sweep's results) or --generate N")
    aux = default_aux_layers(model_cfg.num_layers)
    features = target_features(model_dir, sequences, aux, cfg.prompt_window, log, cfg.max_feature_minutes * 60)
    sequences = sequences[: len(features)]
    collected_s = time.perf_counter() - start
    held_out = max(1, len(sequences) // 10)
    draft_ids = draft_vocabulary(
        sequences[held_out:], min(cfg.draft_vocab_size, model_cfg.vocab_size), model_cfg.vocab_size, eos
    )
    t2d = torch.full((model_cfg.vocab_size,), -1, dtype=torch.long)
    t2d[draft_ids] = torch.arange(len(draft_ids))
    embed = ShardReader(model_dir).get("model.embed_tokens.weight").float()
    max_len = max(f[2] + len(f[1]) for f in features) + cfg.ttt_steps + 1
    head_cfg = dataclasses.replace(
        model_cfg,
        num_layers=1,
        num_heads=cfg.num_heads or model_cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads or model_cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size or model_cfg.intermediate_size,
    )
    if head_cfg.num_heads % head_cfg.num_kv_heads:
        raise ValueError(
            f"the head's {head_cfg.num_heads} heads do not split over {head_cfg.num_kv_heads} key/value heads"
        )
    head = TrainableHead(head_cfg, hf_config, embed, draft_ids, len(aux), max_len)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    train_set, test_set = features[held_out:], features[:held_out]
    budget_s = cfg.max_minutes * 60
    train_start = time.perf_counter()
    step = 0
    rng = random.Random(cfg.seed)
    from tqdm import tqdm

    bar = tqdm(desc="train-eagle: training", unit="seq", total=None)
    while True:
        elapsed = time.perf_counter() - train_start
        if elapsed >= budget_s or (cfg.max_updates is not None and step >= cfg.max_updates):
            break
        feats, tokens, first, out_start = train_set[rng.randrange(len(train_set))]
        progress = max(elapsed / budget_s, step / cfg.max_updates if cfg.max_updates else 0.0)
        lr = cfg.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, acc = head(feats, tokens, first, out_start, t2d, cfg.ttt_steps, cfg.prompt_loss_weight)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        bar.update(1)
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", acc1=f"{acc[0]:.2f}")
    bar.close()
    with torch.no_grad():
        per_step = np.nanmean([head(f, t, p, o, t2d, cfg.ttt_steps)[1] for f, t, p, o in test_set], axis=0)
    info = {
        "target": str(model_dir),
        "sequences": len(train_set),
        "held_out": len(test_set),
        "output_tokens": int(sum(len(s.token_ids) - s.output_start for s in sequences)),
        "draft_vocab_size": len(draft_ids),
        "ttt_steps": cfg.ttt_steps,
        "updates": step,
        "held_out_accuracy_per_step": [round(float(a), 4) for a in per_step],
        "data_s": round(collected_s, 1),
        "train_s": round(time.perf_counter() - train_start, 1),
        "excluded_prefix": cfg.exclude_prefix,
        "prompt_window": cfg.prompt_window,
        "prompt_loss_weight": cfg.prompt_loss_weight,
    }
    save_head(
        cfg.output,
        head.state_for_checkpoint(model_cfg.vocab_size),
        head_config(head_cfg, model_cfg.vocab_size, len(draft_ids), aux, info),
    )
    log(
        f"train-eagle: saved {cfg.output}; held-out accuracy per draft step (greedy target tokens): "
        + ", ".join(f"{a:.3f}" for a in per_step)
    )
    return info
