"""EXPERIMENTAL: skipping a captured optimizer step with a CUDA-graph IF node.

Opt-in only: ``OptimizerGraph(..., skip_nonfinite=True, skip_nonfinite_how="conditional")`` or
``SkipNonfinite(how="conditional")``; ``how="auto"`` (the default) and ``how="mask"`` never come
here. Where torch can build CUDA-graph conditional nodes
(``torch.cuda.CUDAGraph.begin_capture_to_if_node``, CUDA >= 12.4, not ROCm), the captured step
goes into an IF node keyed on the 0/1 finiteness flag: a skipped replay runs none of the step's
kernels, and nothing is snapshotted. Outside a real CUDA capture (eager warmup, CPU, the
emulated backend) the same ``how`` skips by the mask way of :mod:`tgraph.step.nonfinite`, with the
same bits.

Why experimental: this path has not run on a GPU whose torch builds IF nodes (the GPU runs so
far had torch 2.11, which has none; the CUDA tests in tests/test_nonfinite_conditional.py then
assert :class:`ConditionalNodesUnavailable`). Known limits of IF-node bodies (torch 2.13): no
random numbers (``end_capture_to_conditional_node`` raises), no NCCL collectives in some set-ups
(pytorch/pytorch#180960), and not with the allocator's ``graph_capture_record_stream_reuse``.
"""

from __future__ import annotations

import torch


class ConditionalNodesUnavailable(RuntimeError):
    """``how="conditional"`` on a CUDA device where torch cannot build CUDA-graph IF nodes."""


_IF_NODE_API = (
    "get_currently_capturing_graph",
    "begin_capture_to_if_node",
    "end_capture_to_conditional_node",
)
_if_node_support: dict[int, str | None] = {}  # device index -> None (IF nodes work) or why not


def conditional_nodes_unavailable(device: torch.device | str | int | None = None) -> str | None:
    """Why CUDA-graph conditional (IF) nodes cannot be used on ``device``; None where they can.

    Detected by feature, not by version: the methods torch's own ``torch.cond`` lowering uses
    (``torch.cuda.CUDAGraph.get_currently_capturing_graph``, ``begin_capture_to_if_node``,
    ``end_capture_to_conditional_node``), a CUDA (not ROCm) build, and, once per device, a tiny
    graph with an IF node captured and replayed with the flag true, then false (this catches a
    build for CUDA < 12.4 or a driver without conditional nodes). The probe cannot run inside a
    capture: a first call there answers from the API alone and is not remembered.
    """
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    missing = [name for name in _IF_NODE_API if not hasattr(torch.cuda.CUDAGraph, name)]
    if missing:
        return (
            f"torch {torch.__version__} has no torch.cuda.CUDAGraph.{missing[0]} (the CUDA-graph "
            "IF-node API behind torch.cond's CUDA-graph lowering)"
        )
    if torch.version.hip is not None:
        return f"torch {torch.__version__} is a ROCm build: HIP graphs have no conditional nodes"
    index = _device_index(device)
    if index not in _if_node_support:
        if torch._C._cuda_isCurrentStreamCapturing():
            return None
        _if_node_support[index] = _probe_if_node(index)
    return _if_node_support[index]


def _device_index(device: torch.device | str | int | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def _probe_if_node(index: int) -> str | None:
    """Capture ``hits += 1`` inside an IF node, replay with the flag true and false: one hit."""
    try:
        with torch.cuda.device(index):
            flag = torch.ones((), dtype=torch.bool, device="cuda")
            hits = torch.zeros((), dtype=torch.int32, device="cuda")
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    live = torch.cuda.CUDAGraph.get_currently_capturing_graph()
                    live.begin_capture_to_if_node(flag)
                    try:
                        hits.add_(1)
                    finally:
                        live.end_capture_to_conditional_node()
                finally:
                    graph.capture_end()
            torch.cuda.current_stream().wait_stream(stream)
            graph.replay()
            flag.fill_(False)
            graph.replay()
            ran = int(hits.item())  # outside any capture: one host read, once per device
            del graph
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable here"
        return f"a test capture with an IF node failed: {type(exc).__name__}: {exc}"
    if ran != 1:
        return f"a test IF node ran its body {ran} times over one true and one false flag"
    return None


def uses_if_node(how: str, ok: torch.Tensor) -> bool:
    """Whether a step protected by ``SkipNonfinite(how)`` on the flag ``ok`` goes into an IF
    node: only for ``how="conditional"``, a CUDA flag and a real CUDA stream capture (the
    emulated backend's capture patches ``torch.cuda.is_current_stream_capturing``, not the
    stream query asked here). Checked at every step on a CUDA device, so an unavailable
    ``how="conditional"`` fails at the first (eager) step, not at capture.

    Raises:
        ConditionalNodesUnavailable: ``how="conditional"`` on a CUDA device without IF nodes.
    """
    if how != "conditional" or not ok.is_cuda:
        return False
    reason = conditional_nodes_unavailable(ok.device)
    if reason is not None:
        raise ConditionalNodesUnavailable(
            f"SkipNonfinite(how='conditional') needs CUDA-graph conditional (IF) nodes, which "
            f"are unavailable here: {reason}. Fix: use how='mask' or how='auto' (the same "
            "results through a 0/1 mask: OptimizerGraph(..., skip_nonfinite_how='auto')), or "
            "a torch whose torch.cuda.CUDAGraph has begin_capture_to_if_node (torch 2.13 "
            "has it; a CUDA >= 12.4 build, not ROCm)."
        )
    return torch._C._cuda_isCurrentStreamCapturing()


def open_if_node(ok: torch.Tensor):
    """Inside a CUDA capture: the kernels launched from now on go into an IF node on ``ok``.
    Returns the capturing graph, for :func:`close_if_node`."""
    graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
    graph.begin_capture_to_if_node(ok)
    return graph


def close_if_node(graph) -> None:
    """End the IF node :func:`open_if_node` opened: later kernels run at every replay."""
    graph.end_capture_to_conditional_node()


__all__ = [
    "ConditionalNodesUnavailable",
    "close_if_node",
    "conditional_nodes_unavailable",
    "open_if_node",
    "uses_if_node",
]
