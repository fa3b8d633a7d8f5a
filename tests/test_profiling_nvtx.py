from engine.trace import nvtx_range


def test_nvtx_range_wraps_and_propagates():
    with nvtx_range("decode"):
        value = 1
    assert value == 1
    try:
        with nvtx_range("verify"):
            raise KeyError("inner")
    except KeyError as e:
        assert e.args == ("inner",)
