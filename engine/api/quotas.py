"""Per-tenant quotas: how much of the server one tenant may hold or use at
once, so that no tenant can crowd out another or exhaust a resource. They
apply with API keys configured; an open server has one tenant, bounded by
the server-wide limits (engine.limits). The body limit and the default
max_tokens apply always.

Each is checked before anything changes: a request over one is refused
with 429 (413 for a body that is too large) and leaves every session,
response and page as it was. Held resources (sessions, stored responses,
KV pages) come back when the tenant deletes or releases what it holds;
concurrency, when its requests finish (Retry-After says so).
"""
from __future__ import annotations

from dataclasses import dataclass

from agentkv.engine.api.errors import APIError

# When neither the model's generation config nor --default-max-tokens says:
# a budget that ends a runaway generation without cutting real replies.
FALLBACK_MAX_TOKENS = 4096


@dataclass(frozen=True)
class Quotas:
    max_sessions: int = 1024  # live named sessions
    max_responses: int = 1024  # stored responses (previous_response_id)
    max_concurrent: int = 64  # requests in flight, streams included
    max_kv_pages: int | None = None  # KV pages its sessions and responses hold in the pool and the second tier
    max_body_bytes: int = 8 << 20  # one request body
    default_max_tokens: int | None = None  # a request's budget when it names none (None: the model's)

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_responses", "max_concurrent", "max_kv_pages", "max_body_bytes",
                     "default_max_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def refuse(what: str, held: int, limit: int, advice: str) -> APIError:
    return APIError(429, f"this tenant holds {held} {what}, its quota of {limit}; {advice}",
                    type="rate_limit_error", code="quota_exceeded")


def check_held(what: str, held: int, limit: int | None, advice: str) -> None:
    """429 if one more would exceed the quota."""
    if limit is not None and held >= limit:
        raise refuse(what, held, limit, advice)
