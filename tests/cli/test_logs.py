"""Structured logging: extra fields in text and JSON."""

from __future__ import annotations

import io
import json
import logging

from kvactors.observe.logs import configure, get_logger


def test_json_lines_carry_extras() -> None:
    buf = io.StringIO()
    handler = configure("INFO", json_format=True, stream=buf)
    try:
        get_logger("kvactors.test").info("store done", extra={"device": "mlu:0", "nbytes": 7})
    finally:
        logging.getLogger("kvactors").removeHandler(handler)
    rec = json.loads(buf.getvalue())
    assert rec["msg"] == "store done"
    assert (rec["device"], rec["nbytes"], rec["logger"]) == ("mlu:0", 7, "kvactors.test")


def test_text_appends_extras_and_reconfigure_replaces() -> None:
    buf = io.StringIO()
    configure("INFO", stream=io.StringIO())
    handler = configure("INFO", stream=buf)
    try:
        assert (
            sum(
                1
                for h in logging.getLogger("kvactors").handlers
                if getattr(h, "_kvactors_handler", False)
            )
            == 1
        )
        get_logger("demo").warning("slow", extra={"seconds": 1.5})
    finally:
        logging.getLogger("kvactors").removeHandler(handler)
    assert buf.getvalue().rstrip().endswith("kvactors.demo: slow seconds=1.5")
