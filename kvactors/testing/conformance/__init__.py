"""The conformance suite behind ``kvactors selftest`` (:func:`check_backend`).

It drives a :class:`~kvactors.runtime.Runtime` on a backend, so it sits above the runtime,
apart from the fakes of :mod:`kvactors.testing`, which depend on nothing above the pure core.
"""
