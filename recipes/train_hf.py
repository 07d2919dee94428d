"""Train a Hugging Face transformers causal LM (random init) on the byte corpus, eagerly or graphed.

    python recipes/train_hf.py --arch llama --steps 200 --out runs/hf_llama
    python recipes/train_hf.py --arch qwen2 --graph layer+opt --out runs/hf_qwen2
    python recipes/train_hf.py --config my_config.json --graph full --out runs/hf_custom
    torchrun --standalone --nproc-per-node=2 recipes/train_hf.py --arch gpt2 --graph layer
    python recipes/train_hf.py --out runs/hf_llama --resume latest --steps 400   # train on

The model is ``AutoModelForCausalLM.from_config`` of a preset (``--arch``, sized by
``--n-layer``, ``--n-embd``, ``--n-head``, ``--block-size``) or of a config file (``--config``, a
transformers ``config.json``); its vocabulary is the corpus's 256 byte values. The corpus, the
data sampler, the warmup-then-cosine schedule and torchrun handling are recipes/train_gpt.py's
(``gpt_training/``). ``--graph`` picks how a step runs; all four compute the same numbers:

* ``none``: eager (DDP under torchrun).
* ``layer`` (default): the decoder layers replay per-layer graphs
  (``tgraph.integrations.transformers.graph_layers``; the first step runs eagerly and is
  recorded, then ``tgraph.create_graphs()``); the optimizer step stays eager.
* ``layer+opt``: per-layer graphs, plus clipping and AdamW as one graph (``tgraph.OptimizerGraph``).
* ``full``: forward, backward, the gradient all-reduce, clipping and AdamW as one
  ``tgraph.FullIterationGraph``.

Checkpoints go to ``--out/checkpoints/step_NNNNNN``: ``save_pretrained`` output (``config.json``,
``model.safetensors``: transformers' own layout, so ``AutoModelForCausalLM.from_pretrained(dir)``
loads it) plus ``trainer.pt`` (optimizer, sampler and RNG states, the run's arguments). Each is
written to a temporary directory and renamed into place, so a killed run leaves only complete
checkpoints; ``checkpoints/latest`` links the newest. A fresh run into an ``--out`` holding
checkpoints is refused (``--resume latest`` continues it, ``--overwrite`` starts afresh); a
resumed run takes its model from the checkpoint and continues bit for bit. A non-finite loss
stops the run before its next checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpt_training.optim import adamw, lr_at, set_lr, tensor_lrs
from gpt_training.parallel import all_reduce_mean, setup, shutdown, synchronize
from torch.nn.parallel import DistributedDataParallel as DDP

import tgraph
from tgraph.toy.corpus import BatchSampler, load_split

logger = logging.getLogger("train_hf")

GRAPH_MODES = ("none", "layer", "layer+opt", "full")
FULL_WARMUP = 3  # eager calls of the full-iteration step before its capture
VOCAB = 256  # the corpus is bytes
MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2)
# --arch presets: transformers model_type and what that family needs beyond the common sizes
ARCHS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "gemma": ("gemma", {}),
    "gpt2": ("gpt2", {}),
    "gpt_neox": ("gpt_neox", {}),
    "qwen2_moe": ("qwen2_moe", MOE),
    "qwen3_moe": ("qwen3_moe", MOE),
    "mixtral": ("mixtral", MOE),
}
# the arguments a resumed run takes from its checkpoint (the model and the data it sees)
MODEL_ARGS = ("arch", "config", "n_layer", "n_embd", "n_head", "block_size", "batch_size", "seed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    p.add_argument("--config", help="a transformers config.json to build instead of --arch")
    p.add_argument("--graph", choices=GRAPH_MODES, default="layer")
    p.add_argument("--backend", choices=("auto", "cuda", "emulated"), default="auto")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=128, help="tokens per training window")
    p.add_argument("--batch-size", type=int, default=8, help="windows per step and rank")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=1e-4, help="the cosine's floor")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1, help="on matrices only")
    p.add_argument("--grad-clip", type=float, default=1.0, help="0 disables clipping")
    p.add_argument(
        "--experts", default="batched_mm", help="MoE experts_implementation (grouped_mm on GPUs)"
    )
    p.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute layers (non-reentrant)"
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept (older ones pruned)")
    p.add_argument("--out", default="runs/hf")
    p.add_argument("--resume", help="'latest' or a checkpoint directory")
    p.add_argument("--overwrite", action="store_true", help="delete --out's run and start afresh")
    a = p.parse_args(argv)
    a.deterministic = False  # read by gpt_training.parallel.setup
    if min(a.steps, a.log_every, a.ckpt_every, a.keep, a.batch_size, a.block_size) < 1:
        p.error("--steps, --log-every, --ckpt-every, --keep, --batch-size, --block-size: >= 1")
    if not 0.0 <= a.min_lr <= a.lr:
        p.error(f"--min-lr must be in [0, --lr={a.lr}]")
    return a


# ------------------------------------------------------------------------------- the model


def build_config(a: argparse.Namespace):
    """The transformers config of ``--config`` or of the ``--arch`` preset."""
    from transformers import AutoConfig

    if a.config:
        cfg = AutoConfig.from_pretrained(a.config)
        if cfg.vocab_size < VOCAB:
            raise ValueError(f"{a.config}: vocab_size {cfg.vocab_size} < {VOCAB} (byte tokens)")
        return cfg
    model_type, extra = ARCHS[a.arch]
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=a.n_embd,
        num_hidden_layers=a.n_layer,
        num_attention_heads=a.n_head,
        num_key_value_heads=max(1, a.n_head // 2),  # GQA where the family has it
        head_dim=a.n_embd // a.n_head,
        intermediate_size=4 * a.n_embd,
        moe_intermediate_size=a.n_embd,
        max_position_embeddings=a.block_size,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **extra,
    )
    if model_type == "gpt2":  # GPT-2 spells its MLP width n_inner and has no GQA
        kw["n_inner"] = kw.pop("intermediate_size")
        kw.pop("num_key_value_heads")
    return AutoConfig.for_model(model_type, **kw)


def build_model(a: argparse.Namespace, device: torch.device, resume: Path | None):
    from transformers import AutoModelForCausalLM

    kw = dict(attn_implementation="sdpa")
    if resume is not None:
        model = AutoModelForCausalLM.from_pretrained(resume, **kw)
    else:
        torch.manual_seed(a.seed)
        model = AutoModelForCausalLM.from_config(build_config(a), **kw)
    if getattr(model.config, "num_experts", None) or getattr(
        model.config, "num_local_experts", None
    ):
        model.set_experts_implementation(a.experts)
    if a.gradient_checkpointing:  # non-reentrant: the only kind a backward graph can run
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # its newer name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model.to(device).train()


def make_optimizer(model: torch.nn.Module, a: argparse.Namespace, device: torch.device):
    """AdamW in every mode (graphs need capturable on CUDA, fused on the CPU), device lrs."""
    return adamw(model, device, a.lr, a.weight_decay, (0.9, 0.95))


# ------------------------------------------------------------------------------ the step


class TrainStep:
    """``step(x, y) -> loss`` (a detached device tensor) in the mode of ``--graph``."""

    def __init__(self, a, model, opt, env) -> None:
        self.a, self.model, self.opt, self.env = a, model, opt, env
        # the optimizer's order, as OptimizerGraph clips them (the norm sums in this order)
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self.calls = 0
        if a.graph in ("layer", "layer+opt"):
            from tgraph.integrations import transformers as tg_hf

            tg_hf.graph_layers(model, backend=a.backend)
        self.net = model
        if env.world_size > 1 and a.graph != "full":  # full all-reduces inside its graph
            self.net = DDP(
                model, device_ids=[env.device.index] if env.device.type == "cuda" else None
            )
        clip = a.grad_clip or None
        self.opt_graph = None
        if a.graph == "layer+opt":
            self.opt_graph = tgraph.OptimizerGraph(
                opt, clip_grad_norm=clip, skip_nonfinite=False, backend=a.backend
            )
        self.full = None
        if a.graph == "full":
            self.full = tgraph.FullIterationGraph(
                lambda b: self.eager_step(*b), warmup_steps=FULL_WARMUP, backend=a.backend
            )

    def close(self) -> None:
        """Undo ``graph_layers`` (drops the graphs; the model's classes are its own again)."""
        if self.a.graph in ("layer", "layer+opt"):
            from tgraph.integrations import transformers as tg_hf

            tg_hf.ungraph(self.model)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.net(input_ids=x, use_cache=False).logits  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def eager_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.opt_graph is None:
            self.opt.zero_grad(set_to_none=True)
        loss = self.loss(x, y)
        loss.backward()
        if self.opt_graph is not None:  # clips, steps and zeroes the gradients
            self.opt_graph.step(loss.detach())
            return loss.detach()
        if self.env.world_size > 1 and self.full is not None:
            flat = torch.cat([p.grad.flatten() for p in self.params])  # one all-reduce
            dist.all_reduce(flat)
            flat /= self.env.world_size
            for p, g in zip(self.params, flat.split([p.numel() for p in self.params])):
                p.grad.copy_(g.view_as(p))
        if self.a.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.a.grad_clip)
        self.opt.step()
        return loss.detach()

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.full is not None:
            return self.full((x, y))
        loss = self.eager_step(x, y)
        if self.calls == 1 and self.a.graph in ("layer", "layer+opt"):
            # the recorded step's gradients would add their size to the peak of creating the graphs
            if self.opt_graph is None:  # (OptimizerGraph owns its .grad tensors: kept)
                self.opt.zero_grad(set_to_none=True)
            logger.info("%s", tgraph.create_graphs())
        return loss


# ------------------------------------------------------------------------- checkpoints


def checkpoints(out: Path) -> list[Path]:
    root = out / "checkpoints"
    return sorted(root.glob("step_[0-9]*")) if root.is_dir() else []


def resolve_resume(a: argparse.Namespace) -> Path | None:
    out = Path(a.out)
    if a.resume is None:
        if checkpoints(out) and not a.overwrite:
            raise SystemExit(
                f"error: {out} already holds checkpoints; continue with --resume latest, "
                "choose another --out, or pass --overwrite to delete the run"
            )
        return None
    path = out / "checkpoints" / "latest" if a.resume == "latest" else Path(a.resume)
    if not (path / "trainer.pt").is_file():
        raise SystemExit(f"error: no checkpoint at {path} (trainer.pt missing)")
    return path.resolve()


def save_checkpoint(out: Path, step: int, model, opt, sampler, a, decay_steps: int) -> Path:
    """Write step ``step`` atomically (temporary directory, then rename); prune to ``--keep``."""
    root = out / "checkpoints"
    final, tmp = root / f"step_{step:06d}", root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    state = {
        "step": step,
        "decay_steps": decay_steps,
        "optimizer": opt.state_dict(),
        "sampler": sampler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
        "args": vars(a),
    }
    torch.save(state, tmp / "trainer.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    link = root / ".tmp_latest"
    link.unlink(missing_ok=True)
    link.symlink_to(final.name)
    os.replace(link, root / "latest")
    for old in checkpoints(out)[: -a.keep]:
        shutil.rmtree(old)
    return final


# ------------------------------------------------------------------------------ the loop


def train(a: argparse.Namespace) -> dict:
    """Run the training; returns the summary (also written to ``--out/summary.json``)."""
    env = setup(a)
    out = Path(a.out)
    resume = resolve_resume(a)
    state = None
    if resume is not None:
        state = torch.load(resume / "trainer.pt", map_location="cpu", weights_only=False)
        for k in MODEL_ARGS:  # the model and data of the run being continued
            setattr(a, k, state["args"][k])
    elif env.is_main and a.overwrite and out.exists():
        shutil.rmtree(out)
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
    model = build_model(a, env.device, resume)
    opt = make_optimizer(model, a, env.device)
    data = load_split("train", rank=env.rank, world_size=env.world_size)
    sampler = BatchSampler(data, a.batch_size, a.block_size, seed=a.seed + env.rank)
    start, decay_steps = 0, a.steps
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        tensor_lrs(opt, env.device)
        sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and env.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"])  # dropout masks continue as if unbroken
        start, decay_steps = state["step"], state["decay_steps"]
    step_fn = TrainStep(a, model, opt, env)
    try:
        losses = run_steps(a, env, model, opt, sampler, step_fn, start, decay_steps)
    finally:
        step_fn.close()  # the model without graphs again, also when a step raised
    summary = dict(steps=a.steps, graph=a.graph, final_loss=losses[-1] if losses else None)
    if env.is_main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    shutdown(env, agreed=True)
    return summary


def run_steps(a, env, model, opt, sampler, step_fn, start: int, decay_steps: int) -> list[float]:
    """Steps ``start`` to ``--steps``: metrics and checkpoints. Returns the logged losses."""
    out = Path(a.out)
    losses, t0, last = [], time.perf_counter(), start
    with open(out / "metrics.jsonl", "a") if env.is_main else contextlib.nullcontext() as metrics:
        for step in range(start, a.steps):
            set_lr(opt, lr_at(step, a, decay_steps))
            x, y = (t.to(env.device, non_blocking=True) for t in sampler.next())
            loss = step_fn(x, y)
            done = step + 1
            if done % a.log_every == 0 or done % a.ckpt_every == 0 or done == a.steps:
                value = all_reduce_mean(loss.clone(), env).item()  # host sync at log steps only
                if not math.isfinite(value):
                    raise RuntimeError(f"step {done}: loss is {value}; stopped before a checkpoint")
                synchronize(env.device)
                ms = (time.perf_counter() - t0) * 1e3 / (done - last)  # includes any capture
                losses.append(value)
                row = dict(step=done, loss=round(value, 5), lr=lr_at(step, a, decay_steps), ms=ms)
                if metrics is not None:
                    metrics.write(json.dumps(row) + "\n")
                    metrics.flush()
                    logger.info("step %d loss %.4f lr %.2e %.1f ms", done, value, row["lr"], ms)
                t0, last = time.perf_counter(), done
            if env.is_main and (done % a.ckpt_every == 0 or done == a.steps):
                save_checkpoint(out, done, model, opt, sampler, a, decay_steps)
    return losses


def main(argv: list[str] | None = None) -> int:
    rank0 = int(os.environ.get("RANK", 0)) == 0
    logging.basicConfig(level=logging.INFO if rank0 else logging.WARNING, format="%(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's per-checkpoint bars
    a = parse_args(argv)
    try:
        summary = train(a)
    except ValueError as exc:
        logger.error("error: %s", exc)
        return 2
    logger.info("done: %s", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
