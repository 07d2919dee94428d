"""Whole-step graphs: :class:`FullIterationGraph` (forward, backward and optimizer step as one
graph) and :class:`OptimizerGraph` (the optimizer step beside per-layer graphs), over one
step-capture protocol (``capture``), with learning rates as device tensors (``hyperparams``),
the warmups' changes undone (``tgraph.snapshot``) and non-finite steps skipped on the device
(``nonfinite``).
"""
