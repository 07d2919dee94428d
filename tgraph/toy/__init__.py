"""The toy that shows tgraph at work, kept apart from the library.

* ``gpt.py``: a small pre-LN GPT whose blocks subclass :class:`tgraph.GraphableModule`.
* ``gpt_decode.py``: its prefill/decode-step adapter for :class:`tgraph.decode.DecodeEngine`
  (registered on import, so ``DecodeEngine(gpt)`` works).
* ``corpus.py``: the byte-level corpus made of the Python standard library's own sources.
* ``checkpoint.py``: atomic safetensors + JSON checkpoints of the GPT, a sha256 per tensor.

``import tgraph`` does not import this package; the recipes, benchmarks and tests do.
"""

from tgraph.toy import gpt_decode  # noqa: F401 - registers the GPT's decode adapter
