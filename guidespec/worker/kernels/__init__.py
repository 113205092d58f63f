"""CPU kernels built at first use: the C sources are compiled with the system's C compiler into
the cache directory, side by side (17 s on two cores, once per CPU and source), and called through
ctypes (no torch headers).

The kernels, fp32 activations:

- ``packed_linear.c``: linear layers over weights packed at load time (:class:`PackedWeight`;
  the file says why). The model packs its linear weights with :func:`pack` and multiplies with
  :func:`linear`; a tied embedding is packed once and looked up with :func:`embedding`. The same
  tiles read int8 weights with a scale per output row (:class:`QuantizedWeight`, made by
  :func:`quantize`): a quarter of the bytes, for the target's int8 copy as a draft model. A
  greedy step's LM head picks each row's token as its tiles are summed (:func:`linear_argmax`),
  without writing the logits; or from the head's int8 copy where it has one
  (:func:`add_picks_check`: every row count where its sums take int8 inputs, AVX-512 VNNI's or
  AVX2's, up to 6 rows otherwise), the tokens that could win summed again exactly.
- ``gguf_linear.c``: linear layers over a GGUF file's own quantized blocks
  (:class:`~guidespec.worker.kernels.gguf_weights.GGUFWeight`, that module says which formats),
  activations rounded to int8 per block of 32 as llama.cpp does: :func:`linear` takes them too.
- ``attention.c``: :func:`cache_attention`, new tokens (any number per row) attending the KV cache in
  place (decode and draft verification).
- ``layer_ops.c``: a layer's small operations in one call each (:func:`add_rms_norm`,
  :func:`rope_into_cache`, :func:`silu_mul`), where torch's dispatch costs more than the work.
- ``logits_ops.c``: a bitmask applied to logits rows (:func:`apply_bitmask`) and the greedy pick
  of every row (:func:`argmax_rows`), one pass each; the rows a mask allows one token in
  (:func:`single_tokens`), each read to its second allowed token.
- ``decoder.c``: every layer of a forward in one call (:class:`DecoderStack`), the same kernels
  in the same order as the model's Python loop, without the Python between them.
- ``pool.c``: the thread pool their parallel loops share; its helpers spin between a step's
  regions and sleep when the worker is about to wait (:func:`park_threads`).

Without a compiler, or with ``GUIDESPEC_CPU_KERNELS=0``, :func:`pack` leaves weights as they
are, :func:`cache_attention` is unavailable, and everything runs on ``torch.nn.functional``.

The Python side: :mod:`.loader` builds and loads the library, :mod:`.weights` holds the weight
kinds, :mod:`.ops` the operations, :mod:`.decoder` the whole-stack call.
"""

from guidespec.worker.kernels import loader
from guidespec.worker.kernels.decoder import DecoderStack
from guidespec.worker.kernels.loader import available, build, load, set_threads, threads
from guidespec.worker.kernels.ops import (
    add_rms_norm,
    apply_bitmask,
    argmax_rows,
    cache_attention,
    embedding,
    linear,
    linear_argmax,
    linear_rows,
    park_threads,
    rope_into_cache,
    silu_mul,
    single_tokens,
)
from guidespec.worker.kernels.weights import (
    BLOCK,
    PackedWeight,
    QuantizedWeight,
    Weight,
    add_picks_check,
    dense,
    pack,
    quantize,
)

__all__ = [
    "BLOCK",
    "DecoderStack",
    "PackedWeight",
    "QuantizedWeight",
    "Weight",
    "add_picks_check",
    "add_rms_norm",
    "apply_bitmask",
    "argmax_rows",
    "available",
    "build",
    "cache_attention",
    "dense",
    "embedding",
    "linear",
    "linear_argmax",
    "linear_rows",
    "load",
    "loader",
    "pack",
    "park_threads",
    "quantize",
    "rope_into_cache",
    "set_threads",
    "silu_mul",
    "single_tokens",
    "threads",
]
