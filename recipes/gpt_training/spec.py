"""The model seam: what a recipe brings to the shared trainer (torchtitan's model specs).

A :class:`ModelSpec` builds the model, computes its loss, turns graphs on and off for its layers,
and writes and reads the model part of a checkpoint. It may also bring its own optimizer,
learning-rate schedule and step (``recipes/train_megatron_gpt.py``: megatron-core's); by default
they are AdamW (``optim``) and ``step.TrainStep``. Everything else (the loop, the data,
``trainer.pt``, the run directory's rules, metrics, Ctrl-C, torchrun) is the trainer's and the
same for every recipe. :data:`GPT_SPEC` is the toy GPT's (``recipes/train_gpt.py``);
``recipes/train_hf.py`` declares a transformers causal LM's.

The model part of a checkpoint carries a manifest with the sha256 of every tensor and an
``extra`` entry, in which the trainer records ``trainer.pt``'s sha256: nothing resumes unverified.
The toy GPT's manifest is ``tgraph.toy.checkpoint``'s ``config.json``; a model that owns
``config.json`` (transformers' ``save_pretrained``) uses :func:`write_manifest` and
:func:`read_manifest` (``checkpoint.json`` beside its ``*.safetensors`` files; it records the
sha256 of that ``config.json`` too).
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import tgraph
from tgraph.toy import checkpoint
from tgraph.toy.checkpoint import CheckpointError
from tgraph.toy.gpt import GPT, graph_whole

MANIFEST_NAME = "checkpoint.json"
MANIFEST_FORMAT = "tgraph-safetensors-manifest"


class ModelError(ValueError):
    """The model the command line asks for cannot be built (exit code 2, like a bad argument)."""


class ModelSpec:
    """A recipe's model, as the trainer sees it. Subclasses override every method."""

    title = "model"  # the log line's name for it ("training a 0.80M-parameter GPT")
    plot_name = "model"  # the loss plot's
    recipe = "this recipe"  # the script that writes its checkpoints (for error messages)
    manifest_name = MANIFEST_NAME  # the file recording the checksums
    clip_in_optimizer_order = False  # sum the gradient norm in the optimizer's parameter order

    def check(self, cfg) -> None:
        """Refuse a model ``cfg`` cannot build with :class:`ModelError`; the trainer calls it
        before it writes anything (default: every config the command line accepts builds)."""

    def build(self, cfg, device: torch.device) -> torch.nn.Module:
        """The model of ``cfg`` on ``device``, in training mode (the trainer seeds torch first)."""
        raise NotImplementedError

    def loss(self, net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of ``net`` (the model or its DDP wrapper) on ``x`` -> ``y``."""
        raise NotImplementedError

    def whole_step_loss(
        self, net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`loss` inside the ``--graph full`` step (its warmup calls and its capture), the
        same numbers. A model whose Python branches on a capture under way overrides it."""
        return self.loss(net, x, y)

    def enable_graphs(self, net: torch.nn.Module, backend: str, compile: bool = False) -> None:  # noqa: A002
        """Per-layer graphs (``--graph layer``): the next step records, ``create_graphs``;
        ``compile``: over each unit's compiled code (``--compile``, where offered)."""
        raise NotImplementedError

    def enable_model_graph(
        self,
        net: torch.nn.Module,
        backend: str,
        compile: bool = False,  # noqa: A002
    ) -> None:
        """The whole model as one graphed unit (``--graph model``, where offered)."""
        raise NotImplementedError

    def disable_graphs(self, net: torch.nn.Module) -> None:
        raise NotImplementedError

    def save_weights(self, model: torch.nn.Module, directory: Path, extra: dict) -> None:
        """Write the weights and their manifest (``extra`` in it) into ``directory``."""
        raise NotImplementedError

    def read_extra(self, directory: Path) -> dict | None:
        """The manifest's ``extra``. Raises FileNotFoundError or CheckpointError."""
        raise NotImplementedError

    def load_weights(self, model: torch.nn.Module, directory: Path) -> None:
        """Verify the weights against the manifest and copy them into ``model`` (strictly)."""
        raise NotImplementedError

    def check_resume(self, cfg, directory: Path) -> None:
        """Refuse (``RunDirectoryError``) to resume checkpoint ``directory`` where ``cfg`` builds
        another model than the one it holds, in a way the trainer's config comparison cannot see
        (a config file edited since); called before anything is written (default: nothing)."""

    def resolved(self, cfg, model: torch.nn.Module) -> dict:
        """What the model resolved to, for the run's ``config.json``."""
        return {}

    # -- the optimizer and the step: AdamW and ``step.TrainStep`` unless a recipe brings its own

    def make_optimizer(self, model: torch.nn.Module, cfg, device: torch.device):
        """The optimizer; ``state_dict()`` / ``load_state_dict()`` are its part of ``trainer.pt``."""
        from .optim import make_optimizer

        return make_optimizer(model, cfg, device)

    def load_optimizer(self, opt, state, device: torch.device) -> None:
        """Restore what ``opt.state_dict()`` saved (a resumed run)."""
        from .optim import tensor_lrs

        opt.load_state_dict(state)
        tensor_lrs(opt, device)

    def set_lr(self, opt, step: int, cfg, decay_steps: int) -> float:
        """Give ``opt`` the learning rate of step ``step`` (0-based); returns it."""
        from .optim import lr_at, set_lr

        lr = lr_at(step, cfg, decay_steps)
        set_lr(opt, lr)
        return lr

    def make_step(self, cfg, model: torch.nn.Module, opt, env, record_eval):
        """The training step of ``cfg.graph`` (``step.make_step``): ``step(x, y) -> StepOutput``,
        ``step.backend``, ``step.report()`` (extra metrics) and ``step.close()``."""
        from .step import make_step

        return make_step(cfg, model, opt, env, record_eval, self)


class GPTSpec(ModelSpec):
    """The toy GPT (``tgraph.toy.gpt``), its checkpoints ``tgraph.toy.checkpoint``'s."""

    title = "GPT"
    plot_name = "toy GPT"
    recipe = "recipes/train_gpt.py"
    manifest_name = checkpoint.CONFIG_NAME

    def build(self, cfg, device):
        return GPT(cfg.gpt_config()).to(device)

    def loss(self, net, x, y):
        return net(x, y)[1]

    def enable_graphs(self, net, backend, compile=False):  # noqa: A002 - enable's option
        tgraph.enable(net, backend=backend, compile=compile)

    def enable_model_graph(self, net, backend, compile=False):  # noqa: A002
        graph_whole(net.module if isinstance(net, DDP) else net)
        tgraph.enable(net, backend=backend, compile=compile)

    def disable_graphs(self, net):
        tgraph.disable(net)

    def save_weights(self, model, directory, extra):
        checkpoint.save(model, directory, extra=extra)

    def read_extra(self, directory):
        return checkpoint.read_config(directory)[1]

    def load_weights(self, model, directory):
        checkpoint.load_into(model, directory, require_checksums=True)

    def resolved(self, cfg, model):
        return {"gpt": cfg.gpt_config().to_dict()}


GPT_SPEC = GPTSpec()


# -- a manifest beside safetensors files another library wrote --------------------------------


def _weight_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def write_manifest(directory: Path, extra: dict, files: tuple[str, ...] = ()) -> None:
    """Record the sha256 of every tensor in ``directory``'s ``*.safetensors`` files, of the
    other ``files`` named (a ``config.json`` the model is read with), and ``extra``, in
    ``directory/checkpoint.json`` (written last, atomically)."""
    from safetensors.torch import load_file

    sha = {}
    for f in _weight_files(directory):
        sha[f.name] = {k: checkpoint.tensor_sha256(t) for k, t in load_file(str(f)).items()}
    if not sha:
        raise CheckpointError(f"{directory}: no *.safetensors files were written")
    body = {"format": MANIFEST_FORMAT, "version": 1, "sha256": sha, "extra": extra}
    if files:
        body["files"] = {n: hashlib.sha256((directory / n).read_bytes()).hexdigest() for n in files}
    checkpoint.atomic_write_bytes(
        directory / MANIFEST_NAME, (json.dumps(body, indent=2) + "\n").encode()
    )


def read_manifest(directory: Path) -> dict:
    """``directory/checkpoint.json`` as written by :func:`write_manifest`.

    Raises:
        FileNotFoundError: no directory or no manifest.
        CheckpointError: the manifest is not valid JSON or not one of ours.
    """
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {directory} has no {MANIFEST_NAME}")
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the file is corrupt") from e
    if not (isinstance(body, dict) and body.get("format") == MANIFEST_FORMAT):
        raise CheckpointError(f"{path} is not a checkpoint manifest ({MANIFEST_FORMAT!r})")
    if not isinstance(body.get("sha256"), dict):
        raise CheckpointError(f"{path} records no sha256 checksums; the file is corrupt")
    return body


def verify_files(directory: Path, body: dict | None = None) -> None:
    """Check the files besides the weights that ``directory``'s manifest (``body``, read when
    None) records (``write_manifest(files=...)``: a transformers ``config.json``) against their
    sha256. A manifest that records none (an older save) checks nothing.

    Raises:
        FileNotFoundError: no manifest.
        CheckpointError: a recorded file missing or changed.
    """
    body = read_manifest(directory) if body is None else body
    recorded = body.get("files", {})
    if not isinstance(recorded, dict):
        raise CheckpointError(f"{directory / MANIFEST_NAME} records no file checksums it can read")
    for name, digest in sorted(recorded.items()):
        path = directory / name
        if not path.is_file():
            raise CheckpointError(
                f"{path} is missing (its sha256 is recorded in {MANIFEST_NAME}); the checkpoint "
                "was edited"
            )
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise CheckpointError(
                f"{path} is corrupt: its sha256 differs from the one recorded in "
                f"{MANIFEST_NAME} when it was saved (damaged on disk or edited after saving)"
            )


def load_verified(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``directory``'s ``*.safetensors`` files, each checked against the sha256
    recorded in its manifest (and the other files it records: :func:`verify_files`).

    Raises:
        FileNotFoundError: no manifest.
        CheckpointError: an unreadable file, a file or tensor added, missing or changed.
    """
    from safetensors.torch import load_file

    body = read_manifest(directory)
    verify_files(directory, body)
    recorded = body["sha256"]
    files = {f.name: f for f in _weight_files(directory)}
    if set(files) != set(recorded):
        raise CheckpointError(
            f"checkpoint {directory} holds the weight files {sorted(files)} but its "
            f"{MANIFEST_NAME} records {sorted(recorded)}; the directory was edited"
        )
    state = {}
    for name, f in files.items():
        try:
            tensors = load_file(str(f), device="cpu")
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(
                f"{f} is not a readable safetensors file ({type(e).__name__}: {e}); the "
                "checkpoint is corrupt or truncated"
            ) from e
        want = recorded[name] if isinstance(recorded[name], dict) else {}
        checkpoint.check_digests(tensors, want, f, MANIFEST_NAME)
        state.update(tensors)
    return state


def saved_form(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s tensors under the names a checkpoint of it holds: its ``state_dict()``, but
    for a transformers model whose weights ``save_pretrained`` writes in another layout than
    it holds them (transformers 5 keeps an MoE layer's experts fused, ``experts.gate_up_proj``,
    and writes them one by one, ``experts.0.gate_proj.weight``), the layout written: its
    conversion mapping reversed, as ``save_pretrained`` computes it."""
    state = model.state_dict()
    hf = sys.modules.get("transformers")  # a transformers model has imported it
    if hf is None or not isinstance(model, hf.PreTrainedModel):
        return state
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4 writes every weight as it holds it
        return state
    return revert_weight_conversion(model, state)


def load_verified_into(model: torch.nn.Module, directory: Path) -> None:
    """Copy the weights of ``directory`` (``*.safetensors`` and their manifest) into ``model``,
    each verified first (:func:`load_verified`): names and shapes strictly, against the layout
    the model saves (:func:`saved_form`), except the tied weights ``save_pretrained`` leaves out
    (gpt2's ``lm_head``), which share a loaded tensor. A layout other than the model's own (fused
    MoE experts) is converted by transformers' loading (``from_pretrained``), and the model must
    then save back to exactly the verified tensors.

    Raises:
        FileNotFoundError: no manifest.
        CheckpointError: damaged or edited files, or weights another model's.
    """
    state = load_verified(directory)
    own = model.state_dict()
    saved = saved_form(model)
    shapes = [k for k in saved.keys() & state.keys() if saved[k].shape != state[k].shape]
    # load_state_dict would cast integers into a float weight silently (an edited header)
    shapes += [
        k
        for k in saved.keys() & state.keys()
        if saved[k].is_floating_point() != state[k].is_floating_point()
    ]
    unexpected = sorted(state.keys() - saved.keys())
    if shapes or unexpected:
        raise CheckpointError(
            f"checkpoint {directory} does not match the model of this run: unexpected keys "
            f"{unexpected}, shape or dtype mismatches {sorted(set(shapes))}"
        )
    loaded = {saved[k].data_ptr() for k in state}
    missing = sorted(k for k in saved.keys() - state.keys() if saved[k].data_ptr() not in loaded)
    if missing:
        raise CheckpointError(f"checkpoint {directory} lacks the weights {missing}")
    if saved.keys() == own.keys():
        model.load_state_dict(state, strict=False)
        return
    twin = type(model).from_pretrained(None, config=copy.deepcopy(model.config), state_dict=state)
    model.load_state_dict(twin.state_dict())
    again = saved_form(model)
    differ = sorted(
        k
        for k in state
        if again[k].dtype != state[k].dtype or not torch.equal(again[k].cpu(), state[k])
    )
    if differ:  # a conversion that does not invert save_pretrained's: never train on guesses
        raise CheckpointError(
            f"checkpoint {directory}: transformers' conversion of its weights to the model's "
            f"layout does not give back the saved tensors {differ[:5]}"
        )
