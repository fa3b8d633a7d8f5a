"""Stop strings as OpenAI cuts them: the reply ends where the earliest stop
begins, whichever of the stops it is, and the stop is not part of it."""
import pytest

from agentkv.engine.stops import cut_at_stop, first_stop


@pytest.mark.parametrize(
    "text,stops,cut",
    [
        ("a. b! c", (".", "!"), ("a", True)),
        ("a. b! c", ("!", "."), ("a", True)),  # earliest in the text, not first in the list
        ("say END here", ("D h", "END"), ("say ", True)),  # overlapping stops: the one that begins first
        ("no stop", ("x",), ("no stop", False)),
        ("stop at once", ("stop",), ("", True)),
        ("anything", (), ("anything", False)),
    ],
)
def test_cut_at_stop(text, stops, cut):
    assert cut_at_stop(text, stops) == cut


def test_first_stop_searches_from_start():
    assert first_stop("x.y.z", (".",), start=2) == 3
    assert first_stop("x.y", (".",), start=2) is None
