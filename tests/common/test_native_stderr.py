"""What C libraries write to a JSON-logging daemon's fd 2 reaches its stderr as JSON records;
Python's own output (the log, `<program>: error:`) is written as before."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

from tests.childenv import child_env
from vgpu_runtime.common.native_stderr import record_of

PROGRAM = textwrap.dedent("""\
    import logging, os, sys
    from vgpu_runtime.common import logs
    logs.setup("info", "json", native_stderr=True)
    logging.getLogger("daemon").info("python's own record")
    os.write(2, b"E1203 10:26:02.363014   15093 add_port.cc:83] Failed to add port\\n")
    os.write(2, b"something else a library said\\n")
    print("gemini-x: error: plain, for the person", file=sys.stderr)
    """)


def test_native_lines_become_json_records_and_python_output_is_unchanged() -> None:
    result = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                            timeout=60, env=child_env())
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert "gemini-x: error: plain, for the person" in lines
    parsed = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(parsed) == len(lines) - 1, lines
    by_msg = {r["msg"]: r for r in parsed}
    assert by_msg["python's own record"]["logger"] == "daemon"
    grpc_line = by_msg["Failed to add port"]
    assert (grpc_line["logger"], grpc_line["level"], grpc_line["source"]) == (
        "native", "error", "add_port.cc:83")
    assert by_msg["something else a library said"]["level"] == "warning"


def test_text_logs_leave_fd_2_alone() -> None:
    program = PROGRAM.replace('"json"', '"text"')
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                            timeout=60, env=child_env())
    assert "E1203 10:26:02.363014   15093 add_port.cc:83] Failed to add port" in result.stderr


def test_record_of_reads_glog_lines() -> None:
    assert record_of("W1203 10:26:02.363014 7 chttp2_transport.cc:1234] GOAWAY") == (
        logging.WARNING, "GOAWAY", {"source": "chttp2_transport.cc:1234"})
    assert record_of("plain") == (logging.WARNING, "plain", {})
