"""nmt/plotting.py: pyplot draws into files on the Agg backend, whatever backend was chosen
before (a notebook's, an environment's MPLBACKEND)."""

import pytest

from nmt.plotting import pyplot


def test_pyplot_is_on_the_file_only_agg_backend():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("svg")  # another non-interactive backend chosen before
    try:
        assert pyplot().get_backend().lower() == "agg"
    finally:
        matplotlib.use("Agg")
