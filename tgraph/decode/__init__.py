"""Graph-served decode: a static KV cache, static step inputs, one graph per batch-size bucket.

Files, one concept each:

* ``engine.py``: :class:`DecodeEngine`, continuous batching and ``generate``.
* ``graph_runner.py``: capture (largest bucket first, one pool) and replay of the step graphs.
* ``buffers.py``: the static inputs (tokens, positions, slots, lengths), ``set_batch``/``copy_from``.
* ``kv_cache.py``: the preallocated KV cache with its reserved dummy slot.
* ``interface.py``: the prefill/decode-step interface a model implements to be served.
* ``gpt.py``: that interface for the toy GPT.
* ``requests.py``: request validation; ``sampling.py``: greedy/temperature/top-k sampling.
"""

from tgraph.decode.buffers import DecodeBuffers, StepInputs
from tgraph.decode.engine import DecodeEngine, DecodeStats
from tgraph.decode.gpt import GPTDecoder
from tgraph.decode.interface import DecodeModel, as_decode_model
from tgraph.decode.kv_cache import KVCache

__all__ = [
    "DecodeBuffers",
    "DecodeEngine",
    "DecodeModel",
    "DecodeStats",
    "GPTDecoder",
    "KVCache",
    "StepInputs",
    "as_decode_model",
]
