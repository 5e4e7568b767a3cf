"""gemini-demo's sharing part, run in-process as the demo runs it: two programs under gemini-run
over the real daemon, the real interposer and the fake CUDA driver; their shares and memory
converge to what they asked for, and each is refused an allocation past its memory limit."""

from __future__ import annotations

import io
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from vgpu_runtime.daemon import lock
from vgpu_runtime.devkit import sharedemo

GiB = 1 << 30


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gsd-", dir="/tmp"))   # short: socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


# Slow (CI's lane): it runs the programs until their shares converge; the fast lane keeps the
# demo's own run of this part (tests/integration/test_demo.py).
@pytest.mark.slow
def test_two_programs_converge_to_their_shares_and_are_refused_past_their_limits(
        root: Path) -> None:
    out = io.StringIO()
    headings: list[str] = []
    outcome = sharedemo.run_sharing(root, headings.append, out)
    text = out.getvalue()
    print(text)
    assert headings == ["5. Two programs sharing one GPU, live"]
    a, b = outcome.rows["train-a"], outcome.rows["infer-b"]
    assert (a.share, b.share) == (0.3, 0.7)
    # Shares: the daemon's achieved figures over the demo's window, both programs busy. The
    # bounds leave room for a loaded machine; the order is the point.
    assert 0.18 <= a.achieved <= 0.42 and 0.55 <= b.achieved <= 0.85, (a, b)
    assert a.achieved < b.achieved
    # Memory: each took 3/4 of its limit, in steps, and was refused the rest plus 1 GiB.
    assert (a.memory_used, a.memory_limit) == (6 * GiB, 8 * GiB)
    assert (b.memory_used, b.memory_limit) == (9 * GiB, 12 * GiB)
    for name in ("train-a", "infer-b"):
        refused = outcome.refused[name]
        assert refused["rc"] == sharedemo.CUDA_ERROR_OUT_OF_MEMORY, refused
        assert refused["counted"] == 1
    assert text.count("refused: CUDA_ERROR_OUT_OF_MEMORY (the daemon counts 1 refusal(s))") == 2
    assert "train-a holds 6.0 GiB of its 8.0 GiB and asks for 3.0 GiB more" in text
    # Live: tables as the run goes (a pipe gets one a second), then the daemon stopped.
    assert text.count("GPU-time share (achieved of asked)") >= 4
    assert "gemini-daemon (pid " in text and ") stopped" in text
    assert not lock.is_held(root / "run-state")


def test_a_program_that_cannot_start_is_said_in_one_line(root: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """gemini-run refusing (here: a share past 1) reaches the user as its own message."""
    monkeypatch.setattr(sharedemo, "PROGRAMS", (("train-a", 0.3, "8GiB"),
                                                ("too-big", 1.5, "8GiB")))
    said = (r"too-big ended \(exit status 125\) before reporting: gemini-run: error: "
            r"argument --share: '1.5' is outside")
    with pytest.raises(RuntimeError, match=said):
        sharedemo.run_sharing(root, lambda _: None, io.StringIO())
    assert not lock.is_held(root / "run-state")
