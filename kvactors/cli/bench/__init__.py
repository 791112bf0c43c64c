"""The benchmarks of ``kvactors bench`` (``suite``): ``transfer`` (GB/s), ``percall`` (host
cost of one call) and ``vendor`` (kvactors against LMCache's own MLU/MUSA ops on the fakes).

Each part runs on its own (``python -m kvactors.cli.bench.percall``); this package imports
none of them, so running one as ``__main__`` does not import it twice.
"""
