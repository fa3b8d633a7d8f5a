"""The engine: a model, its page pool, its tokenizer, and the sessions on them."""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from cache.pool import PagePool
from cache.radix import RadixCache
from engine.errors import ContextLengthError, InvalidRequestError
from engine.grammar import GrammarCache
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from engine.session import Session
from engine.stats import TurnStats
from engine.structured import request_grammar
from model.config import ModelConfig
from model.default import default_model_dir
from model.llama import Transformer
from model.loader import load_model, parse_dtype
from model.tokenizer import Tokenizer
from model.tool_calls import parse_tool_calls

DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass
class ChatResult:
    text: str
    tool_calls: list[dict]
    usage: dict
    finish_reason: str  # "stop", "length" or "tool_calls"
    token_ids: list[int] = field(default_factory=list)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Engine:
    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer | None,
        *,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        stateless: bool = False,
        prefix_cache: bool = True,
        prefix_match: str = "token",
        pin_ttl: float | None = 300.0,
        constrain_auto: bool = True,
    ):
        cfg: ModelConfig = model.cfg
        self.model = model
        if model.packed is None:  # engines sharing a model share its packed weights
            model.prepack()
        self.tokenizer = tokenizer
        if num_pages is None:
            num_pages = PagePool.pages_for_budget(
                kv_cache_bytes, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, page_size, model.dtype
            )
        self.pool = PagePool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_pages, page_size, model.dtype, model.device)
        self.runner = ModelRunner(model, self.pool, self._make_room)
        self.stateless = stateless
        self.radix = RadixCache(self.pool) if prefix_cache and not stateless else None
        if prefix_match not in ("token", "block"):
            raise InvalidRequestError(f"prefix_match must be 'token' or 'block', not {prefix_match!r}")
        # "block" reuses whole pages only, as block-hash caches (vLLM) and
        # page-aligned radix trees do: the baseline token granularity beats.
        self.prefix_match = prefix_match
        self.pin_ttl = pin_ttl
        # Under tool_choice "auto", hold a call the model opens to the tools'
        # schemas (engine.structured). Off, "auto" decodes unconstrained, as
        # servers that only parse calls do.
        self.constrain_auto = constrain_auto
        self._sessions: "weakref.WeakSet[Session]" = weakref.WeakSet()
        self.max_context = cfg.max_position_embeddings
        tokenizer_eos = tokenizer.eos_token_ids if tokenizer is not None else []
        self.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(tokenizer_eos))
        self.stats: list[TurnStats] = []
        # Guards the pool, the block tables and the model: held by each
        # scheduler step and by each session call that touches pages.
        self.lock = threading.RLock()
        self.scheduler = Scheduler(self)
        self._grammars: GrammarCache | None = None

    @property
    def grammars(self) -> GrammarCache:
        """Compiled grammars over this engine's vocabulary, made on first use."""
        if self.tokenizer is None:
            raise InvalidRequestError("constrained decoding needs a tokenizer; this model has none")
        with self.lock:
            if self._grammars is None:
                self._grammars = GrammarCache(self.tokenizer, self.model.cfg.vocab_size, self.eos_token_ids)
            return self._grammars

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path | None = None,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        **kwargs,
    ) -> "Engine":
        """Load a Hugging Face checkpoint directory; with no path, the embedded
        default model (made on first use, no download)."""
        path = Path(path) if path is not None else default_model_dir()
        model = load_model(path, parse_dtype(dtype), device)
        tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
        return cls(model, tokenizer, **kwargs)

    def session(self, namespace: str = "default", pin_ttl: float | None | str = "default", *args) -> Session:
        """A persistent conversation in namespace (a tenant's cache salt: no
        KV is shared across namespaces). pin_ttl: seconds its pages stay
        pinned while idle (None: always), default the engine's."""
        s = Session(self, namespace, *args, pin_ttl=self.pin_ttl if pin_ttl == "default" else pin_ttl)
        self._sessions.add(s)
        return s

    def _make_room(self, pages: int) -> None:
        """Free pages under memory pressure: first cached prefixes nobody
        uses (least recently used first), then the pages of sessions idle
        past their pin time-to-live (longest idle first; they stay matchable)."""
        target = self.pool.num_free + pages
        if self.radix is not None:
            self.radix.evict(pages)
        now = time.monotonic()
        for s in sorted((s for s in list(self._sessions) if s.expired(now)), key=lambda s: s.idle_since):
            if self.pool.num_free >= target:
                return
            s.park()
            if self.radix is not None:
                self.radix.evict(target - self.pool.num_free)

    def cache_stats(self) -> dict:
        """Prefix-cache counters and page usage."""
        stats = self.radix.stats() if self.radix is not None else {}
        pinned = {p for s in list(self._sessions) if not s.closed for p in s.table.pages}
        return {
            **stats,
            "pages_total": self.pool.num_pages,
            "pages_free": self.pool.num_free,
            "pages_pinned": len(pinned),  # held by live sessions: never evicted
            "pages_shared": sum(1 for rc in self.pool.refcount if rc > 1),
        }

    def finish_turn(self, session: Session) -> None:
        self.stats.append(session.turn)
        session.turn = TurnStats()

    def chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        session: Session | None = None,
        max_tokens: int = 256,
        tool_choice: str | dict | None = None,
        response_format: dict | None = None,
        parallel_tool_calls: bool = True,
        **sampling,
    ) -> ChatResult:
        """Render the conversation, reuse the longest common prefix with the
        session's tokens, compute only the rest, and generate the reply.
        The session (a temporary one when None) ends holding the prompt and
        the reply; on error it is as before. tool_choice and response_format
        (OpenAI's shapes) constrain the reply with a grammar: see engine.structured."""
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: use the token-level session API")
        grammar = request_grammar(self, tools, tool_choice, response_format, parallel_tool_calls)
        prompt = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        if not prompt:
            raise InvalidRequestError("the rendered prompt is empty")
        if len(prompt) >= self.max_context:
            raise ContextLengthError(f"the prompt's {len(prompt)} tokens leave no room in the context of {self.max_context}")
        # Work on a fork so that a failure leaves the session untouched.
        work = session.fork_for_turn() if session is not None else self.session()
        try:
            reused = 0 if self.stateless else min(common_prefix_len(work.tokens, prompt), len(prompt) - 1)
            work.truncate(reused)
            work.queue(prompt[reused:])
            # What is reused is the KV held now: the common prefix, or a
            # prefix-cache match for a session that held none.
            reused = work.table.length
            # This turn's record (finish_turn files it and starts a new one).
            turn = work.turn
            turn.prompt_tokens, turn.reused_tokens = len(prompt), reused
            ids = work.generate(max_tokens=max_tokens, grammar=grammar, **sampling)
            finish = work.finish_reason
        except BaseException:
            work.close()
            raise
        if session is None:
            work.close()
        elif self.stateless:
            work.close()
            session.truncate(0)
        else:
            session.adopt(work)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        stops = [sampling["stop"]] if isinstance(sampling.get("stop"), str) else list(sampling.get("stop") or ())
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:  # OpenAI semantics: the stop string is not part of the reply
            text = text[:cut]
        content, calls = parse_tool_calls(text)
        if calls:
            finish = "tool_calls"
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt) + len(ids),
            "cached_tokens": reused,
            "computed_tokens": turn.computed_tokens,
        }
        return ChatResult(content, calls, usage, finish, ids)

