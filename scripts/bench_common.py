"""Shared plumbing of the benchmark scripts: environment facts, step timing, output files.

Imported by ``bench_train*.py`` and ``bench_decode*.py`` (both entries put ``scripts/`` on
``sys.path`` when run as ``python scripts/bench_*.py``).
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class Skip(Exception):
    """A mode cannot run here; the message says why (it is printed and stored, never a number)."""


def environment(device: torch.device) -> dict[str, Any]:
    """Date, GPU, driver, torch and CUDA versions: the facts a benchmark number needs."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "driver": None,
        "git_commit": None,
    }
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if out.returncode == 0 and out.stdout.strip():
            info["driver"] = out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        )
        if out.returncode == 0:
            info["git_commit"] = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def summarize(times_ms: list[float]) -> dict[str, float | int | None]:
    """Median, p10, p90 and mean of per-step times (ms)."""
    if not times_ms:
        return {"ms_median": None, "ms_p10": None, "ms_p90": None, "ms_mean": None, "n": 0}
    s = sorted(times_ms)

    def q(p: float) -> float:
        return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]

    return {
        "ms_median": statistics.median(s),
        "ms_p10": q(0.10),
        "ms_p90": q(0.90),
        "ms_mean": statistics.fmean(s),
        "n": len(s),
    }


class StepTimer:
    """Per-step times: CUDA events on the current stream (GPU), ``perf_counter`` on CPU.

    Events are recorded without synchronizing, so CPU and GPU overlap as in real training; the
    time between a step's two events is what the GPU timeline spent on it, idle gaps waiting for
    Python launches included (which is exactly the cost graphs remove).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pairs: list[tuple[Any, Any]] = []
        self._cpu: list[float] = []
        self._open: Any = None

    def start(self) -> None:
        if self.cuda:
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()
        else:
            self._open = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pairs.append((self._open, end))
        else:
            self._cpu.append((time.perf_counter() - self._open) * 1e3)

    def times_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in self._pairs]
        return list(self._cpu)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fresh_memory(device: torch.device) -> int:
    """Free what the previous mode left (its cuBLAS workspaces included), restart the
    peak-memory counter; return the bytes still allocated (the baseline a mode's peak is
    measured from)."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    # cuBLAS keeps a workspace per (thread, stream) for the process's life; freed here, each
    # mode pays for the workspaces of its own streams instead of the first mode that used them
    # (the previous mode's graphs are gone: nothing replays into the freed memory).
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_memory_mib(device: torch.device, since: int = 0) -> float | None:
    """Peak allocated MiB since the last counter reset, above ``since`` bytes."""
    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_allocated(device) - since) / 2**20


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_outputs(
    out_dir: str | Path, name: str, payload: dict, markdown: str
) -> tuple[Path, Path]:
    """Write ``name.json`` and ``name.md`` under ``out_dir``; return both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / f"{name}.json", out / f"{name}.md"
    js.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    md.write_text(markdown + "\n")
    return js, md


def environment_markdown(env: dict[str, Any]) -> str:
    keys = ("date", "gpu", "driver", "torch", "cuda", "python", "git_commit")
    return ", ".join(f"{k}: {env.get(k)}" for k in keys)


LONG_GAP_US = 10.0  # a gap between kernels at least this long is counted as the host's


def gpu_timeline(
    step: Callable[[int], Any], n: int, device: torch.device, head_start_ms: float = 0.0
) -> dict[str, float]:
    """Run ``step(i)`` for i < n under torch.profiler (CPU and CUDA activity): where a step's
    time goes on the GPU. ``kernel_ms``: the kernels' own time per step (those inside graph
    replays included); ``busy_ms``: time per step during which some kernel or copy ran (the
    union of their intervals); ``window_ms``: from the first device activity to the last, per
    step; ``idle_pct``: the window's share with nothing running, which a host that cannot
    keep the GPU fed leaves, and ``idle_long_pct`` the part of it in gaps of 10 us or more
    (the GPU waiting on the host; shorter gaps are the device's own kernel-to-kernel time,
    which a graph with many nodes has too); ``kernels``: kernels per step.

    ``head_start_ms``: the GPU first sleeps this long (a spin kernel, left out of every figure)
    while the host queues the first steps, as in a training loop that has run for a while;
    without it the window opens on an empty queue, and the host's work before its first launch
    counts as idle (5 steps of HF Llama's full iteration around compile at batch 1: 14% idle
    from an empty queue, 9% with the head start, none of it in long gaps). A host slower than
    the GPU still drains the queue within a few steps and shows as idle."""
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    cycles = _spin_cycles(head_start_ms, device) if head_start_ms > 0 else 0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        if cycles:
            torch.cuda._sleep(cycles)
        for i in range(n):
            step(i)
        synchronize(device)
    spans, kernels, own = [], 0, 0.0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start, end = e.time_range.start, e.time_range.end
        if end <= start or "spin_kernel" in e.name:  # the head start's sleep
            continue
        spans.append((start, end))
        own += end - start
        kernels += 1
    if not spans:
        return {}
    spans.sort()
    busy, long_gaps, (cur_s, cur_e) = 0.0, 0.0, spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            if s - cur_e >= LONG_GAP_US:
                long_gaps += s - cur_e
            busy, cur_s, cur_e = busy + cur_e - cur_s, s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    window = max(e for _, e in spans) - spans[0][0]
    return {
        "kernel_ms": own / n / 1e3,
        "busy_ms": busy / n / 1e3,
        "window_ms": window / n / 1e3,
        "idle_pct": 100.0 * (1 - busy / window) if window else 0.0,
        # gaps of LONG_GAP_US or more: the GPU waiting on the host; the shorter ones are the
        # device's own time from one kernel to the next (inside a graph: its node launches)
        "idle_long_pct": 100.0 * long_gaps / window if window else 0.0,
        "kernels": kernels / n,
        "steps": n,
        "head_start_ms": head_start_ms,
    }


def _spin_cycles(ms: float, device: torch.device) -> int:
    """GPU clock cycles for ``torch.cuda._sleep`` to spin about ``ms`` milliseconds (timed)."""
    probe = 2_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(device):
        torch.cuda._sleep(probe)  # warm
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
    return int(probe * ms / max(start.elapsed_time(end), 1e-3))
