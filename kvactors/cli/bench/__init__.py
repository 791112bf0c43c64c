"""The benchmarks: ``suite`` (``kvactors bench``), ``transfer`` and ``messaging``.

Each part runs on its own (``python -m kvactors.cli.bench.transfer``,
``python -m kvactors.cli.bench.messaging``); this package imports none of them, so running one
as ``__main__`` does not import it twice.
"""
