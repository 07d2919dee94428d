"""Graph-served decode: a static KV cache, static inputs, graphs bucketed by batch size (decode)
and by prompt length (prefill), sampling on the device.

Files, one concept each:

* ``engine.py``: :class:`DecodeEngine`, continuous batching and ``generate``.
* ``batch.py``: pad once: buckets and the padded batch/prompt both paths run.
* ``steps.py``: the decode and prefill programs, and the token read-back to the host.
* ``graph_runner.py``: capture (largest first, one pool) and replay of the programs.
* ``weights.py``: the parameters and buffers the graphs read, checked before each call; a
  replaced one (``load_state_dict(assign=True)``) followed by a copy or a re-capture.
* ``hooks.py``: the forward hooks on the served model the engine can honour (the rest refused).
* ``buffers.py``: the static inputs, ``set_batch``/``copy_from``/``advance``.
* ``sampling.py``: greedy/temperature/top-k/top-p with per-request counter-based streams.
* ``kv_cache.py``: the preallocated KV cache, one slot per row.
* ``interface.py``: the prefill/decode-step protocol a model implements to be served (the toy
  GPT's adapter is ``tgraph/toy/gpt_decode.py``).
* ``requests.py``: request validation; ``stats.py``: what the engine did.
"""

from tgraph.decode.buffers import DecodeBuffers, PrefillBuffers, PrefillInputs, StepInputs
from tgraph.decode.engine import DecodeEngine
from tgraph.decode.interface import DecodeModel, as_decode_model
from tgraph.decode.kv_cache import KVCache
from tgraph.decode.stats import DecodeStats

__all__ = [
    "DecodeBuffers",
    "DecodeEngine",
    "DecodeModel",
    "DecodeStats",
    "KVCache",
    "PrefillBuffers",
    "PrefillInputs",
    "StepInputs",
    "as_decode_model",
]
