"""Train the toy GPT on the Python standard library's own sources, eagerly or with graphs.

    python recipes/train_gpt.py                                    # one process, defaults
    python recipes/train_gpt.py --graph full --steps 300 --out runs/full
    torchrun --standalone --nproc-per-node=2 recipes/train_gpt.py --graph layer
    python recipes/train_gpt.py --out runs/gpt --resume latest     # continue a killed run
    python recipes/generate.py --ckpt runs/gpt/checkpoints/latest --prompt "def "

``--graph none`` runs eagerly; ``layer`` graphs every transformer block (``tgraph.enable``: the
first iteration runs eagerly and is recorded, ``tgraph.create_graphs()`` captures, later
iterations replay); ``full`` captures forward, backward, all-reduce and AdamW as one graph
(``tgraph.FullIterationGraph``). All three compute the same numbers. The run directory gets
``config.json`` (resolved config), ``metrics.jsonl``, ``loss.png``, ``summary.json`` and
``checkpoints/step_NNNNNN`` (model safetensors + ``trainer.pt``: optimizer, step, RNG states,
config), each written to a temporary directory and renamed into place, so a killed run leaves
only complete checkpoints; ``checkpoints/latest`` links the newest.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import inspect
import json
import logging
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tgraph
from tgraph import checkpoint
from tgraph.checkpoint import CheckpointError
from tgraph.data import BatchSampler, corpus_stats, fixed_batches, load_split
from tgraph.models.gpt import GPT, GPTConfig

logger = logging.getLogger("train_gpt")

GRAPH_MODES = ("none", "layer", "full")
FULL_WARMUP = 3  # eager calls of the full-iteration step before its capture (DESIGN.md default)
CHECKPOINT_FORMAT = 1


@dataclass(kw_only=True)
class TrainConfig:
    """Everything that defines a run; saved as ``<out>/config.json`` and in every checkpoint."""

    out: str = "runs/gpt"
    """Run directory (config, metrics, plot, summary, checkpoints)."""
    resume: str = ""
    """Continue from a checkpoint directory, or "latest" (newest in <out>/checkpoints); empty: fresh run."""
    device: str = "auto"
    """"auto" (cuda if available), "cpu", "cuda" or "cuda:N" (torchrun uses cuda:LOCAL_RANK)."""
    graph: str = "layer"
    """Graph mode: "none" (eager), "layer" (per-block graphs) or "full" (whole training step)."""
    backend: str = "auto"
    """Graph backend: "auto" (cuda graphs on a GPU, emulated on CPU), "cuda" or "emulated"."""
    steps: int = 2000
    """Optimizer steps in total (a resumed run counts the steps already done)."""
    batch_size: int = 8
    """Sequences per step per rank."""
    block_size: int = 128
    """Bytes per sequence (the GPT's context length)."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads; must divide n_embd."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability."""
    lr: float = 2e-3
    """Peak learning rate (after warmup)."""
    min_lr: float = 2e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 30
    """Steps of linear learning-rate warmup."""
    weight_decay: float = 0.1
    """AdamW weight decay of matrices (embeddings included); biases and norms get none."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    val_fraction: float = 0.05
    """Share of stdlib files held out for validation (split by a hash of the path)."""
    include_tests: bool = False
    """Also train on the stdlib's test directories (about 2.5x the bytes)."""
    eval_every: int = 100
    """Validation loss every this many steps (and at the end); 0: only at the end."""
    eval_batches: int = 8
    """Batches of batch_size sequences per validation (fixed, evenly spaced windows)."""
    ckpt_every: int = 250
    """Checkpoint every this many steps (and at the end); 0: only at the end."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept on disk; older ones are deleted."""
    log_every: int = 10
    """Metrics line (and progress-bar update) every this many steps."""
    seed: int = 1337
    """Seed of the initial weights; rank r draws dropout and batches from seeds derived from it."""
    deterministic: bool = False
    """Deterministic kernels where PyTorch has them (others warn); slower on a GPU."""
    progress: bool = True
    """Show a progress bar on rank 0."""

    def __post_init__(self) -> None:
        def bad(name: str, fix: str) -> ValueError:
            return ValueError(f"TrainConfig.{name}={getattr(self, name)!r} is invalid: {fix}")

        if self.graph not in GRAPH_MODES:
            raise bad("graph", "use --graph none, layer or full")
        if self.backend not in ("auto", "cuda", "emulated"):
            raise bad("backend", "use --backend auto, cuda or emulated")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise bad("device", "use --device auto, cpu, cuda or cuda:N")
        for name in (
            "steps",
            "batch_size",
            "block_size",
            "n_layer",
            "n_head",
            "n_embd",
            "eval_batches",
            "log_every",
            "keep_checkpoints",
        ):
            if getattr(self, name) <= 0:
                raise bad(name, f"--{name.replace('_', '-')} must be a positive integer")
        for name in ("warmup_steps", "eval_every", "ckpt_every"):
            if getattr(self, name) < 0:
                raise bad(name, f"--{name.replace('_', '-')} must be 0 or more")
        if self.n_embd % self.n_head:
            raise bad("n_head", f"it must divide n_embd={self.n_embd}")
        if not 0.0 <= self.dropout < 1.0:
            raise bad("dropout", "use a probability in [0, 1)")
        if not 0.0 < self.min_lr <= self.lr:
            raise bad("min_lr", f"use 0 < min_lr <= lr={self.lr}")
        if not 0.0 < self.val_fraction < 1.0:
            raise bad("val_fraction", "use a fraction strictly between 0 and 1 (e.g. 0.05)")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise bad("grad_clip" if self.grad_clip < 0 else "weight_decay", "use 0 or more")

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            dropout=self.dropout,
        )


# Fields that may differ between a checkpoint and the run resuming it: they change where output
# goes or how often things are reported, not the numbers (the three graph modes compute the same).
RESUME_MAY_CHANGE = frozenset(
    {
        "out",
        "resume",
        "device",
        "graph",
        "backend",
        "deterministic",
        "eval_every",
        "eval_batches",
        "ckpt_every",
        "keep_checkpoints",
        "log_every",
        "progress",
    }
)


# ---------------------------------------------------------------------------------------------
# Command line: one flag per TrainConfig field, help text from the field's docstring.


def _field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields (not kept by Python, so read from the source)."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
        ):
            docs[prev.target.id] = " ".join(str(node.value.value).split())
    return docs


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Build a :class:`TrainConfig` from command-line flags (``--batch-size 8`` or ``--batch_size 8``).

    Raises:
        SystemExit: unknown flag or invalid value (argparse prints the reason).
    """
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    docs = _field_docs(TrainConfig)
    types = {"int": int, "float": float, "str": str, "bool": bool}
    for f in dataclasses.fields(TrainConfig):
        flags = [f"--{f.name.replace('_', '-')}"] + ([f"--{f.name}"] if "_" in f.name else [])
        kind = types[str(f.type)]
        extra = {"choices": GRAPH_MODES} if f.name == "graph" else {}
        if kind is bool:
            parser.add_argument(
                *flags,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=docs.get(f.name),
            )
        else:
            parser.add_argument(
                *flags, dest=f.name, type=kind, default=f.default, help=docs.get(f.name), **extra
            )
    args = parser.parse_args(argv)
    try:
        return TrainConfig(**vars(args))
    except ValueError as e:
        parser.error(str(e))


# ---------------------------------------------------------------------------------------------
# Processes and devices.


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    device: torch.device
    owns_group: bool  # this run initialized the process group and must destroy it

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(cfg: TrainConfig) -> DistEnv:
    """Read torchrun's environment, pick the device, start the process group when WORLD_SIZE > 1."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    name = cfg.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device("cuda", local) if name == "cuda" else torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("TrainConfig.device='cuda' but no GPU is visible; use --device cpu")
        torch.cuda.set_device(device)
    if cfg.deterministic:
        # cuBLAS reads this when it creates its workspace (PyTorch "Reproducibility" notes).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # warn_only: an op without a deterministic kernel warns (naming itself) instead of
        # stopping the run.
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    owns = False
    if world > 1 and not dist.is_initialized():
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **kw)
        owns = True
    return DistEnv(rank, world, device, owns)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of step ``step`` (0-based): linear warmup, then cosine decay to ``min_lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device):
    """AdamW, the same in every graph mode so the three modes compute the same numbers.

    Weight decay on matrices only (nanoGPT). A graph cannot contain AdamW's default step, which
    reads the step count on the host: on a GPU use ``capturable=True``, on the CPU ``fused=True``
    (``capturable`` is CUDA-only). The learning rate lives in a float32 device tensor per group
    that :func:`set_lr` refills in place, so a captured step reads each step's value.
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kind = {"capturable": True} if device.type == "cuda" else {"fused": True}
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **kind)
    tensor_lrs(opt, device)
    return opt


def tensor_lrs(opt: torch.optim.Optimizer, device: torch.device) -> None:
    """Give every param_group its own float32 ``lr`` tensor on ``device`` (also after
    ``load_state_dict``, which brings back the checkpoint's CPU tensors)."""
    for g in opt.param_groups:
        g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32, device=device)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Write ``lr`` into the groups' lr tensors in place (no host sync; graphs see it)."""
    for g in opt.param_groups:
        g["lr"].fill_(lr)


# ---------------------------------------------------------------------------------------------
# Checkpoints: <out>/checkpoints/step_NNNNNN/{model files from tgraph.checkpoint, trainer.pt}.


def _checkpoint_dirs(root: Path) -> list[Path]:
    dirs = [p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[5:]))


def resolve_resume(cfg: TrainConfig) -> Path | None:
    """The checkpoint directory ``cfg.resume`` names, or None for a fresh run.

    Raises:
        CheckpointError: "latest" with no complete checkpoint under ``<out>/checkpoints``.
    """
    if not cfg.resume:
        return None
    if cfg.resume != "latest":
        return Path(cfg.resume)
    root = Path(cfg.out) / "checkpoints"
    found = _checkpoint_dirs(root) if root.is_dir() else []
    if not found:
        raise CheckpointError(
            f"--resume latest: no checkpoint under {root}; expected directories step_NNNNNN "
            "written by this recipe. Check --out, or start a fresh run without --resume."
        )
    return found[-1]


def read_checkpoint(path: Path, cfg: TrainConfig, world_size: int) -> dict:
    """Load and check ``path/trainer.pt`` against the current run.

    Returns:
        The trainer state: ``step``, ``optimizer``, ``rng`` (one entry per rank), ``config``.

    Raises:
        CheckpointError: missing directory or file, unreadable file, or a configuration (or
            world size) that differs from the checkpoint's in a field that changes the numbers.
    """
    if not path.is_dir():
        raise CheckpointError(
            f"no checkpoint at {path}: expected a directory written by recipes/train_gpt.py, "
            f"e.g. {cfg.out}/checkpoints/step_000200, or --resume latest"
        )
    file = path / "trainer.pt"
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {path} is incomplete: trainer.pt is missing. This recipe renames a "
            "checkpoint into place only once every file is written, so the directory was copied "
            "or edited partially; resume from another checkpoint in its parent directory."
        )
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path} is damaged: {file} cannot be read ({type(e).__name__}: {e}); "
            "resume from another checkpoint"
        ) from e
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {path}: trainer.pt has format {state.get('format') if isinstance(state, dict) else None!r},"
            f" expected {CHECKPOINT_FORMAT}; it was not written by this version of the recipe"
        )
    now = asdict(cfg)
    diffs = [
        f"{k}={state['config'].get(k)!r} in the checkpoint but {v!r} now"
        for k, v in now.items()
        if k not in RESUME_MAY_CHANGE and state["config"].get(k) != v
    ]
    if state["world_size"] != world_size:
        diffs.append(
            f"world size {state['world_size']} in the checkpoint but {world_size} now "
            "(each rank resumes its own data shard and RNG streams)"
        )
    if diffs:
        raise CheckpointError(
            f"checkpoint {path} does not match this run: {'; '.join(diffs)}. Resume with the "
            f"checkpoint's settings (see {file.parent.parent.parent / 'config.json'}) or start a "
            "fresh run with another --out."
        )
    return state


def load_model_weights(model: torch.nn.Module, path: Path) -> None:
    """Copy the weights of checkpoint ``path`` into ``model`` (strict: names and shapes).

    Raises:
        CheckpointError: the model files are missing, damaged or of another shape.
    """
    try:
        checkpoint.load_into(model, path)
    except (FileNotFoundError, CheckpointError) as e:
        raise CheckpointError(
            f"cannot resume from {path}: {e}. Resume from another checkpoint of the run"
        ) from e


def rng_state(sampler: BatchSampler, device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state(), "data": sampler.state_dict()["generator"]}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, sampler: BatchSampler, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    sampler.load_state_dict({"generator": state["data"]})
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(
    root: Path, step: int, model, opt, sampler, cfg: TrainConfig, env: DistEnv, extra_meta: dict
) -> Path:
    """Write ``root/step_NNNNNN`` atomically (every rank calls this: RNG states are gathered).

    Files go to ``root/.tmp-step_NNNNNN``, are flushed to disk, and the directory is renamed into
    place; ``root/latest`` is then re-pointed with an atomic symlink swap.

    Returns:
        The checkpoint directory.
    """
    rngs = [rng_state(sampler, env.device)]
    if env.world_size > 1:
        rngs = [None] * env.world_size
        dist.all_gather_object(rngs, rng_state(sampler, env.device))
    final = root / f"step_{step:06d}"
    if env.is_main:
        tmp = root / f".tmp-{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        checkpoint.save(model, tmp, extra={"train_config": asdict(cfg), "step": step, **extra_meta})
        state = {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "optimizer": opt.state_dict(),
            "rng": rngs,
            "config": asdict(cfg),
            "world_size": env.world_size,
        }
        with checkpoint.atomic_writer(tmp / "trainer.pt") as fh:
            torch.save(state, fh)
        if final.exists():  # the same step written again (a resumed run): swap it out first
            old = root / f".old-{final.name}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        link = root / ".latest-tmp"
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        link.symlink_to(final.name)
        os.replace(link, root / "latest")
        for old in _checkpoint_dirs(root)[: -cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    if env.world_size > 1:
        dist.barrier()  # nobody resumes from, or races ahead of, a half-written checkpoint
    return final


# ---------------------------------------------------------------------------------------------
# Metrics and the plot.


class Metrics:
    """Rank 0's metrics file ``metrics.jsonl`` (one JSON object per line, ``kind`` train/val)."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None) -> None:
        self.path = path
        self.enabled = enabled
        if enabled:
            keep = []
            if resume_step is not None and path.exists():  # drop lines past the checkpoint
                keep = [
                    ln
                    for ln in path.read_text().splitlines()
                    if ln.strip() and json.loads(ln)["step"] <= resume_step
                ]
            path.write_text("".join(ln + "\n" for ln in keep))

    def write(self, **row) -> None:
        if self.enabled:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(row) + "\n")


def plot_losses(metrics_path: Path, png_path: Path, title: str) -> None:
    """Training and validation loss against step, from ``metrics.jsonl``, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning('matplotlib is not installed, no plot; pip install "tgraph[plot]"')
        return
    rows = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, style in (("train", "-"), ("val", "o-")):
        pts = [(r["step"], r["loss"]) for r in rows if r["kind"] == kind]
        if pts:
            ax.plot(*zip(*pts), style, label=f"{kind} loss", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def peak_memory_mb(device: torch.device) -> float:
    """Peak CUDA memory allocated by tensors, or the process's peak RSS on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---------------------------------------------------------------------------------------------
# The training loop.


def all_reduce_mean(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.world_size > 1:
        dist.all_reduce(t)
        t = t / env.world_size
    return t


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, env: DistEnv) -> float:
    """Mean validation loss over ``batches`` and every rank's shard."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=env.device)
    for x, y in batches:
        total += model(x.to(env.device), y.to(env.device))[1]
    model.train(was_training)
    return all_reduce_mean(total / len(batches), env).item()


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) training as configured. Every rank calls it.

    Returns:
        The run summary (also written to ``<out>/summary.json`` by rank 0).

    Raises:
        CheckpointError: ``cfg.resume`` names a missing, incomplete, damaged or mismatched
            checkpoint.
    """
    env = setup(cfg)
    try:
        return _train(cfg, env)
    finally:
        tgraph.reset()  # drop graphs and records even when training failed
        if env.owns_group:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, env: DistEnv) -> dict:
    run = Path(cfg.out)
    ckpt_root = run / "checkpoints"
    resume_dir = resolve_resume(cfg)
    state = read_checkpoint(resume_dir, cfg, env.world_size) if resume_dir else None
    start = state["step"] if state else 0
    if state and start >= cfg.steps:
        raise CheckpointError(
            f"checkpoint {resume_dir} is at step {start}, already >= "
            f"--steps {cfg.steps}: nothing to do"
        )

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = GPT(cfg.gpt_config()).to(env.device)
    if resume_dir:
        load_model_weights(model, resume_dir)
    torch.manual_seed(cfg.seed + 1 + env.rank)  # per-rank dropout stream
    data_kw = dict(
        val_fraction=cfg.val_fraction,
        rank=env.rank,
        world_size=env.world_size,
        include_tests=cfg.include_tests,
    )
    sampler = BatchSampler(
        load_split("train", **data_kw),
        cfg.batch_size,
        cfg.block_size,
        seed=cfg.seed + 100_003 * (env.rank + 1),
    )
    val_batches = fixed_batches(
        load_split("val", **data_kw), cfg.batch_size, cfg.block_size, cfg.eval_batches
    )
    opt = make_optimizer(model, cfg, env.device)
    if state:
        opt.load_state_dict(state["optimizer"])
        tensor_lrs(opt, env.device)
        set_rng_state(state["rng"][env.rank], sampler, env.device)
        logger.info("resumed from %s at step %d", resume_dir, start)

    # Data parallelism. Eager and per-layer graphs use DDP: per-layer graphs return parameter
    # gradients through autograd, so DDP's hooks fire as usual. A full-iteration graph holds the
    # whole step, and DDP's reducer (Python-side bucketing, rebuilt after the first iterations)
    # does not belong in one: it all-reduces a flat gradient buffer itself, inside the graph.
    params = list(model.parameters())
    net: torch.nn.Module = model
    if env.world_size > 1 and cfg.graph != "full":
        net = DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
    elif env.world_size > 1:
        for p in params:
            dist.broadcast(p.data, src=0)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        _, loss = net(x, y)
        loss.backward()
        if env.world_size > 1 and cfg.graph == "full":
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # one all-reduce in all
            dist.all_reduce(flat)
            flat /= env.world_size
            for p, chunk in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(chunk.view_as(p))
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip, foreach=True)
        opt.step()
        return loss.detach()

    step_fn = train_step
    full_graph = None
    if cfg.graph == "layer":
        tgraph.enable(net, backend=cfg.backend)
    elif cfg.graph == "full":
        full_graph = tgraph.FullIterationGraph(
            lambda batch: train_step(*batch), warmup_steps=FULL_WARMUP, backend=cfg.backend
        )
        step_fn = lambda x, y: full_graph((x, y))  # noqa: E731

    if env.is_main:
        run.mkdir(parents=True, exist_ok=True)
        resolved = {
            "world_size": env.world_size,
            "device": str(env.device),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "corpus": dataclasses.asdict(
                corpus_stats(val_fraction=cfg.val_fraction, include_tests=cfg.include_tests)
            ),
            "resumed_from": str(resume_dir) if resume_dir else None,
            "gpt": cfg.gpt_config().to_dict(),
        }
        (run / "config.json").write_text(
            json.dumps({"train": asdict(cfg), "resolved": resolved}, indent=2) + "\n"
        )
    metrics = Metrics(run / "metrics.jsonl", env.is_main, start if state else None)
    tokens_per_step = cfg.batch_size * cfg.block_size * env.world_size
    bar = None
    if env.is_main and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=f"train ({cfg.graph})", unit="step")

    def sync() -> None:
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)

    capture_s = 0.0
    intervals: list[tuple[float, bool]] = []  # (ms per step, interval contained a capture)
    # The first interval is never steady state (first-call overheads, recording, capture).
    loss_sum, n_sum, dirty = torch.zeros((), device=env.device), 0, True
    last_train = last_val = float("nan")
    sync()
    wall0 = t0 = time.perf_counter()
    for step in range(start, cfg.steps):
        lr = lr_at(step, cfg)
        set_lr(opt, lr)
        x, y = sampler.next()
        x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
        tc = time.perf_counter()
        loss = step_fn(x, y)
        if full_graph is not None and step - start == FULL_WARMUP:
            sync()  # this call captured the graph (and replayed it once: this step's update)
            capture_s, dirty = time.perf_counter() - tc, True
        if cfg.graph == "layer" and step == start:
            # Record one validation forward too (eval mode, no grad, validation's batch shape),
            # so create_graphs() captures a graph for it and validation replays instead of
            # falling back to eager with a warning. Its loss is discarded; it draws no RNG.
            evaluate(model, val_batches[:1], env)
            report = tgraph.create_graphs()
            capture_s, dirty = report.seconds, True  # create_graphs() logs the report
        loss_sum += loss
        n_sum += 1
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            last_train = all_reduce_mean(loss_sum / n_sum, env).item()  # syncs the device
            dt = time.perf_counter() - t0
            ms = 1000 * dt / n_sum
            intervals.append((ms, dirty))
            row = dict(
                kind="train",
                step=done,
                loss=last_train,
                lr=lr,
                ms_per_step=ms,
                tokens_per_s=tokens_per_step * n_sum / dt,
                peak_mem_mb=peak_memory_mb(env.device),
                graph=cfg.graph,
                capture_s=capture_s,
            )
            metrics.write(**row)
            if bar is not None:
                bar.set_postfix(loss=f"{last_train:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
            loss_sum, n_sum, dirty = torch.zeros((), device=env.device), 0, False
        if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
            last_val = evaluate(model, val_batches, env)
            metrics.write(kind="val", step=done, loss=last_val, graph=cfg.graph)
            logger.info("step %d: val loss %.4f", done, last_val)
        if (cfg.ckpt_every and done % cfg.ckpt_every == 0) or done == cfg.steps:
            save_checkpoint(ckpt_root, done, model, opt, sampler, cfg, env, {"val_loss": last_val})
        if bar is not None:
            bar.update(1)
        if done % cfg.log_every == 0:
            sync()  # the next interval starts after validation and checkpoint work
            t0 = time.perf_counter()
        elif done % cfg.log_every and (
            (cfg.eval_every and done % cfg.eval_every == 0)
            or (cfg.ckpt_every and done % cfg.ckpt_every == 0)
        ):
            dirty = True  # validation or a checkpoint inside the interval: not steady state
    wall = time.perf_counter() - wall0
    if bar is not None:
        bar.close()
    steady = [ms for ms, d in intervals if not d] or [ms for ms, _ in intervals]
    ms_med = statistics.median(steady) if steady else float("nan")
    summary = {
        "graph": cfg.graph,
        "device": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu",
        "world_size": env.world_size,
        "steps": cfg.steps,
        "resumed_at": start,
        "tokens_per_step": tokens_per_step,
        "median_ms_per_step": ms_med,
        "tokens_per_s": 1000 * tokens_per_step / ms_med,
        "final_train_loss": last_train,
        "final_val_loss": last_val,
        "capture_s": capture_s,
        "peak_mem_mb": peak_memory_mb(env.device),
        "wall_s": wall,
        "torch": torch.__version__,
    }
    if env.is_main:
        (run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_losses(
            run / "metrics.jsonl",
            run / "loss.png",
            f"toy GPT on stdlib bytes, --graph {cfg.graph} ({summary['device']})",
        )
        logger.info("done: %s", json.dumps(summary))
    if cfg.graph == "layer":
        tgraph.disable(net)
    return summary


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(argv)
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        train(cfg)
    except (CheckpointError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
