"""Rendering a conversation's tail from an anchor (model.chat_suffix) gives
exactly the full render's tail, for every template the project ships or
tests (the embedded default, Qwen2.5- and Llama-3.1-style, and named
templates), over generated conversations with tools, tool calls and tool
results; where it cannot, it says so (None) rather than being wrong."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkv.model.chat_suffix import anchor, render_suffix, reply_gap
from agentkv.model.tokenizer import Tokenizer, TokenizerError
from tests.test_tokenizer import (  # noqa: F401 (fixtures)
    conversations, default_dir, llama_dir, named_dir, qwen_dir, tool_lists,
)

END_OF_TURN = {"default": "<|im_end|>", "qwen25": "<|im_end|>", "llama31": "<|eot_id|>", "named": "<|im_end|>"}


@pytest.fixture(scope="module")
def tokenizers(default_dir, qwen_dir, llama_dir, named_dir) -> dict[str, Tokenizer]:
    dirs = {"default": default_dir, "qwen25": qwen_dir, "llama31": llama_dir, "named": named_dir}
    return {name: Tokenizer.from_dir(d) for name, d in dirs.items()}


def render(tok: Tokenizer, messages: list[dict], tools, generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False)


def test_the_anchor_is_the_head_and_the_last_message():
    m = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}] + [
        {"role": "assistant" if i % 2 else "user", "content": str(i)} for i in range(6)]
    assert anchor(m, 8) == m[:2] + [m[7]]
    assert anchor(m, 3) == m[:3] and anchor(m, 1) == m[:1]
    assert anchor(m[1:], 5) == [m[1], m[5]]


@pytest.mark.parametrize("name", ["default", "qwen25", "llama31", "named"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), tools=tool_lists)
def test_suffix_equals_the_full_renders_tail(tokenizers, name, data, tools):
    tok = tokenizers[name]
    messages = data.draw(conversations(llama=name == "llama31"))
    try:
        full = render(tok, messages, tools, True)
    except TokenizerError:  # a conversation the template refuses: nothing to compare
        return
    # Where an agent's next turn begins it is always possible, but for the
    # named set's default (no tools), which writes a token after everything.
    always = name != "named" or tools is not None
    for k in range(1, len(messages)):
        suffix = render_suffix(tok, messages, k, tools)
        if messages[k - 1]["role"] == "assistant" and always:
            assert suffix is not None, (name, k)
        if suffix is not None:
            assert render(tok, messages[:k], tools, False) + suffix == full, (name, k)


@pytest.mark.parametrize("name", ["default", "qwen25", "llama31", "named"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), tools=tool_lists)
def test_reply_gap_is_what_follows_the_end_of_turn(tokenizers, name, data, tools):
    tok, end = tokenizers[name], END_OF_TURN[name]
    messages = data.draw(conversations(llama=name == "llama31"))
    for k in range(2, len(messages) + 1):
        if messages[k - 1]["role"] != "assistant":
            continue
        try:
            prompt, history = render(tok, messages[: k - 1], tools, True), render(tok, messages[:k], tools, False)
        except TokenizerError:
            continue
        # As if the model had said something else than the template writes: the end-of-turn token decides.
        gap = reply_gap(tok, messages[: k - 1], messages[k - 1], tools, "\x00" + end, end)
        assert gap is not None or (name == "named" and tools is None), (name, k)  # as for suffixes
        if gap is None:  # only if the prompt is not where the reply starts, or no end-of-turn token ends it
            assert not history.startswith(prompt) or end not in history[len(prompt):]
            continue
        assert history.startswith(prompt) and history.endswith(end + gap)
        # A reply cut before its end-of-turn token: the template's text from there on.
        body = history[len(prompt):]
        cut = body[: body.rfind(end)]
        assert reply_gap(tok, messages[: k - 1], messages[k - 1], tools, cut, None) == body[len(cut):]
