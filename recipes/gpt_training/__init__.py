"""The pieces of ``recipes/train_gpt.py``, one concept per module (torchtitan's split).

- ``config``: the config groups and :class:`~gpt_training.config.TrainConfig`; the run-only
  groups say what may change on resume.
- ``step``: ``make_step(cfg, model, opt, ...)``, one training step in the configured graph mode;
  all of the recipe's graph-mode code.
- ``trainer``: the loop (``train``): build, step, log, validate, checkpoint, stop safely.
- ``checkpointing``: save, resume, prune, ``latest``, the run directory's overwrite rules.
- ``metrics``: ``metrics.jsonl``, step times, peak memory, the plot and the final report.
- ``optim``: AdamW with device-tensor learning rates, and the schedule.
- ``parallel``: torchrun's environment, the process group, Ctrl-C, a clean exit.
"""
