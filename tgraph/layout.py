"""C++ checks that tensors still have the layout a graph baked in, for the hot paths.

* :data:`ptrs_equal`: torch's C++ data-pointer pass (inductor's cudagraph trees use it), or None
  where torch lacks it (CPU builds); it takes lists only.
* :class:`LayoutGuards`: dynamo's C++ ``TensorGuards`` over sizes and strides, built once a
  Python comparison found the tensors laid out as baked; a third of the Python comparison's
  cost at a hundred tensors. A guard also compares dtype, device, ``requires_grad`` and the
  dispatch keys under the thread's state (autocast, inference mode), so any of those changing
  only sends a call through the Python comparison again, never past it.
"""

from __future__ import annotations

import torch

ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - every supported torch has it
    _TensorGuards = None

KEPT = 2  # guards kept: one per dispatch state the tensors are checked under
BUILDS = 16  # then the Python comparison alone (checked under ever more states)


class LayoutGuards:
    """The C++ layout checks of one set of tensors (module docstring). A caller checks
    ``any(g.check(*tensors) for g in guards)`` in place (C++ calls only, so a hot path does not
    enter this file); True means the sizes and strides a guard was built on, False says
    nothing: compare in Python, then :meth:`remember`."""

    __slots__ = ("guards", "builds")

    def __init__(self) -> None:
        self.guards: list = []
        self.builds = 0

    def remember(self, tensors, sizes, strides) -> None:
        """After the Python comparison found ``tensors`` with ``sizes`` and ``strides``."""
        if _TensorGuards is None or self.builds >= BUILDS:
            return
        self.builds += 1
        try:
            guard = _TensorGuards(
                *tensors,
                dynamic_dims_sizes=list(map(list, sizes)),
                dynamic_dims_strides=list(map(list, strides)),
            )
        except (TypeError, ValueError, RuntimeError, NotImplementedError):
            # another torch's signature, or tensors it cannot describe: Python compares
            self.builds = BUILDS
        else:
            self.guards = [guard, *self.guards][:KEPT]
