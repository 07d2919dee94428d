"""Host (Python) time of per-layer graphed training: per step and per graphed call.

    python scripts/profile_host.py                          # CPU, emulated graphs: toy and Llama
    python scripts/profile_host.py --model llama --profile  # + cProfile of tgraph's own code
    python scripts/profile_host.py --device cuda --backend cuda          # the same on a GPU
    python scripts/profile_host.py --device cuda --backend cuda --full   # + FullIterationGraph

Two models, each with 12 graphed layers at batch 1: the toy GPT (``tgraph/toy/gpt.py``, blocks
called with one positional tensor) and a Hugging Face ``LlamaForCausalLM`` (decoder layers
called as HF calls them: ``hidden_states`` plus ``attention_mask``, ``position_ids``, the
``position_embeddings`` tuple, ``cache``, ``use_cache``; scripts/bench_llama.py), whose final
norm is a 13th member of the stack, as ``graph_layers`` makes it (since 2026-12-07). On the CPU
width 32 and 8 tokens by default, so that the model's math is negligible and tgraph's Python
dominates. Each model: ``tgraph.enable``, one recorded training step, ``create_graphs()``, the
optimizer step as a :class:`tgraph.OptimizerGraph` (``--optimizer graph``, the default;
``eager``: fused AdamW eagerly; ``none``: forward and backward only), then ``--reps`` timings
of ``--steps`` steps (median reported). On CUDA the loop synchronizes only once, after its last
step, so host and GPU overlap as in training. Every host figure is read on one clock: on the
CPU this thread's CPU time (the other processes of a shared host do not count), on CUDA wall
time.

Per graphed call (the budget is 10 us): every ``GraphableModule`` call is timed
from dispatch to return with graph replays stubbed out (a no-op ``replay`` on the graphs'
classes: on the emulated backend a replay re-runs the captured Python, on a GPU it is a launch;
the static buffers keep their values, so the same code runs on the same numbers). Reported:
the mean over a step's calls, the first call of a step (a merged stack's head: replay, checks,
input copies, the autograd node) and the median of the later calls (a merged stack's members:
key and identity checks). The call key and the runner lookup are also timed alone on the
recorded arguments (best of 7 runs), and ``--profile`` attributes a graphed call's time to its
parts (call key, lookup and dispatch, replay-order checks, input copies, the autograd Function,
replay, merged members' checks, outputs) by cProfile's cumulative times per call; cProfile
inflates small functions, so compare the parts with each other, not with the timed total.

A JSON of every number goes to ``$OUT/profile_host.json`` (``--out``, default ``$OUT`` or
``./out``). On the lent H200 (gVisor) the host's speed varied by about 15% between reps and
runs: compare versions in alternating runs, several each.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import operator
import os
import pstats
import statistics
import sys
import time
import timeit

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]  # tgraph, uninstalled; bench_llama

import tgraph  # noqa: E402
from tgraph import signature  # noqa: E402
from tgraph.layers import manager as tgraph_module  # noqa: E402
from tgraph.toy.gpt import GPT, GPTConfig  # noqa: E402

TGRAPH_DIR = os.path.dirname(os.path.abspath(tgraph.__file__))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="both", choices=["toy", "llama", "both"])
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
    p.add_argument(
        "--whole",
        action="store_true",
        help="the model as one graphed unit, embeddings to loss (graph_layers(whole=True)'s unit)",
    )
    p.add_argument(
        "--direct",
        choices=["default", "on", "off"],
        default="default",
        help="tgraph.enable(direct_grads=None / True / False)",
    )
    p.add_argument("--profile", action="store_true", help="cProfile tgraph's functions")
    p.add_argument("--top", type=int, default=30, help="functions listed by --profile")
    p.add_argument(
        "--ops",
        action="store_true",
        help="torch.profiler (CPU activity) over 20 stubbed steps: torch's ops and autograd "
        "nodes by self CPU time, in the step and in the backward phase",
    )
    p.add_argument("--full", action="store_true", help="also time a FullIterationGraph step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT", "out"), help="default: $OUT or ./out")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    a.n_embd = a.n_embd or (256 if cuda else 32)
    a.seq = a.seq or (128 if cuda else 8)
    a.steps = a.steps or (500 if cuda else 100)
    return a


@contextlib.contextmanager
def stubbed_replays():
    """Make ``replay`` of every captured graph's class a no-op: the step's host path without
    the replays themselves (module docstring)."""
    units = tgraph_module._manager.units
    graphs = [g for u in units for g in (u.cap.fwd_graph, u.cap.bwd_graph)]
    classes = {type(g) for g in graphs if g is not None}
    saved = {cls: cls.replay for cls in classes}
    for cls in classes:
        cls.replay = _no_replay
    try:
        yield
    finally:
        for cls, replay in saved.items():
            cls.replay = replay


def _no_replay(graph) -> None:
    return None


def make_optimizer(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    extra = dict(fused=True, capturable=True) if device.type == "cuda" else dict(fused=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **extra)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(a: argparse.Namespace, device: torch.device):
    torch.manual_seed(a.seed)
    if a.model == "llama":
        from bench_llama import LlamaLM

        dims = dict(n_layer=a.layers, n_embd=a.n_embd, n_head=a.heads, seq=a.seq)
        model = LlamaLM(dims, a.vocab).to(device).train()
        return model, *_tokens(a, device)
    cfg = GPTConfig(
        vocab_size=a.vocab,
        block_size=a.seq,
        n_layer=a.layers,
        n_head=a.heads,
        n_embd=a.n_embd,
        dropout=0.0,
    )
    model = GPT(cfg).to(device).train()
    return model, *_tokens(a, device)


def _tokens(a: argparse.Namespace, device: torch.device):
    g = torch.Generator().manual_seed(a.seed + 1)
    seq = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
    return seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)


def layer_setup(a: argparse.Namespace, device: torch.device):
    """The per-layer graphed step, recorded and captured; returns ``step()``."""
    model, x, y = build(a, device)
    opt = make_optimizer(model, device) if a.optimizer != "none" else None
    graph = (
        tgraph.OptimizerGraph(opt, skip_nonfinite=True, backend=a.backend)
        if a.optimizer == "graph"
        else None
    )

    def step() -> torch.Tensor:
        t0 = clock()
        if opt is not None and graph is None:
            opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        t1 = clock()
        loss.backward()
        t2 = clock()
        if graph is not None:
            graph.step(loss)  # zeroes .grad in place
        elif opt is not None:
            opt.step()
        else:
            model.zero_grad(set_to_none=True)
        if PHASES is not None:
            for k, v in zip(("forward", "backward", "optimizer"), (t1 - t0, t2 - t1, clock() - t2)):
                PHASES[k] += v
        return loss

    if a.whole:
        model.__class__ = tgraph.GraphableModule.of(type(model))
    tgraph.enable(
        model,
        backend=a.backend,
        merge=not a.no_merge,
        direct_grads={"default": None, "on": True, "off": False}[a.direct],
    )
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


# The clock of every host figure: on the CPU this thread's CPU time (a shared host's other
# processes do not count), on CUDA wall time (the GPU runs asynchronously). set by main().
clock = time.perf_counter


def time_steps(step, n: int, device: torch.device) -> float:
    """Milliseconds per step over ``n`` steps; one synchronize, after the loop."""
    t0 = clock()
    for _ in range(n):
        step()
    sync(device)
    return (clock() - t0) / n * 1e3


class CallTimer:
    """Times every graphed call (``tgraph.layers.manager._Manager.call``, dispatch to return) and keeps
    the last step's arguments of the first two graphed modules (to time the key alone)."""

    def __init__(self) -> None:
        self.steps: list[list[float]] = []  # per step, each call's seconds in call order
        self.samples: list[tuple] = []  # (module, state, args, kwargs) of calls 0 and 1

    @contextlib.contextmanager
    def on(self):
        orig = tgraph_module._Manager.call

        def timed(manager, module, state, args, kwargs):
            t0 = clock()
            out = orig(manager, module, state, args, kwargs)
            self.steps[-1].append(clock() - t0)
            if len(self.steps) == 1 and len(self.samples) < 2:
                self.samples.append((module, state, args, kwargs))
            return out

        tgraph_module._Manager.call = timed
        try:
            yield
        finally:
            tgraph_module._Manager.call = orig

    def run(self, step, n: int) -> None:
        for _ in range(n):
            self.steps.append([])
            step()

    def summary(self) -> dict:
        calls = [c for st in self.steps for c in st]
        first = [st[0] for st in self.steps if st]
        later = [c for st in self.steps for c in st[1:]]
        n = statistics.median(len(st) for st in self.steps)
        gap = _clock_cost()  # what reading the clock twice adds to each timed call
        head = statistics.median(first) - gap
        rest = statistics.median(later) - gap if later else head
        return {
            "calls_per_step": n,
            # medians: the host's hiccups (other processes, the garbage collector) skew means
            "per_call_us": (head + (n - 1) * rest) / n * 1e6,
            "first_call_us": head * 1e6,
            "later_calls_us": rest * 1e6 if later else None,
            "mean_us": statistics.fmean(calls) * 1e6,
        }


def _clock_cost() -> float:
    """Median seconds between two back-to-back readings of :data:`clock`."""
    gaps = []
    for _ in range(2001):
        t0 = clock()
        gaps.append(clock() - t0)
    return statistics.median(gaps)


def _params(state):
    """The module's parameters, looked up where it holds them (as ``_Manager.call`` does)."""
    return map(operator.getitem, state.param_tables, state.param_keys)


def time_key(sample: tuple) -> dict:
    """Best-of-7 microseconds of the call key (as ``_Manager.call`` computes it) and of the
    runner lookup, on a recorded call's arguments."""
    module, state, args, kwargs = sample
    training = tuple(map(tgraph_module._TRAINING, state.submodules))
    key = signature.call_key(args, kwargs, training, [], _params(state))

    def key_once():
        tr = tuple(map(tgraph_module._TRAINING, state.submodules))
        return signature.call_key(args, kwargs, tr, [], _params(state))

    def lookup_once():
        return state.runners.get(key)

    n = 2000
    best = {
        name: min(timeit.repeat(fn, number=n, repeat=7)) / n * 1e6
        for name, fn in (("call_key_us", key_once), ("lookup_us", lookup_once))
    }
    best["kwargs"] = sorted(kwargs)
    best["tensors"] = sum(isinstance(d, tuple) and len(d) == 4 for d in key.leaves)
    best["leaves"] = len(key.leaves)
    return best


PHASES: dict[str, float] | None = None  # step_phases() sets it: the step's phases, in seconds


def step_phases(step, n: int) -> dict:
    """Microseconds per step of each phase of the step (replays stubbed): the forward (the
    graphed calls, and the model's own code around them: embeddings, masks, head, loss), the
    backward (the graphed backward, and autograd's engine: its nodes, the eager ops' backward,
    one AccumulateGrad per parameter) and the optimizer step."""
    global PHASES
    PHASES = dict.fromkeys(("forward", "backward", "optimizer"), 0.0)
    totals: dict[str, list] = {}
    import tgraph.layers.replay as bridge

    calls = tgraph_module._Manager.call
    back = bridge.GraphedCall.__dict__["backward"]
    tgraph_module._Manager.call = _timing(calls, totals.setdefault("calls", [0.0, 0]))
    bridge.GraphedCall.backward = staticmethod(
        _timing(back.__func__, totals.setdefault("bwd", [0.0, 0]))
    )
    try:
        for _ in range(n):
            step()
    finally:
        tgraph_module._Manager.call = calls
        bridge.GraphedCall.backward = back
    phases, PHASES = PHASES, None
    us = {k: v / n * 1e6 for k, v in phases.items()}
    us["forward_graphed_calls"] = totals["calls"][0] / n * 1e6
    us["backward_graphed"] = totals["bwd"][0] / n * 1e6
    us["forward_model_own"] = us["forward"] - us["forward_graphed_calls"]
    us["backward_engine_and_eager"] = us["backward"] - us["backward_graphed"]
    total = us["forward"] + us["backward"] + us["optimizer"]
    print("\n  where a step's host time goes (replays stubbed, us per step):")
    for label, key in (
        ("forward, graphed calls", "forward_graphed_calls"),
        ("forward, the model's own code", "forward_model_own"),
        ("backward, graphed (GraphedCall.backward)", "backward_graphed"),
        ("backward, engine + eager ops + AccumulateGrad", "backward_engine_and_eager"),
        ("optimizer step", "optimizer"),
    ):
        print(f"  {label:>47}: {us[key]:8.1f}  ({100 * us[key] / total:4.1f}%)")
    return us


def op_table(step, top: int) -> str:
    """torch.profiler's table of 20 stubbed steps by self CPU time (every thread: autograd's
    device thread runs the backward), printed and returned."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    print("\n  torch.profiler, 20 steps with replays stubbed (self CPU time; inflated per op):")
    print(table)
    return table


def time_checks() -> dict:
    """Best-of-7 microseconds of the fail-closed checks (what the graphs baked in, held
    outputs) per graphed module, alone, on the captured units as they are after a step."""
    from tgraph.layers import replay as bridge
    from tgraph.pool import use_counts

    units = tgraph_module._manager.units
    layers = sum(len(u.members) for u in units) or 1
    pairs = [(u.cap, u.state) for u in units]

    def checks():  # as bridge.refusal runs them
        for cap, state in pairs:
            bridge.check(cap, state)
            if use_counts(state.outputs.cdata) != state.outputs.uses:
                bridge.move_out_held_outputs(cap, state)

    n = 500
    per_step = min(timeit.repeat(checks, number=n, repeat=7)) / n * 1e6
    baked = [c.baked for c, _ in pairs if c.baked is not None]
    return {
        "checks_us_per_module": per_step / layers,
        "attributes_checked": sum(len(s.keys) for b in baked for s in b.attrs),
        "tensors_checked": sum(len(b.held) for b in baked),
        "hook_tables_checked": sum(len(b.hooks) for b in baked),
        "modules": layers,
        "parts_us": check_parts(pairs[0]),
    }


def check_parts(pair) -> dict:
    """Best-of-7 microseconds of each pass of ``replay.check`` on one unit (the table of
    checks in docs/BENCHMARKS.md): what each costs, so each is kept or dropped by its price."""
    from operator import getitem, is_

    from tgraph.layers import replay as bridge

    cap, state = pair
    b = cap.baked
    live = tuple(map(getitem, b.tensor_tables, b.tensor_keys))
    guards = state.layout.guards
    ptrs = bridge._ptrs_equal
    parts = {
        "whole check, epochs unmoved": lambda: bridge.check(cap, state),
        "hook tables (only when the hook epoch moved)": lambda: b.changed_hooks(scan=True),
        "globals the forwards name": lambda: (
            tuple(map(getitem, b.global_tables, b.global_keys)) == b.global_values
        ),
        "attributes and module tree (only when the module epoch moved)": lambda: (
            b.changed_tree() or b.changed_attrs()
        ),
        "tensor lookup": lambda: tuple(map(getitem, b.tensor_tables, b.tensor_keys)),
        "tensor identity": lambda: all(map(is_, live, map(bridge._deref, b.refs))),
        "addresses": (
            (lambda: tuple(map(bridge._data_ptr, live)) == b.place[0])
            if ptrs is None
            else (lambda: ptrs(list(live), b.ptr_list, b.all_indices))
        ),
        "sizes and strides (layout guard)": lambda: any(g.check(*live) for g in guards),
    }
    n = 2000
    out = {k: min(timeit.repeat(f, number=n, repeat=7)) / n * 1e6 for k, f in parts.items()}
    out["tensors"] = len(live)
    print("the head's checks, us each (best of 7):")
    for k, v in out.items():
        print(f"  {v:8.2f}  {k}" if k != "tensors" else f"  ({v} tensors)")
    return out


# Parts of a graphed call, timed by wrapping the method (inclusive: replay_path contains the
# checks, copies and the autograd Function). A part missing from this version of tgraph is
# reported as absent.
TIMED_PARTS = {
    "call_key": ("tgraph.layers.manager", None, "call_key"),
    "dispatch": ("tgraph.layers.manager", None, "replay_call"),
    "replay_path": ("tgraph.layers.replay", None, "replay"),
    "checks_replay_order": ("tgraph.pool", "PoolLedger", "unsafe_forward"),
    "checks_baked": ("tgraph.layers.replay", None, "check"),
    "checks_held_outputs": ("tgraph.layers.replay", None, "move_out_held_outputs"),
    "input_copies": ("tgraph.layers.replay", None, "copy_inputs"),
    "autograd_function": ("tgraph.layers.replay", None, "_apply"),
    "merged_member_take": ("tgraph.layers.replay", None, "take"),
    "outputs": ("tgraph.signature", "Template", "fill"),
    "backward": ("tgraph.layers.replay", "GraphedCall", "backward"),
}


@contextlib.contextmanager
def timed_parts(totals: dict[str, list]):
    """Wrap each of :data:`TIMED_PARTS`, adding ``[seconds, calls]`` into ``totals``."""
    import importlib

    undo = []
    for part, (mod_name, cls_name, attr) in TIMED_PARTS.items():
        mod = importlib.import_module(mod_name)
        owner = mod if cls_name is None else getattr(mod, cls_name, None)
        raw = None if owner is None else owner.__dict__.get(attr, getattr(owner, attr, None))
        if raw is None:
            continue
        fn = raw.__func__ if isinstance(raw, staticmethod) else getattr(owner, attr)
        acc = totals.setdefault(part, [0.0, 0])
        wrapper = _timing(fn, acc)
        had = attr in vars(owner)
        setattr(owner, attr, staticmethod(wrapper) if isinstance(raw, staticmethod) else wrapper)
        undo.append((owner, attr, raw, had))
    try:
        yield
    finally:
        for owner, attr, raw, had in reversed(undo):
            if had:
                setattr(owner, attr, raw)
            else:
                delattr(owner, attr)


def _timing(fn, acc: list):
    def timed(*args, **kwargs):
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[0] += clock() - t0
            acc[1] += 1

    return timed


def breakdown(step, n: int, calls_per_step: float) -> dict:
    """Microseconds per graphed call of each timed part over ``n`` steps (replays stubbed)."""
    totals: dict[str, list] = {}
    with timed_parts(totals):
        for _ in range(n):
            step()
    gap = _clock_cost()
    graphed = calls_per_step * n
    out: dict = {}
    for part in TIMED_PARTS:
        if part not in totals:
            out[part] = None
            continue
        sec, calls = totals[part]
        sec -= calls * gap  # the clock's own cost, once per timed call
        out[part] = {
            "us_per_graphed_call": sec / graphed * 1e6,
            "us_per_own_call": sec / calls * 1e6 if calls else None,
            "calls_per_step": calls / n,
        }
    print("\n  parts of a graphed call (timed, inclusive; us per graphed call, per own call):")
    for part, v in out.items():
        if v is None:
            print(f"  {part:>22}: absent")
        else:
            own = v["us_per_own_call"]
            print(
                f"  {part:>22}: {v['us_per_graphed_call']:8.2f}  {_us(own):>8} "
                f"({v['calls_per_step']:.0f} calls/step)"
            )
    return out


# Parts of a graphed call, by the functions cProfile sees (file suffix, function name); a
# function missing from this version of tgraph is reported as absent.
PARTS = {
    "call": ("manager.py", "call"),
    "call_key": ("signature.py", "call_key"),
    "dispatch": ("replay.py", "call"),
    "replay_path": ("replay.py", "replay"),
    "checks_baked": ("replay.py", "check"),
    "checks_replay_order": ("pool.py", "unsafe_forward"),
    "input_copies": ("replay.py", "copy_inputs"),
    "autograd_function": ("replay.py", "forward"),
    "graph_replay": ("profile_host.py", "_no_replay"),
    "merged_member_take": ("replay.py", "take"),
    "outputs": ("signature.py", "fill"),
    "live_outputs": ("pool.py", "__init__"),
    "backward": ("replay.py", "backward"),
}


def profile(step, a: argparse.Namespace, calls_per_step: float) -> dict:
    """cProfile over ``a.steps`` steps: tgraph's functions by self time per step (printed), and
    each of :data:`PARTS` as cumulative microseconds per graphed call (returned)."""
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
    graphed_calls = calls_per_step * n
    parts: dict[str, dict | None] = {}
    for part, (suffix, fname) in PARTS.items():
        found = [
            (nc, ct)
            for (path, _, name), (_, nc, _, ct, _) in stats.items()
            if name == fname and path.endswith(os.sep + suffix)
        ]
        if part == "autograd_function":  # torch's Function.apply: only GraphedCall's count
            found = found[:1]
        if not found:
            parts[part] = None
            continue
        nc, ct = sum(f[0] for f in found), sum(f[1] for f in found)
        parts[part] = {
            "us_per_graphed_call": ct / graphed_calls * 1e6,
            "calls_per_step": nc / n,
            "us_per_own_call": ct / nc * 1e6 if nc else None,
        }
    print("\n  parts of a graphed call (cProfile cumulative us per graphed call):")
    for part, v in parts.items():
        text = "absent" if v is None else f"{v['us_per_graphed_call']:8.2f}"
        print(f"  {part:>22}: {text}")
    return parts


def measure(a: argparse.Namespace, device: torch.device) -> dict:
    """Everything for one model (``a.model``): step times, per-call times, key, profile."""
    step, _, report = layer_setup(a, device)
    print(report)
    emulated = "emulated" in report.backends
    result: dict = {"report": str(report), "backends": report.backends}
    totals = [time_steps(step, a.steps, device) for _ in range(a.reps)]
    print(f"\nper-layer graphs, {a.reps} reps x {a.steps} steps, ms/step (median, then each rep):")
    print(f"  step wall time:            {statistics.median(totals):.4f}  {_fmt(totals)}")
    result["step_ms"] = statistics.median(totals)
    with stubbed_replays():
        host = [time_steps(step, a.steps, device) for _ in range(a.reps)]
        print(f"  step, replays stubbed out: {statistics.median(host):.4f}  {_fmt(host)}")
        result["step_ms_replays_stubbed"] = statistics.median(host)
        timer = CallTimer()
        with timer.on():
            timer.run(step, a.steps)
        calls = timer.summary()
        calls.update(time_key(timer.samples[0]))
        if len(timer.samples) > 1:
            calls["later_member"] = time_key(timer.samples[1])
        if tgraph_module._manager.units[0].cap is not None:
            calls["fail_closed"] = time_checks()
            fc = calls["fail_closed"]
            print(
                f"fail-closed checks alone: {fc['checks_us_per_module']:.2f} us per graphed "
                f"module ({fc['attributes_checked']} attributes, {fc['tensors_checked']} "
                f"parameters and buffers, {fc['hook_tables_checked']} hook tables in all)"
            )
        result["per_call"] = calls
        print(
            f"\nper graphed call, replays stubbed out ({calls['calls_per_step']:.0f} calls/step):"
            f" {calls['per_call_us']:.2f} us a call (first {calls['first_call_us']:.2f} us, later "
            f"{_us(calls['later_calls_us'])} us); call key alone {calls['call_key_us']:.2f} us "
            f"({calls['leaves']} leaves, {calls['tensors']} tensors), lookup "
            f"{calls['lookup_us']:.2f} us"
        )
        result["parts"] = breakdown(step, a.steps, calls["calls_per_step"])
        result["phases"] = step_phases(step, a.steps)
        if a.ops:
            result["ops"] = op_table(step, a.top)
        if a.profile:
            result["parts_cprofile"] = profile(step, a, calls["calls_per_step"])
    if not emulated:
        result["note"] = "CUDA: step_ms includes the GPU; the stubbed figures are host only"
    tgraph.reset()
    if a.full:
        full = full_setup(a, device)
        fruns = [time_steps(full, a.steps, device) for _ in range(a.reps)]
        f_med = statistics.median(fruns)
        print(f"\nFullIterationGraph, ms/step: {f_med:.4f}  {_fmt(fruns)}")
        print(f"per-layer / full: {result['step_ms'] / f_med:.3f}x")
        result["full_step_ms"] = f_med
    return result


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    global clock
    # Replays are stubbed out here: the shadow verifier would find their outputs stale (they
    # are) and leave the units eager. Its cost is measured apart (scripts/bench_verifier.py).
    tgraph.verification(first=0, every=0)
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny tensors: threads only add noise
        clock = time.thread_time
    payload: dict = {
        "args": vars(a).copy(),
        "torch": torch.__version__,
        "clock": clock.__name__,
        "models": {},
    }
    for model in ("toy", "llama") if a.model == "both" else (a.model,):
        a.model = model
        print(
            f"\n=== {model}: {a.layers} layers, d{a.n_embd}, T{a.seq}, B{a.batch}, vocab "
            f"{a.vocab}, device {device}, backend {a.backend}, optimizer {a.optimizer}, "
            f"merge {not a.no_merge}, direct_grads {a.direct}, torch {torch.__version__}"
        )
        payload["models"][model] = measure(a, device)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "profile_host.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    print(f"\nwrote {path}")
    return 0


def _fmt(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.4f}" for x in xs) + "]"


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    sys.exit(main())
