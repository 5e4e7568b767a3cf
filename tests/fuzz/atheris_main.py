"""What both atheris harnesses do to start: seed a corpus when none is named, bound the input
length, hand over to libFuzzer. Imported only by the harnesses (atheris need not be installed to
import this module)."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


def fuzz(name: str, test_one_input: Callable[[bytes], None],
         seed_corpus: Callable[[Path], None], max_len: int) -> None:
    import atheris

    argv = list(sys.argv)
    if not any(not a.startswith("-") for a in argv[1:]):   # no corpus dir or input file named
        corpus = Path(tempfile.mkdtemp(prefix=f"{name}-corpus-"))
        seed_corpus(corpus)
        argv.append(str(corpus))
    if not any(a.startswith("-max_len=") for a in argv):
        argv.append(f"-max_len={max_len}")
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()
