"""Frozen configuration, resolved before any process starts.

``ModelConfig`` is what the model code needs, read once from a Hugging Face config.
``EngineConfig`` holds the engine's limits and layout; every "auto" is decided by
``launch.engine_config.create_engine_config`` before the dataclass is frozen. Each process gets
only the part it uses (``SchedulerConfig``, ``WorkerConfig``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from guidespec.cuda_ext.channel import ChannelLayout
from guidespec.ipc.broadcast import BroadcastLayout
from guidespec.ipc.collectives import CollectivesLayout
from guidespec.ipc.mask_arena import ArenaLayout
from guidespec.ipc.shm_ring import RingLayout

# the decoder families ModelConfig describes: Llama's layout, each family's differences switched on
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3")
DTYPES = ("float32", "bfloat16", "float16")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gated MLP's activation (transformers' names)
_C = TypeVar("_C", "SchedulerConfig", "WorkerConfig")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's shape and its family's switches, read once from a Hugging Face config. With the
    switches at their defaults it is Llama's layout (Llama 2/3, SmolLM2, Mistral, Qwen2); Qwen3
    adds q/k norms, Gemma 3 most switches, Phi-3 fused checkpoints and partial rotary."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    max_position_embeddings: int
    sliding_window: int | None  # the window of the layers listed "sliding_attention" in layer_types
    layer_types: tuple[str, ...] = ()  # "full_attention" / "sliding_attention" per layer (empty: all full)
    hidden_act: str = "silu"  # ACTIVATIONS
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each q and k head, before RoPE
    norm_plus_one: bool = False  # Gemma: RMSNorm weights w stored, 1 + w applied (folded at load)
    sandwich_norms: bool = False  # Gemma 3: the attention's and the MLP's outputs normed before their adds
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size), in the model's dtype
    query_scale: float = 1.0  # attention scale / head_dim ** -0.5 (Gemma's query_pre_attn_scalar): folded into q
    rotary_dim: int = 0  # the dims of a head RoPE rotates, the first ones (Phi's partial rotary); 0: all
    fused_projections: bool = False  # Phi-3: the checkpoint stores qkv_proj and gate_up_proj fused

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """The config of a transformers config (or its data as attributes); a layout guidespec does
        not compute raises, naming what it lacks."""
        model_type = hf.model_type
        _check_supported(hf, model_type)
        attention_bias = bool(getattr(hf, "attention_bias", False))
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        sliding_window = getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) else None
        gemma = model_type == "gemma3_text"
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            max_position_embeddings=hf.max_position_embeddings,
            sliding_window=sliding_window,
            layer_types=_layer_types(hf, model_type, sliding_window),
            hidden_act=_activation(hf),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            norm_plus_one=gemma,
            sandwich_norms=gemma,
            embed_scale=hf.hidden_size**0.5 if gemma else None,
            query_scale=(hf.query_pre_attn_scalar / head_dim) ** -0.5 if gemma else 1.0,
            rotary_dim=_rotary_dim(hf, head_dim),
            fused_projections=model_type == "phi3",
        )

    @property
    def num_query_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (a query at q sees keys k with q - window < k <= q), or
        None for full attention."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def has_windows(self) -> bool:
        return self.sliding_window is not None and "sliding_attention" in self.layer_types

    @property
    def plain_layers(self) -> bool:
        """Every layer computes as Llama's (how the checkpoint stores it aside): what the whole
        stack in C (``kernels/decoder.c``) computes."""
        return (
            self.hidden_act == "silu"
            and not (self.qk_norm or self.norm_plus_one or self.sandwich_norms)
            and self.embed_scale is None
            and self.query_scale == 1.0
            and self.rotary_dim == 0
        )

    def llama_layout(self) -> ModelConfig:
        """This shape with every family switch off and no windows: an EAGLE head's layer, which
        is Llama's whatever its target."""
        return dataclasses.replace(
            self,
            model_type="llama",
            sliding_window=None,
            layer_types=(),
            hidden_act="silu",
            qk_norm=False,
            norm_plus_one=False,
            sandwich_norms=False,
            embed_scale=None,
            query_scale=1.0,
            rotary_dim=0,
            fused_projections=False,
        )


def _check_supported(hf: Any, model_type: str) -> None:
    if model_type == "gemma3":
        raise ValueError(
            "model type 'gemma3' (Gemma 3 with its vision tower) is not supported; its text-only "
            "checkpoints (model type 'gemma3_text': Gemma 3 270M, 1B) are"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {model_type!r} is not supported; guidespec runs {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(hf, "mlp_bias", False):
        raise ValueError("MLPs with a bias (mlp_bias) are not supported")
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(hf, name, None) is not None:
            raise ValueError(f"{name} is not supported (Gemma 3 sets none; Gemma 2 does)")
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention is not supported: guidespec runs causal decoders")


def _activation(hf: Any) -> str:
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None) or "silu"
    if act not in ACTIVATIONS:
        raise ValueError(f"the MLP's activation {act!r} is not supported; guidespec runs {', '.join(ACTIVATIONS)}")
    return str(act)


def _layer_types(hf: Any, model_type: str, sliding_window: int | None) -> tuple[str, ...]:
    """Each layer's attention: Mistral and Phi-3 window every layer where the config has a
    window (transformers' sliding mask for the whole model), Qwen and Gemma 3 the layers their
    ``layer_types`` say (Gemma 3's also pick its RoPE table); Llama none."""
    if model_type == "llama":
        return ()
    if model_type in ("mistral", "phi3"):
        return ("sliding_attention",) * hf.num_hidden_layers if sliding_window is not None else ()
    types = tuple(getattr(hf, "layer_types", None) or ())
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} are not supported (full_attention, sliding_attention are)")
    if types and len(types) != hf.num_hidden_layers:
        raise ValueError(f"layer_types lists {len(types)} layers, the model has {hf.num_hidden_layers}")
    return types


def _rotary_dim(hf: Any, head_dim: int) -> int:
    """The rotated dims of a head where not all (0): Phi-3's partial_rotary_factor (in its
    rope_parameters); the other families rotate whole heads."""
    params = getattr(hf, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", 1.0) if hf.model_type == "phi3" else 1.0
    dim = int(head_dim * factor)
    if dim % 2 or not 0 < dim <= head_dim:
        raise ValueError(f"partial_rotary_factor {factor} gives {dim} rotated dims of {head_dim}: need an even number")
    return 0 if dim == head_dim else dim


SPEC_METHODS = ("ngram", "forced", "user", "draft_model", "eagle")
# jump-forward: "verified" (the grammar's forced tokens are drafts the model verifies in the same
# forward: output as without jump-forward), "unverified" (appended as the forced text's canonical
# tokenization without asking the model: the model may have spelled it in other tokens), "off"
JUMP_FORWARD_MODES = ("verified", "unverified", "off")
MODEL_DRAFTERS = ("draft_model", "eagle")  # run by rank 0 of the workers


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``scheduler/speculation``, ``worker/drafting``). ``method``:
    ``ngram`` (prompt lookup, in the scheduler), ``forced`` (grammar-forced tokens only), ``user`` (``user_drafter``, a
    ``module:Class`` path), ``draft_model`` (a smaller model with the target's tokenizer, run by
    rank 0 after each step to propose the next step's drafts: ``draft_model``) or ``eagle`` (an
    EAGLE / EAGLE-3 head folder in ``draft_model``, run by rank 0 on the target's hidden states).
    With ``use_forced_tokens``, a guided request's grammar-forced tokens are drafted first and the
    method's drafts continue after them. With ``constrain_drafts``, drafts
    are checked against the grammar and cut at the first token it rejects; without, a rejected
    draft reaches the workers and the target's mask refuses it there. The n-gram options mean
    what they mean in TensorRT-LLM's NGram decoding."""

    method: str = "ngram"
    max_draft_len: int = 3
    max_matching_ngram_size: int = 4
    is_keep_all: bool = True
    is_use_oldest: bool = True
    is_public_pool: bool = True
    use_forced_tokens: bool = True
    constrain_drafts: bool = True  # cut drafts where the grammar rejects them (off: verification rejects them)
    # draft_model / eagle, constrain_drafts: how many of a guided row's draft steps wait for its
    # grammar's mask, from the first (None: all; fewer: fewer round trips to the scheduler in a
    # draft loop, the later drafts still checked and cut where the grammar rejects them)
    draft_mask_steps: int | None = None
    adaptive: bool = True
    user_drafter: str | None = None
    draft_model: str | None = (
        None  # draft_model: "int8", "self", "layers:N" (the target's first N) or a folder; eagle: a head folder
    )
    combine_ngram: bool = False  # draft_model / eagle: also prompt lookup; the longer valid draft wins
    # draft_model / eagle with adaptive: the rows the draft model would not pay for (a large batch,
    # low acceptance) draft by prompt lookup instead
    ngram_fallback: bool = True
    # n-gram: where no suffix matches, look the context's last word up in the prompt's text and
    # let the grammar pick what follows it (``NGramDrafter``)
    anchored_lookup: bool = True

    def validate(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        if not isinstance(self.max_draft_len, int) or not 1 <= self.max_draft_len <= 16:
            raise ValueError(f"max_draft_len must be in [1, 16], got {self.max_draft_len}")
        if not isinstance(self.max_matching_ngram_size, int) or not 1 <= self.max_matching_ngram_size <= 64:
            raise ValueError(
                f"max_matching_ngram_size must be an integer in [1, 64], got {self.max_matching_ngram_size!r}"
            )
        flags = (
            "is_keep_all",
            "is_use_oldest",
            "is_public_pool",
            "use_forced_tokens",
            "constrain_drafts",
            "adaptive",
            "combine_ngram",
            "ngram_fallback",
            "anchored_lookup",
        )
        for name in flags:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        steps = self.draft_mask_steps
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps <= 16):
            raise ValueError(f"draft_mask_steps must be None or an integer in [0, 16], got {steps!r}")
        if self.method == "user" and not self.user_drafter:
            raise ValueError("method 'user' needs user_drafter='module:Class'")
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError("method 'draft_model' needs draft_model='int8' | 'self' | 'layers:N' | a model folder")
        if self.combine_ngram and self.method not in MODEL_DRAFTERS:
            raise ValueError(f"combine_ngram goes with a draft model or an EAGLE head, not method {self.method!r}")
        if self.method == "eagle" and not self.draft_model:
            raise ValueError("method 'eagle' needs draft_model=<an EAGLE head folder> (see `guidespec train-eagle`)")


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path  # a Hugging Face folder (converted from GGUF if need be)
    tensor_parallel_size: int
    dtype: str
    max_batch_size: int
    max_model_len: int
    max_num_batched_tokens: int
    eos_token_ids: tuple[int, ...]
    show_progress: bool = True
    remote_ranks: tuple[int, ...] = ()  # ranks that read steps over ZeroMQ TCP (ranks on other hosts)
    vocab_size: int = 0
    grammar_backend: str = "auto"  # or "xgrammar", "llguidance" (protocol.BACKEND_CHOICES)
    grammar_compile_timeout_s: float = 30.0
    jump_forward: str = "verified"  # JUMP_FORWARD_MODES
    speculative: SpeculativeConfig | None = None
    # a new request starts where a free slot's cached tokens match its prompt (Batcher._admit)
    enable_prefix_caching: bool = True
    distributed_executor: str = "mp"  # "mp": local processes; "ray": every rank a Ray actor (launch/ray_executor.py)
    ray_address: str | None = None  # the Ray cluster to join (None: the one this process is in, or a new local one)
    hf_config: dict[str, Any] | None = None  # the model's config as data (model_files.config_data)
    device: str = "cpu"  # "cpu" or "cuda" (resolved from "auto": worker/device.py)
    enforce_eager: bool = False  # CUDA: no graphs (worker/graphs.py)
    # a model drafter's (EAGLE head, draft model) greedy draft steps as one graph each, grammar
    # waits inside (worker/drafting/draft_graph.py): None: on CUDA with graphs; True on the CPU runs the
    # same steps eagerly
    graph_grammar: bool | None = None
    # threads filling a step's grammar masks in the scheduler (GrammarSettings.fill_threads)
    grammar_fill_threads: int = 1
    gpu_memory_utilization: float = 0.9  # CUDA: the share of a GPU's memory a rank may take
    ray_placement: str = "pack"  # Ray: "pack" (STRICT_PACK: one node) or "spread" (STRICT_SPREAD across nodes)
    # dtype "gguf", and "auto" on the CPU: a GGUF model's linear weights run as the file's own blocks
    # (kernels/gguf_weights.py); a model that is not a GGUF file's conversion loads as fp32
    quantized_weights: bool = False
    # the KV cache: blocks of this many positions (scheduler/kv_blocks.py), and the tokens its pool
    # holds (None: sized from memory, worker/device.py kv_pool_blocks)
    kv_block_size: int = 16
    kv_cache_tokens: int | None = None
    # compiled grammars shared with other engines (scheduler/grammar/store.py): data-parallel
    # replicas point at one folder, so a schema is compiled once among them; None: not shared
    grammar_cache_dir: str | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    model_dir: Path
    max_batch_size: int
    max_model_len: int
    max_num_batched_tokens: int
    eos_token_ids: tuple[int, ...]
    num_workers: int
    broadcast: BroadcastLayout
    client_in: str  # client -> scheduler (PULL, bound by the scheduler)
    client_out: str  # scheduler -> client (PUSH, connected to the client's PULL)
    worker_results: str  # workers -> scheduler (PULL, bound by the scheduler)
    vocab_size: int
    grammar_backend: str
    grammar_compile_timeout_s: float
    jump_forward: str  # JUMP_FORWARD_MODES
    speculative: SpeculativeConfig | None = None
    enable_prefix_caching: bool = True
    draft_channel: ChannelLayout | None = None  # model drafts and their masks with rank 0 (cuda_ext)
    grammar_fill_threads: int = 1  # EngineConfig.grammar_fill_threads
    fused_steps: bool = False  # verify masks through the draft channel too, for rank 0's fused steps
    kv_block_size: int = 16
    async_scheduling: bool = True  # a step is sent while the one before runs (no request in it may draft)
    grammar_cache_dir: str | None = None  # EngineConfig.grammar_cache_dir


@dataclass(frozen=True)
class WorkerConfig:
    model_dir: Path
    dtype: str
    rank: int
    tensor_parallel_size: int
    max_batch_size: int
    max_model_len: int
    broadcast: BroadcastLayout
    ring_index: int | None  # this rank's ring reader, None: it reads the remote stream
    worker_results: str
    dist_init_method: str
    num_threads: int
    show_progress: bool = True
    device: str = "cpu"  # "cpu" or "cuda:<i>" (worker/device.py: rank_device)
    draft_model: str | None = None  # rank 0 runs this draft model after each step (SpeculativeConfig.draft_model)
    draft_method: str = "draft_model"  # or "eagle": draft_model is then an EAGLE head folder
    hf_config: dict[str, Any] | None = None  # the model's config as the main process read it (model_files.config_data)
    enforce_eager: bool = False  # CUDA: no graphs
    gpu_memory_utilization: float = 0.9
    draft_channel: ChannelLayout | None = None  # rank 0's draft/mask exchange with the scheduler (cuda_ext)
    scheduler_pid: int = 0  # the draft channel's peer: a wait ends at once when it dies
    quantized_weights: bool = False  # EngineConfig.quantized_weights: LlamaModel(quantized=...)
    draft_graphs: bool = (
        False  # rank 0: a model drafter's draft steps as fixed-shape graphs (worker/drafting/draft_graph.py)
    )
    # a model drafter's whole speculative steps as one graph each (worker/drafting/step_graph.py), every rank
    fused_steps: bool = False
    kv_block_size: int = 16
    kv_cache_tokens: int | None = None  # EngineConfig.kv_cache_tokens
    collectives: CollectivesLayout | None = None  # the ranks' shared-memory collectives (CPU, one host)


def config_to_dict(config: SchedulerConfig | WorkerConfig) -> dict[str, object]:
    """A JSON-ready dict of a process config (paths as strings, the ring layout as a dict)."""
    out = dataclasses.asdict(config)
    out["model_dir"] = str(config.model_dir)
    return out


def config_from_dict(cls: type[_C], data: dict[str, Any]) -> _C:
    fields = dict(data)
    fields["model_dir"] = Path(str(fields["model_dir"]))
    broadcast = dict(fields["broadcast"])
    broadcast["ring"] = RingLayout(**broadcast["ring"]) if broadcast["ring"] is not None else None
    broadcast["arena"] = ArenaLayout(**broadcast["arena"]) if broadcast.get("arena") is not None else None
    fields["broadcast"] = BroadcastLayout(**broadcast)
    if "eos_token_ids" in fields:
        fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
    if fields.get("draft_channel") is not None:
        fields["draft_channel"] = ChannelLayout(**fields["draft_channel"])
    if fields.get("collectives") is not None:
        fields["collectives"] = CollectivesLayout(**fields["collectives"])
    if fields.get("speculative") is not None:
        fields["speculative"] = SpeculativeConfig(**fields["speculative"])
    return cls(**fields)
