"""Pipeline schedules (1F1B): recorded once, replayed fully graphed (tgraph/layers/record.py).

A 1F1B schedule runs a later microbatch's forward while an earlier one awaits its backward, at
a different point of the iteration each time. A graph replays safely only where its capture
sits in the shared pool's order (tgraph/pool.py), so the recorded iteration gives such a call a
runner of its own (one per layer and microbatch, as TransformerEngine graphs it) instead of
reusing a free runner whose graphs would overwrite an in-flight microbatch's activations. The
stages are simulated in one process: a stage's output is detached and handed to the next stage
as a leaf, and the next stage's input gradient is handed back to its backward.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from layer_models import ATOL, RTOL

import tgraph
from tgraph.layers import replay as replay_module


class Block(tgraph.GraphableModule):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Stage(nn.Module):
    def __init__(self, n_blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def one_f_one_b(n_stages: int, n_micro: int) -> list[tuple[str, int, int]]:
    """The 1F1B schedule of every stage (``warmup`` forwards, then one forward and one
    backward in turn, then the remaining backwards), merged into one order that respects the
    dependencies between stages: ``(kind, stage, microbatch)``."""
    per_stage = []
    for s in range(n_stages):
        warm = min(n_stages - s - 1, n_micro)
        ops = [("F", s, i) for i in range(warm)]
        for i in range(warm, n_micro):
            ops += [("F", s, i), ("B", s, i - warm)]
        ops += [("B", s, i) for i in range(n_micro - warm, n_micro)]
        per_stage.append(ops)
    return _merge(per_stage, n_stages, n_micro)


def interleaved(n_ranks: int, n_chunks: int, n_micro: int) -> list[tuple[str, int, int]]:
    """Megatron-core's interleaved 1F1B schedule: rank r holds model chunks c = 0..v-1, the
    virtual stages ``c * p + r``; its forwards walk groups of p microbatches chunk by chunk,
    its backwards the chunks in reverse. Merged into one order as :func:`one_f_one_b`."""
    p, v = n_ranks, n_chunks
    total = n_micro * v

    def step(k: int, forward: bool) -> tuple[int, int]:  # (chunk, microbatch) of step k
        in_group = k % (p * v)
        chunk = in_group // p
        return (chunk if forward else v - chunk - 1), (k // (p * v)) * p + in_group % p

    per_rank = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        ops = [("F", *step(k, True)) for k in range(warm)]
        for i in range(total - warm):
            ops += [("F", *step(warm + i, True)), ("B", *step(i, False))]
        ops += [("B", *step(i, False)) for i in range(total - warm, total)]
        per_rank.append([(kind, c * p + r, mb) for kind, c, mb in ops])
    return _merge(per_rank, p * v, n_micro)


def _merge(per_rank, n_stages: int, n_micro: int) -> list[tuple[str, int, int]]:
    """One order of every rank's operations in which each forward follows the previous
    stage's and each backward the next stage's."""
    done: set[tuple[str, int, int]] = set()
    order, nxt = [], [0] * len(per_rank)
    while len(order) < 2 * n_stages * n_micro:
        moved = False
        for r, ops in enumerate(per_rank):
            if nxt[r] == len(ops):
                continue
            kind, s, i = ops[nxt[r]]
            before = ("F", s - 1, i) if kind == "F" else ("B", s + 1, i)
            if before in done or not 0 <= before[1] < n_stages:
                order.append(ops[nxt[r]])
                done.add(ops[nxt[r]])
                nxt[r] += 1
                moved = True
        assert moved, "the schedule deadlocks"
    return order


def gpipe(n_stages: int, n_micro: int) -> list[tuple[str, int, int]]:
    """Every forward, then every backward (last microbatch first)."""
    fwd = [("F", s, i) for i in range(n_micro) for s in range(n_stages)]
    return fwd + [("B", s, i) for i in reversed(range(n_micro)) for s in reversed(range(n_stages))]


def accumulate(n_stages: int, n_micro: int) -> list[tuple[str, int, int]]:
    """Forward then backward of each microbatch in turn (plain gradient accumulation)."""
    return [
        op
        for i in range(n_micro)
        for op in [("F", s, i) for s in range(n_stages)]
        + [("B", s, i) for s in reversed(range(n_stages))]
    ]


def run(stages: list[Stage], xs: list[torch.Tensor], order) -> list[torch.Tensor]:
    """Run ``order``; returns the last stage's outputs (detached), by microbatch."""
    ins, outs, last = {}, {}, [None] * len(xs)
    for kind, s, i in order:
        if kind == "F":
            x = xs[i] if s == 0 else outs[(s - 1, i)].detach().requires_grad_()
            ins[(s, i)], outs[(s, i)] = x, stages[s](x)
        elif s == len(stages) - 1:
            y = outs.pop((s, i))
            last[i] = y.detach().clone()
            y.square().mean().backward()
        else:
            outs.pop((s, i)).backward(ins.pop((s + 1, i)).grad)
    return last


def setup(backend, device, n_stages, n_micro, order, **options):
    torch.manual_seed(0)
    stages = [Stage().to(device) for _ in range(n_stages)]
    eager = copy.deepcopy(stages)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 16, generator=g).to(device) for _ in range(n_micro)]
    for s in stages:
        tgraph.enable(s, backend=backend, **options)
    run(stages, xs, order)  # the recorded iteration
    for s in stages:
        s.zero_grad(set_to_none=True)
    return stages, eager, xs, tgraph.create_graphs()


def assert_same(stages, eager, got, want, exact):
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got, want, **tol)
    for a, b in zip(stages, eager):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=name)


@pytest.mark.parametrize(
    "n_stages, n_micro, schedule",
    [
        (2, 4, one_f_one_b),
        (3, 5, one_f_one_b),
        (4, 4, lambda stages, micro: interleaved(2, 2, micro)),  # 2 ranks x 2 chunks
    ],
    ids=["1f1b-2x4", "1f1b-3x5", "interleaved-2x2x4"],
)
def test_recorded_1f1b_schedule_replays_fully_graphed(backend, device, n_stages, n_micro, schedule):
    order = schedule(n_stages, n_micro)
    stages, eager, xs, report = setup(backend, device, n_stages, n_micro, order, strict=True)
    # at most one runner per block and microbatch: a free runner is reused only where its
    # graphs cannot overwrite an in-flight microbatch's activations
    assert report.runners <= n_stages * n_micro * 2
    for _ in range(3):  # strict=True: a call that does not replay raises GraphFallbackError
        for m in stages + eager:
            m.zero_grad(set_to_none=True)
        got = run(stages, xs, order)
        want = run(eager, xs, order)
        assert_same(stages, eager, got, want, exact=backend == "emulated")


def test_gradient_accumulation_keeps_one_runner_per_block(backend, device):
    """Forward, backward, forward, ...: nothing is in flight at a reuse, so one runner each."""
    if not hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        pytest.skip("stage 0's output is still held at its next call; PyTorch < 2.13 cannot "
                    "move it out of the graph's memory, and the call runs eagerly (strict raises)")  # fmt: skip
    order = accumulate(2, 3)
    stages, eager, xs, report = setup(backend, device, 2, 3, order, strict=True)
    assert report.runners == 2 * 2
    got, want = run(stages, xs, order), run(eager, xs, order)
    assert_same(stages, eager, got, want, exact=backend == "emulated")


@pytest.mark.parametrize("replayed", [gpipe, accumulate])
def test_an_order_other_than_the_recorded_1f1b_is_exact_or_detected(backend, device, replayed):
    """Recorded 1F1B, replayed in another order: each call replays where that is safe for the
    pool, runs eagerly with a warning that names the order, or raises ReplayOrderError; the
    gradients are eager's in every case where it does not raise."""
    stages, eager, xs, _ = setup(backend, device, 2, 4, one_f_one_b(2, 4))
    order = replayed(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tgraph.GraphFallbackWarning)
        try:
            got = run(stages, xs, order)
        except tgraph.ReplayOrderError:
            return
    want = run(eager, xs, order)
    assert_same(stages, eager, got, want, exact=backend == "emulated")
    for w in caught:
        assert "more calls in flight" not in str(w.message), w.message


def test_the_fallback_warning_names_the_order_not_a_busy_runner(backend, device):
    """Two runners of one block: the first free but unsafe for the pool's order, the second
    awaiting its backward. The warning names the order, the real cause (not 'more calls in
    flight than in the recorded iteration', which is false: as many are in flight as
    recorded)."""
    torch.manual_seed(0)
    block = Block().to(device)
    tgraph.enable(block, backend=backend)
    x1, x2, x3 = torch.randn(3, 4, 16, device=device)
    (block(x1) + block(x2)).sum().backward()  # recorded: fwd A, fwd B, bwd B, bwd A
    tgraph.create_graphs()
    y1, y2 = block(x1), block(x2)
    y1.sum().backward()  # A lands first: A's graphs now may overwrite B's activations
    with pytest.warns(tgraph.GraphFallbackWarning, match="replay order differs") as caught:
        y3 = block(x3)
    assert not any("more calls in flight" in str(w.message) for w in caught)
    torch.testing.assert_close(y3, torch.nn.Module.__call__(block, x3), rtol=0, atol=0)
    with pytest.raises(tgraph.ReplayOrderError):  # A's backward overwrote B's activations
        y2.sum().backward()


def test_replays_take_the_recorded_runner_first(backend, device, monkeypatch):
    """Each call tries first the runner the recorded call at its place took: a 1F1B step
    replays without trying (and having the pool refuse) the runners of earlier microbatches,
    which would cost a check of what their graphs baked in each time."""
    order = one_f_one_b(2, 8)
    stages, _, xs, _ = setup(backend, device, 2, 8, order, strict=True)
    tried, replayed = [], []
    real_refusal, real_replay = replay_module.refusal, replay_module.replay

    def asked(cap, state, tensors):
        tried.append(cap)
        return real_refusal(cap, state, tensors)

    def replaying(cap, state, tensors):
        replayed.append(cap)
        return real_replay(cap, state, tensors)

    monkeypatch.setattr(replay_module, "refusal", asked)
    monkeypatch.setattr(replay_module, "replay", replaying)
    for _ in range(2):
        run(stages, xs, order)
    assert len(replayed) == 2 * 2 * 8  # a merged stack per stage and microbatch, 2 steps
    assert len(tried) == len(replayed)
