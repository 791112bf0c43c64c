"""``kvactors bench`` (:mod:`.command`): ``transfer`` (GB/s), ``percall`` (CPU) and ``vendor``
(the fakes), on one harness (:mod:`._harness`); the package imports none of them.
"""
