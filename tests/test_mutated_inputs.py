"""A forward that writes one of its inputs in place (running statistics passed as an argument,
``x.mul_(2)``): a replay writes the graph's static copy, so tgraph copies it back to the
caller's tensor, and the caller sees what eager gives."""

from __future__ import annotations

import copy

import pytest
import torch

import tgraph


class Stats(tgraph.GraphableModule):
    """Adds the batch's column sums into ``stats``, the caller's running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, stats):
        stats.add_(x.detach().sum(0))
        return self.fc(x)


class Scales(tgraph.GraphableModule):
    """Scales its (no-grad) input in place, then reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)
        return self.fc(x)


@pytest.mark.parametrize("merge", [True, False])
def test_running_stats_argument_is_written_back(backend, device, merge):
    torch.manual_seed(0)
    model = torch.nn.Sequential(Stats()).to(device)

    def run(m, graphed):
        stats = torch.zeros(4, device=device)
        history = []
        for i in range(4):
            x = torch.ones(2, 4, device=device)
            m[0](x, stats).sum().backward()
            history.append(stats.clone())
            if graphed and i == 0:
                tgraph.create_graphs()
        return history

    want = run(copy.deepcopy(model), False)
    tgraph.enable(model, backend=backend, strict=True, merge=merge)
    got = run(model, True)
    assert [h[0].item() for h in want] == [2.0, 4.0, 6.0, 8.0]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_input_scaled_in_place_is_written_back(backend, device):
    torch.manual_seed(0)
    model = Scales().to(device)
    eager = copy.deepcopy(model)
    tgraph.enable(model, backend=backend, strict=True)
    gen = torch.Generator(device=device).manual_seed(1)
    xs = [torch.randn(3, 4, device=device, generator=gen) for _ in range(4)]
    for i, x in enumerate(xs):
        a, b = x.clone(), x.clone()
        want = eager(a)
        got = model(b)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(b, a, rtol=0, atol=0)  # the caller's tensor, doubled
        got.sum().backward()
        want.sum().backward()
        if i == 0:
            tgraph.create_graphs()


class Scaled(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x, scale):
        return self.fc(x) * scale


@pytest.mark.cuda
def test_cpu_scalar_argument_of_a_cuda_graph_is_checked():
    """A CUDA kernel takes a CPU scalar tensor's value at capture: another value must not
    replay the old one. The call runs eagerly (strict mode: raises), never silently wrong."""
    model = Scaled().cuda()
    tgraph.enable(model, strict=True)
    x = torch.randn(4, 8, device="cuda")
    model(x, torch.tensor(1.5)).sum().backward()
    tgraph.create_graphs()
    y = model(x, torch.tensor(1.5))  # replays (strict)
    torch.testing.assert_close(y, model.fc(x) * 1.5)
    y.sum().backward()
    with pytest.raises(tgraph.GraphFallbackError, match="CPU scalar argument 1 is 2.5"):
        model(x, torch.tensor(2.5))


class Tempered(tgraph.GraphableModule):
    """A temperature kept as a plain CPU tensor attribute (``.cuda()`` leaves it there)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.temperature = torch.tensor(2.0)

    def forward(self, x):
        return self.fc(x) / self.temperature


@pytest.mark.cuda
def test_cpu_scalar_attribute_changed_in_place_is_not_replayed():
    """The warmup notes the host scalars the CUDA kernels read; one changed in place after
    capture (same object, so no attribute check sees it) runs eagerly instead of replaying
    the capture's value."""
    model = Tempered().cuda()
    tgraph.enable(model, strict=True)
    x = torch.randn(4, 8, device="cuda")
    model(x).sum().backward()
    tgraph.create_graphs()
    y = model(x)  # replays (strict)
    torch.testing.assert_close(y, model.fc(x) / 2.0)
    y.sum().backward()
    model.temperature.fill_(4.0)
    with pytest.raises(tgraph.GraphFallbackError, match="holds 4.0 where the graph baked in 2.0"):
        model(x)


class TemperedInDouble(Tempered):
    """The temperature kept in float64 and converted in the forward: the CUDA kernel reads a
    CPU scalar the forward made, whose value comes from the attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = torch.tensor(2.0, dtype=torch.float64)

    def forward(self, x):
        return self.fc(x) / self.temperature.float()


@pytest.mark.cuda
def test_cpu_scalar_attribute_read_through_a_conversion_changed_in_place_is_not_replayed():
    """The warmup notes the attribute a converted scalar came from (the converted one is new
    at every call, so comparing it would never see the attribute change)."""
    model = TemperedInDouble().cuda()
    tgraph.enable(model, strict=True)
    x = torch.randn(4, 8, device="cuda")
    model(x).sum().backward()
    tgraph.create_graphs()
    model(x).sum().backward()  # replays (strict)
    model.temperature.fill_(4.0)
    with pytest.raises(tgraph.GraphFallbackError, match="holds 4.0 where the graph baked in 2.0"):
        model(x)


def test_the_host_scalars_a_warmup_notes_are_state_not_what_it_made():
    """RefuseHostSync's notes (what replay.refusal compares at every call), on the meta device
    as the graph's device: a CPU scalar an operation of the pass made (an attention kernel's
    RNG seed, ``torch.tensor(5.0)``) is no state, so not noted; one made from state (a
    ``.float()``, ``(t + 1).float()``, one accumulated in place) is noted as that state; state itself, an alias of it and
    a view of a larger tensor are noted as they are (as before)."""
    from tgraph.guards import RefuseHostSync

    ext, ext64, scales = (
        torch.tensor(2.0),
        torch.tensor(3.0, dtype=torch.float64),
        torch.arange(4.0),
    )
    ext7 = torch.tensor(7.0)
    noted: list[torch.Tensor] = []
    with RefuseHostSync("meta", None, noted):
        x = torch.ones(3, device="meta")
        made = torch.zeros(())  # as a kernel's seed: made by the pass from nothing
        x * made
        x * torch.tensor(5.0)
        x * ext
        x * ext64.float()
        x * (ext64 + 1).float()
        alias, view, total = ext.detach(), scales[1], scales.sum()
        x * alias
        x * view
        x * total
        acc = torch.zeros(())
        acc.add_(ext7)  # made, then written from state in place: that state
        x * acc
    assert all(t is not made for t in noted)
    assert [float(t) for t in noted] == [2.0, 3.0, 3.0, 2.0, 1.0, 6.0, 7.0]
    assert noted[0] is ext and noted[1] is ext64 and noted[2] is ext64
    assert noted[3] is alias and noted[4] is view and noted[5] is total and noted[6] is ext7


@pytest.mark.parametrize(
    "draw",
    [
        lambda: torch.rand(()),
        lambda: (torch.rand(()) * 2).double(),
        lambda: torch.zeros(()).uniform_(),
        lambda: torch.rand(3).sum(),
        lambda: (torch.rand(3) * torch.arange(3.0)).mean(),
    ],
    ids=["rand", "made_from_a_draw", "drawn_in_place", "reduced", "through_a_larger_tensor"],
)
def test_a_cpu_draw_a_device_kernel_reads_is_refused_at_capture(draw):
    """A random number drawn on the CPU in the forward and read by a device kernel: a graph
    keeps the capture's draw (every replay would repeat it), so the warmup refuses it, naming
    the fix; a device draw and a CPU scalar made from nothing pass (meta as the device)."""
    from tgraph.guards import CaptureError, RefuseHostSync

    with pytest.raises(CaptureError, match="random number drawn on the CPU"):
        with RefuseHostSync("meta", None, []):
            torch.ones(3, device="meta") * draw()
    noted: list[torch.Tensor] = []
    with RefuseHostSync("meta", None, noted):
        x = torch.ones(3, device="meta")
        x * torch.rand(3, device="meta") * torch.zeros(())
        torch.nn.functional.dropout(x, 0.5)
    assert noted == []


class Jittered(tgraph.GraphableModule):
    """Scales by a number drawn on the CPU at every call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * (1 + torch.rand(()))


@pytest.mark.cuda
def test_a_cpu_draw_in_a_cuda_forward_stays_eager_named():
    """The module is left eager (a graph would repeat the capture's draw), the report names
    why; strict raises the same at create_graphs()."""
    model = Jittered().cuda()
    tgraph.enable(model)
    x = torch.randn(4, 8, device="cuda")
    model(x).sum().backward()
    with pytest.warns(tgraph.GraphFallbackWarning):
        report = tgraph.create_graphs()
    assert "random number drawn on the CPU" in str(report.eager_modules)
    before = tgraph.eager_calls()
    model(x).sum().backward()
    assert tgraph.eager_calls() == before + 1
