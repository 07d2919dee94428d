"""Per-layer graphs: a forward and a backward graph per graphed module and call signature,
replayed inside ordinary autograd.

``enable`` (:func:`enable`, :func:`disable`, :func:`reset_layer_graphs`) and ``manager``
(:class:`GraphableModule`, whose calls record, replay or run eagerly; ``create``:
:func:`create_graphs`) -> ``record`` (the recorded iteration) and ``signature`` (call keys,
output templates) -> ``capture`` (warmup and capture of a unit; ``runner``: one module,
``segment``: a merged stack) -> ``captured`` (the frozen capture result a unit's captures end in) -> ``replay``
(the autograd bridge that replays from that capture result; ``backward``: its backward half;
``follow``: the rare paths after a check found a change).
"""
