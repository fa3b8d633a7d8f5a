"""The engine: a model, its page pool, its tokenizer, and the scheduler that
owns every sequence on them."""
from __future__ import annotations

import math
import zlib
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterable

import torch

from agentkv.cache.kv_tier import KVTier
from agentkv.cache.pool import PagePool
from agentkv.cache.radix import RadixCache
from agentkv.engine.decode_graphs import MAX_BATCH, DecodeGraphs
from agentkv.engine.errors import InvalidRequestError
from agentkv.engine.grammar import GrammarCache
from agentkv.engine.kv_policy import KVPolicy
from agentkv.engine.limits import Limits
from agentkv.engine.message_log import CONTINUATIONS
from agentkv.engine.programs import ProgramAdmission
from agentkv.engine.retention import Retention, RetentionConfig
from agentkv.engine.runner import ModelRunner
from agentkv.engine.scheduler import Scheduler
from agentkv.engine.sequence import owner_of
from agentkv.engine.sequences import Sequences
from agentkv.engine.session import Session, SessionContext
from agentkv.engine.request import Request
from agentkv.engine.stats import EngineMetrics, TurnStats
from agentkv.engine.turn import Conversation, Turn, TurnResult
from agentkv.model.config import ModelConfig
from agentkv.model.default import default_model_dir
from agentkv.model.errors import ModelLoadError
from agentkv.model.llama import Transformer
from agentkv.model.loader import load_model, load_tokenizer, parse_dtype
from agentkv.model.tokenizer import Tokenizer
from agentkv.spec.drafters import Drafters

__all__ = ["Engine"]

DEFAULT_KV_CACHE_BYTES = 1 << 30
DEFAULT_KV_OFFLOAD_BYTES = 4 << 30
DEFAULT_KV_OFFLOAD_DISK_BYTES = 16 << 30


def model_identity(model: Transformer) -> dict:
    """What KV saved for this model must match: its shape and a fingerprint of its weights."""
    crc = 0
    for name, p in sorted(model.state_dict().items()):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(p.detach().flatten()[:4096].float().cpu().numpy().tobytes(), crc)
    return {"config": repr(model.cfg), "dtype": str(model.dtype), "weights_crc32": crc}


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
        limits: Limits | None = None,
        retention: str | RetentionConfig = "tool",
        kv_offload_bytes: int = DEFAULT_KV_OFFLOAD_BYTES,
        kv_offload_dir: str | Path | None = None,
        kv_offload_disk_bytes: int = DEFAULT_KV_OFFLOAD_DISK_BYTES,
        kv_offload_codec: str = "pool",
        continuation: str = "native",
        preposition: bool = True,
        kv_resume: bool = True,
        drafter: str = "suffix",
        forced_drafts: bool = True,
        schema_drafts: bool = False,
        decode_graphs: bool | None = None,
        program_admission: bool = True,
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
        self.limits = limits or Limits()
        self.max_context = cfg.max_position_embeddings
        # Decode and fixed-length verify steps at fixed shapes (engine/decode_graphs.py):
        # None, on a CUDA device, as CUDA graphs; True, elsewhere too, run
        # eagerly (how the CPU tests run that path); False, every step eager
        # (vLLM's --enforce-eager).
        if decode_graphs is None:
            decode_graphs = model.device.type == "cuda"
        graphs = DecodeGraphs(model, self.pool, self.max_context,
                              min(MAX_BATCH, self.limits.max_num_seqs)) if decode_graphs else None
        self.runner = ModelRunner(model, self.pool, graphs)
        self.stateless = stateless
        self.radix = RadixCache(self.pool) if prefix_cache and not stateless else None
        try:
            config = retention if isinstance(retention, RetentionConfig) else RetentionConfig(mode=retention)
            # The second tier: where KV leaving the pool goes (cache.kv_tier).
            self.tier = None if stateless or kv_offload_bytes <= 0 else KVTier(
                self.pool, kv_offload_bytes, kv_offload_dir, kv_offload_disk_bytes, kv_offload_codec,
                model_identity(model))
            policy = KVPolicy(self.pool, self.radix, prefix_match, Retention(config), self.tier)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        self.retention = policy.retention
        # KV persisted by an earlier run: verified; what fails is reported and recomputes. Not where
        # replicas share the disk tier: what is there is theirs, taken up one session at a time (adopt).
        if self.tier is not None and kv_resume:
            self.tier.load()
        self.prefix_match = prefix_match
        # Plain LRU pins nothing: every idle session may give way at once.
        self.pin_ttl = 0.0 if config.mode == "lru" else pin_ttl
        # Under tool_choice "auto", hold a call the model opens to the tools'
        # schemas (engine.structured). Off, "auto" decodes unconstrained, as
        # servers that only parse calls do.
        self.constrain_auto = constrain_auto
        # How a chat turn on a session finds what it holds (engine.turn):
        # "native" continues from the tokens the model produced, matched by
        # message; "template-faithful" re-renders the history as a stateless
        # server would and reuses up to the first differing token.
        if continuation not in CONTINUATIONS:
            raise InvalidRequestError(f"continuation must be one of {CONTINUATIONS}, got {continuation!r}")
        self.continuation = continuation
        # After a native turn ends on tool calls, hold the template's opening
        # of their results for the scheduler to compute while idle.
        self.preposition = preposition
        tokenizer_eos = tokenizer.eos_token_ids if tokenizer is not None else []
        self.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(tokenizer_eos))
        decode = tokenizer.decode if tokenizer is not None else None
        self.sequences = Sequences(self.pool, policy, self.limits.max_sessions)
        # Speculation's draft source (spec.drafters): "suffix" trees over the
        # session and its namespace's recent outputs, or "ngram" prompt lookup;
        # forced_drafts: what a grammar forces next is drafted first;
        # schema_drafts: inside a call, the tool's schema names are drafts too
        # (off by default: on the agent model they measured no gain, docs/bench_spec.md).
        try:
            self.drafters = Drafters(drafter, forced_drafts, schema_drafts, owner=owner_of)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        # Programs (a session's turns) are admitted whole while their KV fits
        # the pool and the host tier (engine.programs); off, every request is.
        ps = self.pool.page_size
        tier_pages = self.tier.host_bytes // (self.tier.token_bytes * ps) if self.tier is not None else 0
        programs = ProgramAdmission(self.pool.num_pages + tier_pages, ps, self.sequences.family, program_admission,
                                    policy)
        self.scheduler = Scheduler(self.runner, self.pool, policy, self.sequences, self.limits, self.max_context,
                                   self.eos_token_ids, decode, self.drafters, programs)
        # Guards the pool, the sequences and the model (the scheduler's lock).
        self.lock = self.scheduler.lock
        self._session_context = SessionContext(self.scheduler, self.sequences, self.tier, cfg.vocab_size,
                                               self.max_context, tokenizer is not None)
        self._grammars: GrammarCache | None = None

    @property
    def stats(self) -> deque[TurnStats]:
        """Per-turn records, the most recent last (a ring of Limits.max_stats)."""
        return self.scheduler.stats

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
        chat_template: str | None = None,
        **kwargs,
    ) -> "Engine":
        """Load a Hugging Face checkpoint directory or a GGUF file; with no path, the embedded
        default model (made on first use, no download). dtype "auto": the
        checkpoint's own where the device computes in it (model.loader.resolve_dtype).
        chat_template: a template that replaces the checkpoint's own."""
        path = Path(path) if path is not None else default_model_dir()
        parse_dtype(dtype)  # a bad name fails before the default model is made
        model = load_model(path, dtype, device)
        tokenizer = load_tokenizer(path)
        if chat_template is not None:
            if tokenizer is None:
                raise ModelLoadError(f"{path} has no tokenizer to give a chat template to")
            tokenizer = tokenizer.with_chat_template(chat_template)
        return cls(model, tokenizer, **kwargs)

    def session(self, namespace: str = "default", pin_ttl: float | None | str = "default", *,
                tokens: list[int] = (), key: str | None = None, counted: bool = True) -> Session:
        """A persistent conversation in namespace (a tenant's cache salt: no
        KV is shared across namespaces). pin_ttl: seconds its pages stay
        pinned while idle (None: always), default the engine's. A session
        resumed after a restart passes its tokens (held, not computed: its
        next request restores what the second tier has under key).
        counted: it counts against limits.max_sessions (TooManySessionsError
        at the limit); False for a request's own sequence or a stored
        response's, which the queue and the response store bound."""
        ttl = self.pin_ttl if pin_ttl == "default" else pin_ttl
        return Session(self._session_context, self.sequences.new(namespace, ttl, tokens, key=key, counted=counted))

    def cache_stats(self) -> dict:
        """Prefix-cache counters and page usage."""
        stats = self.radix.stats() if self.radix is not None else {}
        with self.lock:
            pinned = self._pinned_pages()
        return {
            **stats,
            "pages_total": self.pool.num_pages,
            "pages_free": self.pool.num_free,
            "pages_pinned": len(pinned),  # held by live sessions: never evicted
            "pages_shared": sum(1 for rc in self.pool.refcount if rc > 1),
            **({f"tier_{k}": v for k, v in asdict(self.tier.counters).items()} | {
                "tier_host_bytes": self.tier.host_used, "tier_disk_bytes": self.tier.disk_used}
               if self.tier is not None else {}),
        }

    def metrics(self) -> EngineMetrics:
        """The gauges and counters a server exports, read together."""
        with self.lock:
            sched, pool = self.scheduler, self.pool
            pinned = self._pinned_pages()
            tier = self.tier
            return EngineMetrics(
                pages_total=pool.num_pages, pages_free=pool.num_free, pages_used=pool.num_used,
                page_size=pool.page_size, pages_pinned=len(pinned),
                prefix_cache_pages=self.radix.stats().get("cached_pages", 0) if self.radix is not None else 0,
                in_flight=sched.in_flight, running=len(sched.running), waiting=len(sched.waiting),
                counters=sched.counters, turn_totals=dict(sched.turn_totals),
                programs=sched.programs.counts(sched.waiting, self.sequences.all),
                admission_refusals=sched.programs.refusals,
                tier=tier.counters if tier is not None else None,
                tier_host_bytes=tier.host_used if tier is not None else 0,
                tier_disk_bytes=tier.disk_used if tier is not None else 0,
            )

    def _pinned_pages(self) -> set[int]:
        return {p for s in self.sequences.all for p in s.table.pages}

    def kv_pages_held(self, sessions: Iterable[Session]) -> int:
        """Pages the sessions hold in the pool (each shared page once) plus the
        pages' worth of tokens the second tier holds for them (each entry once:
        a fork shares its parent's)."""
        pages: set[int] = set()
        keys: set[str] = set()
        for s in sessions:
            if not s.closed:
                pages.update(s.table.held_pages())
                keys.add(s.key)
        tier = self.tier
        offloaded = sum(math.ceil(tier.tokens_held(k) / self.pool.page_size) for k in keys) if tier is not None else 0
        return len(pages) + offloaded

    # -- serving: a front end runs the scheduler's loop and its saved KV --

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    @property
    def serving(self) -> bool:
        """Whether the scheduler's loop runs (what serves every request of a server)."""
        return self.scheduler.serving

    @property
    def in_flight(self) -> int:
        """Requests queued or running."""
        return self.scheduler.in_flight

    def start_serving(self) -> None:
        """Step in a background thread, so that requests from many callers share each forward."""
        self.scheduler.start()

    def stop_serving(self) -> None:
        """Stop the loop; requests still queued or running fail (rolled back)."""
        self.scheduler.stop()

    @property
    def kv_reports(self) -> list[str]:
        """What loading or restoring saved KV found wrong, for operators."""
        return list(self.tier.reports) if self.tier is not None else []

    def adopt_saved_kv(self, key: str) -> None:
        """Take up KV another replica saved under key (a shared disk tier)."""
        if self.tier is not None:
            self.tier.adopt(key)

    def drop_saved_kv(self, keep: set[str]) -> None:
        """Remove saved KV that no session or response claims."""
        tier = self.tier
        for key in tier.persistent_keys() if tier is not None else []:
            if key not in keep:
                tier.drop(key, persistent=True)

    def chat(self, messages: list[dict], tools: list[dict] | None = None, session: Session | None = None,
             max_tokens: int | Callable[[int], int] = 256, **kwargs) -> TurnResult:
        """Find what of the conversation the session holds (its message log,
        or the longest common prefix with the rendered conversation; see
        engine.turn), compute only the rest, and generate the reply.
        The session (a temporary one when None) ends holding the prompt and
        the reply; on error it is as before. tool_choice, response_format and
        parallel_tool_calls (OpenAI's shapes) constrain the reply with a
        grammar (engine.structured); the rest are start_turn's arguments.
        start_chat is the same, returning once the turn is queued."""
        return self.start_chat(messages, tools, session, max_tokens, **kwargs).wait()

    def start_chat(self, messages: list[dict], tools: list[dict] | None = None, session: Session | None = None,
                   max_tokens: int | Callable[[int], int] = 256, **kwargs) -> Turn:
        return self.start_turn(Conversation(messages, tools), session, max_tokens=max_tokens, **kwargs)

    def start_turn(self, prompt: Conversation | list[int], session: Session | None = None, **kwargs) -> Turn:
        """One turn of any API (chat messages or token ids; engine.turn): queued
        now, finished by the returned Turn's finish() once its request is done."""
        return Turn.start(self, prompt, session, **kwargs)

    def wait(self, request: Request) -> Request:
        """Until request is done (stepping the scheduler here if no loop runs)."""
        return self.scheduler.wait(request)
