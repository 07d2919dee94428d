"""The shared trainer of ``recipes/train_gpt.py`` and ``recipes/train_hf.py``, one concept per
module (torchtitan's split). A recipe brings only its model (a ``spec.ModelSpec``) and its config
fields; everything else is here.

- ``config``: the config groups and :class:`~gpt_training.config.TrainConfig`; the run-only
  groups say what may change on resume.
- ``spec``: the model seam (build, loss, layer graphs, the weights part of a checkpoint) and the
  toy GPT's spec, ``GPT_SPEC``.
- ``step``: ``make_step(cfg, model, opt, ...)``, one training step in the configured graph mode;
  all of the recipes' graph-mode code.
- ``trainer``: the loop (``train``): build, step, log, validate, checkpoint, stop safely.
- ``checkpointing``: save, resume, prune, ``latest``, the run directory's overwrite rules.
- ``metrics``: ``metrics.jsonl``, step times, peak memory, the plot and the final report.
- ``optim``: AdamW with device-tensor learning rates, and the schedule.
- ``parallel``: torchrun's environment, the process group, Ctrl-C, a clean exit.
- ``cli``: one flag per config field, one-line errors, exit codes.
"""
