"""Grammar-constrained decoding through xgrammar: compiled grammars, cached by
their specification, and one matcher per request.

A request's matcher always stands at the end of what the request has emitted.
Masks for a verify step are computed ahead of the step it masks: row i of a
step with drafts d gets the mask of the state after d[:i], found by advancing
the matcher through the draft and rolling it back again. So a draft never
leaves a trace in the matcher, and rejecting part of it needs no undo.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

from agentkv.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from agentkv.model.tokenizer import Tokenizer

__all__ = ["GrammarError", "Grammar", "GrammarCache", "GrammarState"]


class GrammarError(InvalidRequestError):
    """A grammar that cannot be built: a bad JSON schema, an unknown tool name,
    an unsupported response format."""


class Grammar:
    """A compiled grammar over one engine's vocabulary."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int):
        self.compiled, self.vocab_size = compiled, vocab_size
        # Token spellings of its tools' schema names, drafted inside a call (spec.schema_phrases).
        self.phrases: tuple[tuple[int, ...], ...] = ()


# C0 controls other than tab, newline and carriage return: never text a
# reply means to write, and xgrammar lets them into length-bounded JSON
# strings, where they would make the JSON invalid.
_CONTROL = frozenset(range(0x20)) - {0x09, 0x0A, 0x0D}


def tokenizer_info(tokenizer: "Tokenizer", vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary. Special tokens (chat markers, EOS)
    are control tokens, never text, and so are tokens holding control bytes:
    given as empty strings, a grammar never allows them, except the stop
    tokens where it may end. The tool-call format's markers (Mistral's
    [TOOL_CALLS]) are the exception: replies keep them as text, and a grammar
    writes them as the token the model learned."""
    vocab = [""] * vocab_size
    special = {t.content for t in tokenizer.backend.get_added_tokens_decoder().values() if t.special}
    special -= set(tokenizer.tool_markers.values())
    for token, i in tokenizer.backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and token not in special:
            vocab[i] = token
    # The encoding (byte-level BPE, SentencePiece byte fallback, ...) as
    # xgrammar reads it from a tokenizer.json; pinned xgrammar version.
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())

    def info() -> xgr.TokenizerInfo:
        return xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=stop_token_ids,
                                 add_prefix_space=meta["add_prefix_space"])

    for i, text in enumerate(info().decoded_vocab):
        if _CONTROL.intersection(text):
            vocab[i] = ""
    return info()


class GrammarCache:
    """Compiles structural tags for one tokenizer and keeps the most recent
    ones, per owner (a tenant): an agent loop that re-sends the same tools
    compiles them once. Owners share nothing: no tenant's schemas evict
    another's grammars or show in its timing, and a compile runs outside the
    cache's lock, so a slow schema holds up only the requests that wait for
    that very grammar."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int, stop_token_ids: list[int], capacity: int = 64):
        self.vocab_size, self.capacity = vocab_size, capacity
        self._compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size, list(stop_token_ids)), cache_enabled=False)
        self._grammars: dict[str, OrderedDict[str, Grammar]] = {}  # owner -> its most recent, capacity at most
        self._compiling: dict[tuple[str, str], Future] = {}  # what a request is compiling now, for the others
        self._lock = threading.Lock()  # requests' handler threads share the cache
        self.compiles = 0

    def get(self, structural_tag: dict, owner: str = "default") -> Grammar:
        """The compiled grammar of an xgrammar structural tag
        ({"type": "structural_tag", "format": {...}}) for owner; GrammarError if it does not compile."""
        # Not sorted: the order of a schema's properties is the order the grammar writes them in.
        key = json.dumps(structural_tag, separators=(",", ":"))
        with self._lock:
            mine = self._grammars.setdefault(owner, OrderedDict())
            if key in mine:
                mine.move_to_end(key)
                return mine[key]
            pending = self._compiling.get((owner, key))
            compiling = pending is None
            if compiling:
                pending = self._compiling[owner, key] = Future()
        if not compiling:
            return pending.result()  # another request of this owner compiles it: its grammar, or its GrammarError
        try:
            grammar = Grammar(self._compile(key), self.vocab_size)
        except GrammarError as e:
            pending.set_exception(e)
            raise
        finally:
            with self._lock:
                del self._compiling[owner, key]
        with self._lock:
            self.compiles += 1
            mine[key] = grammar
            if len(mine) > self.capacity:
                mine.popitem(last=False)
        pending.set_result(grammar)
        return grammar

    def _compile(self, key: str) -> "xgr.CompiledGrammar":
        try:
            return self._compiler.compile_structural_tag(key)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar reports a bad schema as RuntimeError
            raise GrammarError(f"cannot build a grammar for this request: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    # xgrammar prefixes its C++ messages with a timestamp and source location.
    lines = [line for line in str(e).splitlines() if line.strip()]
    text = lines[0] if lines else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self._matcher = xgr.GrammarMatcher(grammar.compiled)

    @property
    def terminated(self) -> bool:
        """The grammar has ended (its stop token was accepted): nothing may follow."""
        return self._matcher.is_terminated()

    def clip(self, draft: list[int]) -> list[int]:
        """The longest prefix of draft the grammar allows; it ends at the
        grammar's stop token, if it holds one."""
        n = self._advance(draft)
        self._matcher.rollback(n)
        return draft[:n]

    def fill_bitmask(self, bitmask: torch.Tensor, offset: int, draft: list[int]) -> None:
        """Write the masks of len(draft) + 1 rows into bitmask from row offset
        on: row i after the tokens emitted so far and draft[:i] (a clipped
        draft). Rows past a stop token allow everything: the request ends there."""
        n = 0
        while not self._matcher.is_terminated() and n <= len(draft):
            self._matcher.fill_next_token_bitmask(bitmask, offset + n)
            if n == len(draft):
                break
            if not self._matcher.accept_token(draft[n]):
                self._matcher.rollback(n)
                raise ValueError(f"draft token {draft[n]} at {n} is not allowed: clip the draft first")
            n += 1
        self._matcher.rollback(n)

    def masked(self, rows: torch.Tensor, draft: list[int]) -> torch.Tensor:
        """rows [len(draft) + 1, V] with what the grammar forbids at -inf (see
        fill_bitmask), as a copy: the rows may be a session's held logits.
        The scheduler masks all its constrained rows at once instead (engine.emit)."""
        bitmask = xgr.allocate_token_bitmask(len(draft) + 1, self.grammar.vocab_size)
        self.fill_bitmask(bitmask, 0, draft)
        out = rows.float().clone()
        xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device))
        return out

    def _advance(self, tokens: list[int]) -> int:
        """Accept tokens while the grammar allows them; how many it took."""
        n = 0
        while n < len(tokens) and not self._matcher.is_terminated() and self._matcher.accept_token(tokens[n]):
            n += 1
        return n

    def accept(self, token: int) -> bool:
        return self._advance([token]) == 1

    def forced(self) -> list[int]:
        """Tokens spelling what the grammar forces next (jump-forward: `{"name": "`
        once a call has opened, a closing brace, a tag), the state unchanged.
        xgrammar matches the longest vocabulary tokens, which need not be the
        model's spelling: they are drafted and verified, not assumed."""
        return self._matcher.find_jump_forward_tokens()
