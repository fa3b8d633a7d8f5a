from agentkv.engine.trace import nvtx_range


def test_nvtx_range_wraps_and_propagates():
    with nvtx_range("decode"):
        value = 1
    assert value == 1
    try:
        with nvtx_range("verify"):
            raise KeyError("inner")
    except KeyError as e:
        assert e.args == ("inner",)


def test_nvtx_range_pushes_and_pops_around_the_body_where_cuda_is(monkeypatch):
    import torch

    from agentkv.engine import trace

    calls = []
    monkeypatch.setattr(trace, "_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    with trace.nvtx_range("prefill"):
        calls.append(("body",))
    try:
        with trace.nvtx_range("decode"):
            raise KeyError("inner")
    except KeyError:
        pass
    assert calls == [("push", "prefill"), ("body",), ("pop",), ("push", "decode"), ("pop",)]
