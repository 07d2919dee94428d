"""Host (Python) time of a per-layer graphed training step (issue 16's B1 goal).

    python scripts/profile_host.py                          # CPU, emulated graphs, compute tiny
    python scripts/profile_host.py --profile                # + cProfile of tgraph's own code
    python scripts/profile_host.py --device cuda --backend cuda --full      # d256 T128: issue 16
    python scripts/profile_host.py --device cuda --backend cuda --n-embd 32 --seq 8  # host-bound

Builds the toy GPT (12 layers, batch 1; on the CPU width 32 and 8 tokens by default, so that
the model's math is negligible and tgraph's Python dominates), enables per-layer graphs,
records one training step, ``tgraph.create_graphs()``, captures the optimizer step as a
:class:`tgraph.OptimizerGraph` (``--optimizer graph``, the default; ``eager``: fused AdamW
eagerly; ``none``: forward and backward only), then times ``--steps`` steps ``--reps`` times and
reports the median per-step wall time. On CUDA the loop synchronizes only once, after its last
step, so host and GPU overlap as in training: the wall time per step is the larger of the two
plus the GPU's waits for launches (``--n-embd 32 --seq 8`` makes the GPU's share negligible:
then it is the host's time). On the lent H200 (gVisor) the host's speed varied by about 15%
between reps and runs: compare versions in alternating runs, several each.

On the emulated backend a replay re-runs the captured Python (a GPU replay is one launch), so
the steps are timed again with every ``EmulatedGraph.replay`` made a no-op ("host path,
emulated replays off"): what remains is the code that runs on both backends (call keys,
template fill, flight and ledger bookkeeping, the autograd node, the gradient hand-off) plus
the eager embedding, head, loss and their backward around the blocks. That is the number to
cut; the static buffers keep their values, so the same code runs on the same numbers.

``--profile`` runs cProfile over one more run (emulated replays off) and lists the functions
of tgraph's own files by self time (tottime) per step, and the per-file totals.
``--full`` also times the whole step captured as one :class:`tgraph.FullIterationGraph` and
prints the ratio (issue 16: per-layer + optimizer graph <= 1.15x full at B1).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE)]  # tgraph, uninstalled

import tgraph  # noqa: E402
from tgraph import backend as tgraph_backend  # noqa: E402
from tgraph.toy.gpt import GPT, GPTConfig  # noqa: E402

TGRAPH_DIR = os.path.dirname(os.path.abspath(tgraph.__file__))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--backend", default="emulated", choices=["emulated", "cuda", "auto"])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=None, help="default 32 (cpu), 256 (cuda)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=None, help="default 8 (cpu), 128 (cuda)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument(
        "--steps", type=int, default=None, help="timed steps per rep (200 cpu, 500 cuda)"
    )
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--optimizer", default="graph", choices=["graph", "eager", "none"])
    p.add_argument("--no-merge", action="store_true", help="tgraph.enable(merge=False)")
    p.add_argument("--profile", action="store_true", help="cProfile tgraph's functions")
    p.add_argument("--top", type=int, default=30, help="functions listed by --profile")
    p.add_argument("--full", action="store_true", help="also time a FullIterationGraph step")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    a.n_embd = a.n_embd or (256 if cuda else 32)
    a.seq = a.seq or (128 if cuda else 8)
    a.steps = a.steps or (500 if cuda else 200)
    return a


@contextlib.contextmanager
def stubbed_replays():
    """Make ``EmulatedGraph.replay`` a no-op: the step's host path without the emulated
    backend's re-execution of the captured Python (what a GPU replays in one launch). The
    static buffers keep their values, so the step runs the same code with the same numbers."""
    orig = tgraph_backend.EmulatedGraph.replay
    tgraph_backend.EmulatedGraph.replay = lambda graph: None
    try:
        yield
    finally:
        tgraph_backend.EmulatedGraph.replay = orig


def make_optimizer(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    extra = dict(fused=True, capturable=True) if device.type == "cuda" else dict(fused=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **extra)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(a: argparse.Namespace, device: torch.device):
    torch.manual_seed(a.seed)
    cfg = GPTConfig(
        vocab_size=a.vocab,
        block_size=a.seq,
        n_layer=a.layers,
        n_head=a.heads,
        n_embd=a.n_embd,
        dropout=0.0,
    )
    model = GPT(cfg).to(device).train()
    g = torch.Generator().manual_seed(a.seed + 1)
    seq = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
    x, y = seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)
    return model, x, y


def layer_setup(a: argparse.Namespace, device: torch.device):
    """The per-layer graphed step, recorded and captured; returns ``step()``."""
    model, x, y = build(a, device)
    opt = make_optimizer(model, device) if a.optimizer != "none" else None
    graph = tgraph.OptimizerGraph(opt, backend=a.backend) if a.optimizer == "graph" else None

    def step() -> torch.Tensor:
        if opt is not None and graph is None:
            opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        if graph is not None:
            graph.step(loss)  # zeroes .grad in place
        elif opt is not None:
            opt.step()
        else:
            model.zero_grad(set_to_none=True)
        return loss

    tgraph.enable(model, backend=a.backend, merge=not a.no_merge)
    step()  # the recorded iteration
    if opt is not None and graph is None:
        opt.zero_grad(set_to_none=True)
    report = tgraph.create_graphs()
    step()  # the optimizer graph's capture (warmup_steps=1)
    for _ in range(5):
        step()
    sync(device)
    return step, model, report


def full_setup(a: argparse.Namespace, device: torch.device):
    """The whole step (forward, backward, AdamW) as one FullIterationGraph."""
    model, x, y = build(a, device)
    opt = make_optimizer(model, device)

    def train_step(batch):
        opt.zero_grad(set_to_none=True)
        _, loss = model(*batch)
        loss.backward()
        opt.step()
        return loss.detach()

    graph = tgraph.FullIterationGraph(train_step, warmup_steps=2, backend=a.backend)
    for _ in range(8):
        graph((x, y))
    sync(device)
    return lambda: graph((x, y))


def time_steps(step, n: int, device: torch.device) -> float:
    """Milliseconds per step over ``n`` steps; one synchronize, after the loop."""
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync(device)
    return (time.perf_counter() - t0) / n * 1e3


def profile(step, a: argparse.Namespace) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.steps):
        step()
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    rows, files = [], {}
    for (path, line, name), (_, ncalls, tt, ct, _) in stats.items():
        if not os.path.abspath(path).startswith(TGRAPH_DIR + os.sep):
            continue
        rel = os.path.relpath(path, os.path.dirname(TGRAPH_DIR))
        rows.append((tt, ct, ncalls, f"{rel}:{line}({name})"))
        files[rel] = files.get(rel, 0.0) + tt
    n = a.steps
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"\ncProfile, {n} steps: self time (tottime) of tgraph's functions, us per step")
    print(f"  total: {total / n * 1e6:.1f} us/step (profiler overhead included)")
    print(f"\n  {'tottime':>9} {'cumtime':>9} {'calls':>7}  function")
    for tt, ct, nc, qual in rows[: a.top]:
        print(f"  {tt / n * 1e6:9.1f} {ct / n * 1e6:9.1f} {nc / n:7.1f}  {qual}")
    print("\n  per file (self time, us/step):")
    for rel, tt in sorted(files.items(), key=lambda kv: -kv[1]):
        print(f"  {tt / n * 1e6:9.1f}  {rel}")


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny tensors: threads only add noise
    print(
        f"toy GPT {a.layers} layers, d{a.n_embd}, T{a.seq}, B{a.batch}, vocab {a.vocab}, "
        f"device {device}, backend {a.backend}, optimizer {a.optimizer}, "
        f"merge {not a.no_merge}, torch {torch.__version__}"
    )
    step, _, report = layer_setup(a, device)
    print(report)
    emulated = "emulated" in report.backends
    totals = [time_steps(step, a.steps, device) for _ in range(a.reps)]
    print(f"\nper-layer graphs, {a.reps} reps x {a.steps} steps, ms/step (median, then each rep):")
    print(f"  step wall time:                  {statistics.median(totals):.4f}  {_fmt(totals)}")
    host = totals
    if emulated:
        with stubbed_replays():
            host = [time_steps(step, a.steps, device) for _ in range(a.reps)]
        print(f"  host path, emulated replays off: {statistics.median(host):.4f}  {_fmt(host)}")
    if a.profile:
        with stubbed_replays() if emulated else contextlib.nullcontext():
            profile(step, a)
    tgraph.reset()
    if a.full:
        full = full_setup(a, device)
        fruns = [time_steps(full, a.steps, device) for _ in range(a.reps)]
        f_med, l_med = statistics.median(fruns), statistics.median(totals)
        print(f"\nFullIterationGraph, ms/step: {f_med:.4f}  {_fmt(fruns)}")
        print(f"per-layer / full: {l_med / f_med:.3f}x (issue 16's goal at B1: <= 1.15x)")
    return 0


def _fmt(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.4f}" for x in xs) + "]"


if __name__ == "__main__":
    sys.exit(main())
