"""``kvactors bench`` (:mod:`.command`): ``transfer`` (GB/s), ``percall`` (host cost of one
call on CPU) and ``vendor`` (kvactors against LMCache's own MLU/MUSA ops on the fakes), all on
one harness (:mod:`._harness`). This package imports none of them, so ``python -m
kvactors.cli.bench.vendor`` does not import itself twice.
"""
