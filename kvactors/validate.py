"""Bit-for-bit KV validation (documented name); the implementation is :mod:`kvactors.cli.validate`.

``from kvactors.validate import dump_paged, save_dump`` and ``python -m kvactors.validate``
keep working: this module re-exports the tool's public names.
"""

from __future__ import annotations

from kvactors.cli.validate import (
    BlockMismatch,
    KVDump,
    ValidationReport,
    add_arguments,
    compare_kv,
    dump_paged,
    format_report,
    load_dump,
    main,
    run,
    save_dump,
)

__all__ = (
    "BlockMismatch",
    "KVDump",
    "ValidationReport",
    "add_arguments",
    "compare_kv",
    "dump_paged",
    "format_report",
    "load_dump",
    "main",
    "run",
    "save_dump",
)

if __name__ == "__main__":
    raise SystemExit(main())
