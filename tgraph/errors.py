"""The errors a user may want to catch apart; each is a ``RuntimeError``. Beside them the
warning every fallback to eager gives (:class:`GraphFallbackWarning`).

* :class:`GraphFallbackError`: under ``strict=True``, a graphed call matched no captured graph;
  in any mode, a merged stack's backward found a hook on an inner output that the recorded
  iteration did not show (its graph cannot give that hook its gradient);
* :class:`ReplayOrderError`: a backward would read saved activations that another unit's backward
  graph overwrote, because the backwards ran in an order the pool is not safe for
  (:mod:`tgraph.pool`);
* :class:`StaleBackwardError`: a second backward through one forward of a graphed unit (outputs
  kept with ``retain_graph=True`` and backed through again) that the recorded iteration did not
  show (a recorded one leaves the unit eager).
"""

from __future__ import annotations


class GraphFallbackWarning(UserWarning):
    """A graphed call ran eagerly (no captured graph matched it, or a check before its replay
    found a change); the message says why."""


class GraphFallbackError(RuntimeError):
    """Under ``strict=True``: a graphed call matched no captured graph (the message says why).
    In any mode: a merged stack's backward found a hook or ``retain_grad()`` on an inner
    output that the recorded iteration did not show."""


class ReplayOrderError(RuntimeError):
    """A backward's saved activations were overwritten by a backward graph replayed out of the
    recorded order; its gradients would be computed from garbage, so it raises instead."""


class StaleBackwardError(RuntimeError):
    """A second backward through one forward of a graphed unit: its graph's backward replays
    once per forward."""
