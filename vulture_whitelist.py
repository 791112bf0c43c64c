# ruff: noqa: B018 - vulture reads these attribute accesses as uses; the file never runs
"""Names vulture reports as unused that are reached from outside kvactors' own code.

Checked by ``scripts/test.sh``::

    python -m vulture kvactors adapters examples scripts vulture_whitelist.py --min-confidence 60

tests/ is not scanned on purpose: a name only tests reach is reported, and must be wired or
deleted. Every entry says who reaches it. vulture matches names, not scopes: an entry covers
every definition of that name, so keep entries specific and few. This file is read by vulture
only, never imported.
"""

from typing import Any

_: Any = None

# ---- LMCache calls these (DeviceOps / DeviceSpec surface of the plugin, adapters/) -------
_.record_completion_on_stream  # DeviceOps: LMCache's MP worker, after a store
_.drain_recorded_completions  # DeviceOps: LMCache's MP server loop
_.record_event_on_stream  # DeviceOps: LMCache's MP worker
_.drain_recorded_events  # DeviceOps: LMCache's MP server loop
_.lmcache_memcpy_async  # DeviceOps: LMCache's pointer-mode copies
_.ops_cls  # DeviceSpec: LMCache instantiates the plugin's DeviceOps from it
_.default_mp_transfer_mode  # DeviceSpec: LMCache's MP mode selection
_.get_stream_handle  # DeviceSpec: LMCache turns the caller's stream into a handle
_.torch_module_name  # DeviceSpec: LMCache's selection checks getattr(torch, name)
_.pin_memory_backend  # DeviceSpec: LMCache's host buffer allocation
_.ipc_wrapper_cls  # DeviceSpec: LMCache-driven (IPC handle) mode
_.event_ipc_backend  # DeviceSpec: LMCache-driven (IPC handle) mode
_.create_cache_context  # DeviceSpec: LMCache's MP server per registered cache
_.refused_ops  # KvactorsMluOps: read at import to install the refusing legacy ops LMCache calls

# ---- the interpreter and the standard library read these --------------------------------
_.__cause__  # exception chaining: tracebacks and `raise ... from` readers
_.converter  # logging.Formatter reads it (UTC timestamps in kvactors.observe.logs)
_._close_all  # runtime.py: registered with @atexit.register
_.__getattr__  # kvactors/testing/__init__.py: PEP 562 lazy attributes
_.__call__  # devices/_ptrview.py: StorageConstructor Protocol (vendor constructor)
_.__path__  # testing/_assembly.py: marks a fake module a package for the import system
_.__file__  # testing/vendor.py: module attribute read by inspect/tracebacks
_.exc_type  # __exit__ signature (context manager protocol), testing/_streams.py
_.et  # __exit__ signature (context manager protocol), testing/_ipc.py
_.tb  # __exit__ signature (context manager protocol), testing/_ipc.py and _streams.py

# ---- the fake vendor modules mirror torch_mlu / torch_musa: vendor code calls these -----
# (kvactors.testing stands in for the real packages; LMCache's MUSA code, user code and
# kvactors' own backends reach them through the module, several by name in
# FakeVendor.module_functions)
_.mem_get_info  # torch.<dev>.mem_get_info
_.is_initialized  # torch.<dev>.is_initialized
_.empty_cache  # torch.<dev>.empty_cache
_.ipc_collect  # torch.<dev>.ipc_collect
_.major  # get_device_properties().major
_.minor  # get_device_properties().minor
_.total_memory  # get_device_properties().total_memory
_.multi_processor_count  # get_device_properties().multi_processor_count
_.stream_id  # Stream.stream_id
_.priority_range  # Stream.priority_range
_.wait_stream  # Stream.wait_stream (also the VendorStream Protocol, devices/_vendor.py)
_.elapsed_time  # Event.elapsed_time
_.is_cpu  # Tensor.is_cpu on fake device tensors
_.is_mlu  # Tensor.is_mlu (torch_mlu patches it onto Tensor)
_.is_musa  # Tensor.is_musa (torch_musa patches it onto Tensor)
_.MUSAIPCTensor  # torch.musa.ipc.MUSAIPCTensor
_._MLUC  # torch_mlu._MLUC (C extension module)
_.cnrt  # torch.mlu.cnrt()
_.musaError  # torch.musa.musart().musaError
_.musaHostRegisterDefault  # torch.musa.musart() flag
_.musaHostRegisterPortable  # torch.musa.musart() flag
_.musaHostRegisterMapped  # torch.musa.musart() flag
_.flags  # musaHostRegister(ptr, size, flags) signature

# ---- public test-support API of kvactors.testing (its users are tests by design) --------
_.inject_error  # FakeVendor.inject_error: sticky device errors for users' fault tests
_.counting  # FakeVendor.counting: device operations per call, for users' budget tests
_.as_dict  # OpCounts.as_dict: the counts by name, for users' budget tests
_.closed_under_work  # ManualBackend: IPC owners closed under queued work, read by users' tests
_.sync_waiters  # ManualBackend: threads blocked in a sync, what users' tests wait_for

# ---- reached through entry points, serialisation or after close -----------------------------
_.kvactors_op_transfer  # adapter baseline.py: entry point kvactors_op of kvactors.baselines (bench)
_.calls_per_s  # bench row fields: serialised by name into bench.json (msgspec)
_.records_withdrawn  # Runtime property: readable after close(), when statistics() is not

# ---- public fake API (kvactors.testing) that vendors' tests read ---------------------------
_.launches  # OpCounts field: read by name from as_dict() (the budget tests)
_.allocations  # OpCounts field: read by name from as_dict() (the budget tests)
_.alloc_bytes  # OpCounts field: read by name from as_dict()
_.host_device_copies  # OpCounts property: H2D + D2H, for vendors' per-call budget checks

# ---- the serving validation (tools/kvactors_serving, the harness outside the wheel) ---------
_.__class__  # vllm_cpu.patch_llvmlite_lib: the llvmlite library object's class is swapped
_.stored_as  # tap.Mismatch fields: read by name from the report (Mismatch.__dict__)
_.restore_call  # tap.Mismatch field, read by name from the report
_.differing_bytes  # tap.Mismatch field, read by name from the report
