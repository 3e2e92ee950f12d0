"""Scores."""

import pytest

from metrics import edit_distance, error_rate


def test_edit_distance_cer_and_wer():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance([], ["a"]) == 1
    assert error_rate(["a b c"], ["a x c"], words=True) == pytest.approx(1 / 3)
    assert error_rate(["abcd", "xy"], ["abcd", "xz"], words=False) == pytest.approx(1 / 6)
