"""The open-file limit helper, in a child process so this one's limit is left alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.childenv import child_env


def test_raises_soft_limit_to_the_hard_one_and_never_lowers_it() -> None:
    code = textwrap.dedent("""
        import resource
        from vgpu_runtime.common.fdlimit import raise_open_file_limit
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        assert raise_open_file_limit(200) == min(256, hard)      # never lowered
        assert raise_open_file_limit() == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
