"""A share of a GPU's time (vgpu_runtime/contracts/share.py): read once at each edge with a
clear error, exact inside, and converted once at each boundary to what the old code passed
along."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgpu_runtime.contracts import paths, wire
from vgpu_runtime.contracts.containerenv import entitled_memory
from vgpu_runtime.contracts.share import WHOLE, Share, ShareError, optional_json, total

PPM = 1_000_000


@pytest.mark.parametrize(("text", "exact"), [
    ("0.3", Fraction(3, 10)), ("30%", Fraction(3, 10)), (" 1 ", Fraction(1)),
    ("100%", Fraction(1)), ("33.3%", Fraction(333, 1000)), ("0.3337", Fraction(3337, 10000)),
    ("1e-3", Fraction(1, 1000)), (repr(1 / 3), Fraction(1, 3)),
])
def test_people_write_a_share_as_a_fraction_or_a_percentage(text: str, exact: Fraction) -> None:
    assert Share.parse(text).value == exact


@pytest.mark.parametrize(("text", "says"), [
    ("0", "'0' is outside (0, 1]"), ("-0.1", "outside (0, 1]"), ("1.5", "outside (0, 1]"),
    ("150%", "outside (0, 1]"), ("nan", "outside (0, 1]"), ("inf", "outside (0, 1]"),
    ("half", "'half' is not a number"), ("", "is not a number"), ("%", "is not a number"),
    ("1/3", "is not a number"),
])
def test_bad_text_says_what_is_accepted(text: str, says: str) -> None:
    with pytest.raises(ShareError) as error:
        Share.parse(text)
    assert says in str(error.value)
    assert "a fraction such as 0.3 or a percentage such as 30%" in str(error.value)


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.0000001, float("nan"), float("inf"), 10**400,
                                   True, "0.5", None, [0.5]])
def test_bad_json_is_refused_saying_what_it_got(value: object) -> None:
    with pytest.raises(ShareError, match=r"outside \(0, 1\]|must be a number"):
        Share.from_json(value)


@pytest.mark.parametrize(("slices", "per_gpu"), [(0, 10), (11, 10), (1, 0), (1, 1001), (-1, 5)])
def test_a_slice_count_outside_its_gpu_is_refused(slices: int, per_gpu: int) -> None:
    with pytest.raises(ShareError, match="slices is not a share of a GPU"):
        Share.of_slices(slices, per_gpu)


def test_the_type_holds_only_shares() -> None:
    with pytest.raises(ShareError):
        Share(Fraction(3, 2))
    with pytest.raises(ShareError):
        Share(0.5)  # type: ignore[arg-type]


def test_exact_inside_two_tenths_is_a_fifth_and_three_thirds_are_one() -> None:
    assert Share.of_slices(2, 10) == Share.of_slices(1, 5) == Share.parse("20%")
    assert total([Share.of_slices(1, 3)] * 3) == 1
    assert total(Share.from_json(0.1) for _ in range(10)) == 1   # never 1.0000000000000002
    assert Share.parse("0.5") < Share.parse("0.6") and max(WHOLE, Share.parse("0.2")) == WHOLE
    assert f"{Share.of_slices(1, 3):.3f}" == "0.333" and str(Share.parse("30%")) == "0.3"
    assert optional_json(None) is None and optional_json(WHOLE) == 1.0


@given(st.integers(1, paths.MAX_SLICES_PER_GPU).flatmap(
    lambda n: st.tuples(st.integers(1, n), st.just(n))))
def test_a_slice_share_keeps_what_the_old_float_path_gave(pair: tuple[int, int]) -> None:
    """The plugin once wrote k/N as a float: the algorithm, the file and the memory get the
    same values now, and the file reads back as the very share."""
    k, n = pair
    share = Share.of_slices(k, n)
    assert share.to_float() == k / n
    assert share.to_json() == k / n and Share.from_json(k / n) == share
    assert entitled_memory(80 << 30, 0, share) == (80 << 30) * k // n
    ppm = wire.share_ppm(share)
    assert abs(ppm - k * PPM / n) <= 0.5 and ppm == max(1, round(Fraction(k * PPM, n)))


@given(st.floats(min_value=0, max_value=1, exclude_min=True))
def test_any_json_float_comes_back_unchanged(number: float) -> None:
    """A record's, a binding's or a host request's number: what the algorithm gets is that
    float, and writing the share gives it back."""
    share = Share.from_json(number)
    assert share.to_float() == number and share.to_json() == number
    assert Share.from_json(share.to_json()) == share


def test_the_wire_carries_parts_per_million_never_zero() -> None:
    assert wire.share_ppm(Share.parse("0.3")) == 300_000
    assert wire.share_ppm(WHOLE) == PPM
    assert wire.share_ppm(Share.parse("1e-9")) == 1
    assert wire.PPM == PPM
