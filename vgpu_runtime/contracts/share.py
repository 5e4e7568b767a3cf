"""A share of one GPU's time: one exact type from the edge inward.

A share (or the cap on one: a limit) is read once where it enters, with a clear error for bad
input: a flag or an annotation (`Share.parse`: 0.3 or 30%), the plugin's slice count
(`Share.of_slices`), a JSON number in a record, a binding or a host request (`Share.from_json`).
It leaves through one named conversion at each boundary: `to_json` (files, status, logs),
`to_float` (the time-sharing algorithm), `wire.share_ppm` (the hook's hello) and
`containerenv.entitled_memory` (bytes). In between it is a Share: exact, so 2/10 equals 1/5 and
three thirds add up to one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

from vgpu_runtime.contracts import paths

FORMS = "a fraction such as 0.3 or a percentage such as 30%"


class ShareError(ValueError):
    """Not a share of a GPU: the message says what was given and what is accepted."""


@dataclass(frozen=True, order=True)
class Share:
    """A fraction of one GPU's time in (0, 1], exact. Build it with a constructor below."""

    value: Fraction

    def __post_init__(self) -> None:
        if not isinstance(self.value, Fraction) or not 0 < self.value <= 1:
            raise ShareError(f"a share is a fraction in (0, 1], got {self.value!r}")

    @classmethod
    def of_slices(cls, slices: int, per_gpu: int) -> Share:
        """`slices` of a GPU cut into `per_gpu`: exactly slices/per_gpu."""
        if not 0 < per_gpu <= paths.MAX_SLICES_PER_GPU or not 0 < slices <= per_gpu:
            raise ShareError(f"{slices} of {per_gpu} slices is not a share of a GPU (at most "
                             f"{paths.MAX_SLICES_PER_GPU} slices per GPU)")
        return cls(Fraction(slices, per_gpu))

    @classmethod
    def parse(cls, text: str) -> Share:
        """'0.3' or '30%', as a person writes it (flags, annotations)."""
        raw = str(text).strip()
        percent = raw.endswith("%")
        try:
            number = float(raw[:-1] if percent else raw)
        except ValueError:
            raise ShareError(f"{text!r} is not a number; write {FORMS}") from None
        if math.isnan(number) or not 0 < (number / 100 if percent else number) <= 1:
            raise ShareError(f"{text!r} is outside (0, 1]; write {FORMS}")
        # 30% is 3/10 exactly: the percentage's decimal over 100, never a float's quotient.
        return (cls(_canonical(Fraction(repr(number)) / 100)) if percent
                else cls.from_float(number))

    @classmethod
    def from_float(cls, number: float) -> Share:
        """The share a float stands for: the k/N (N at most paths.MAX_SLICES_PER_GPU) whose float
        it is, else its shortest decimal (0.3337), so the float comes back unchanged."""
        if math.isnan(number) or not 0 < number <= 1:
            raise ShareError(f"{number!r} is outside (0, 1]")
        return cls(_canonical(Fraction(repr(float(number)))))

    @classmethod
    def from_json(cls, value: object) -> Share:
        """A JSON number in (0, 1] (a boolean is not one)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ShareError(f"a share must be a number, got {value!r}")
        try:
            return cls.from_float(float(value))
        except OverflowError:   # an integer too large for a float
            raise ShareError(f"{value!r} is outside (0, 1]") from None

    def to_json(self) -> float:
        """A file's or a status answer's number: from_json reads back this very share."""
        return self.to_float()

    def to_float(self) -> float:
        """The time-sharing algorithm's (timeshare/policy.py): the nearest float."""
        return float(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.to_float(), spec or "g")

    def __str__(self) -> str:
        return f"{self:g}"


WHOLE = Share(Fraction(1))


def total(shares: Iterable[Share]) -> Fraction:
    """What shares on one GPU add up to, exactly (it may pass 1: an overcommitted GPU)."""
    return sum((s.value for s in shares), Fraction(0))


def optional_json(share: Share | None) -> float | None:
    return None if share is None else share.to_json()


def _canonical(value: Fraction) -> Fraction:
    """A k/N with N at most MAX_SLICES_PER_GPU when one has the same float: what a slice
    count wrote as a float (1/3) reads back as itself, not as its 17-digit decimal."""
    slices = value.limit_denominator(paths.MAX_SLICES_PER_GPU)
    return slices if float(slices) == float(value) else value
