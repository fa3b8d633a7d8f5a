"""Torch references of every kernel op: the CPU implementation and the oracle
the Triton kernels are tested against.

Layouts (shared with the Triton kernels):
  q            [T, Hq, D]        new tokens of a ragged step, T = sum of query lens
  k, v         [T, Hkv, D]
  k_cache      [P, page_size, Hkv, D]   one layer's K pages (v_cache likewise), any
               strides with page and slot mergeable per head; the pool stores
               them head-major ([Hkv, P, page_size, D] in memory)
  kv           [L, 2, P, page_size, Hkv, D]   the whole pool, all layers
  cos, sin     [max_pos, D // 2]  float32 RoPE tables (HF "rotate_half" convention)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from agentkv.kernels.metadata import AttnMetadata


# A sequence's keys are attended in fixed LOGICAL blocks: block b holds keys
# [b * n, (b + 1) * n), n this many keys rounded up to whole pages. Every
# matmul and every sum over pieces then runs over the same pieces in the same
# order wherever the pages lie in the pool, so the result does not depend on
# placement (merging physically consecutive pages instead made fp32 logits
# move by 6e-8 when one page moved). The price: a block whose pages are not
# consecutive is gathered, a copy that can cost as much as the attention
# over it.
KEY_BLOCK = 4096

Piece = slice | torch.Tensor


def _key_blocks(pages: list[int], page_size: int, length: int, device: torch.device) -> list[Piece]:
    """Keys [0, length) by logical block, as slots of the by-head cache: a
    slice (read in place) where the block's pages are consecutive, else a
    gather index (that block alone is copied)."""
    per_block = -(-KEY_BLOCK // page_size)
    blocks: list[Piece] = []
    for first in range(0, len(pages), per_block):
        block = pages[first : first + per_block]
        n = min(len(block) * page_size, length - first * page_size)
        if block == list(range(block[0], block[0] + len(block))):
            blocks.append(slice(block[0] * page_size, block[0] * page_size + n))
        else:
            index = torch.tensor(block, dtype=torch.int64, device=device)
            blocks.append((index[:, None] * page_size + torch.arange(page_size, device=device)).reshape(-1)[:n])
    return blocks


def _torch_plan(
    meta: AttnMetadata, sliding_window: int, longer_than: int = 0
) -> list[tuple[list[Piece], torch.Tensor | None] | None]:
    """Per sequence with more than longer_than queries (None for the rest,
    which another kernel runs): its keys [0, L) by logical block
    (_key_blocks) and, only when a sliding window cuts into them, the chunk's
    boolean mask [Δ, L]. A plain causal chunk needs no mask: see _chunk_attention."""
    plan: list[tuple[list[Piece], torch.Tensor | None] | None] = []
    device = meta.block_tables.device
    ps = meta.page_size
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        if q_len <= longer_than:
            plan.append(None)
            continue
        pages = meta.block_tables[i, : -(-s_len // ps)].tolist()
        mask = None
        if sliding_window > 0 and s_len > sliding_window:
            q_pos = torch.arange(s_len - q_len, s_len, device=device)[:, None]
            k_pos = torch.arange(s_len, device=device)[None, :]
            mask = (k_pos <= q_pos) & (k_pos > q_pos - sliding_window)
        plan.append((_key_blocks(pages, ps, s_len, device), mask))
    return plan


def _by_head(cache: torch.Tensor) -> torch.Tensor:
    """[P, page_size, Hkv, D] -> [Hkv, P * page_size, D], a view: each head's
    slots in page order. In the pool's head-major layout a block of consecutive
    pages is then one contiguous piece per head, which matmuls read in place."""
    num_pages, page_size, num_kv_heads, head_dim = cache.shape
    return cache.permute(2, 0, 1, 3).view(num_kv_heads, num_pages * page_size, head_dim)


def _pieces(flat: torch.Tensor, blocks: list[Piece]) -> list[torch.Tensor]:
    # flat: [Hkv, P * page_size, D] -> pieces [Hkv, n, D] (views for slices)
    return [flat[:, b] if isinstance(b, slice) else flat.index_select(1, b) for b in blocks]


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The pieces as one [Hkv, L, D]: the piece itself when there is one. A
    view or a copy of the same keys gives bit-identical attention (measured;
    tests/test_invariance.py holds it), so a sequence whose pages are
    consecutive is not copied for that."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


# On CPU a bf16 batched matmul over the pool's head-strided views falls off
# oneDNN's fast path, where per-head matmuls stay on it (docs/bench_turns_cpu.md).
# Each per-head call has a set-up cost, so only pieces of at least this many
# keys go that way.
PER_HEAD_MIN_KEYS = 1024


def _matmul_by_kv_head(a: torch.Tensor, b: torch.Tensor, num_keys: int) -> torch.Tensor:
    """a @ b for [Hkv, m, k] @ [Hkv, k, n], over a piece of num_keys keys."""
    if a.device.type == "cpu" and a.dtype == torch.bfloat16 and num_keys >= PER_HEAD_MIN_KEYS:
        return torch.stack([torch.mm(x, y) for x, y in zip(a, b)])
    return torch.matmul(a, b)


def _few_queries_over_pieces(
    q: torch.Tensor, k_parts: list[torch.Tensor], v_parts: list[torch.Tensor], scale: float
) -> torch.Tensor:
    """A few queries [Δ, Hq, D] (a decode step, a speculative verify) at the
    end of keys held in pieces (the logical blocks), without joining them
    (joining copies the whole context in every layer): scores of all pieces
    side by side, causal within the last Δ keys, one softmax, outputs summed
    by piece in block order."""
    num_q, num_q_heads, head_dim = q.shape
    num_kv_heads = k_parts[0].shape[0]
    group = num_q_heads // num_kv_heads
    # [Hkv, G * Δ, D]: each KV head's query group as one block of rows.
    qg = q.transpose(0, 1).reshape(num_kv_heads, group * num_q, head_dim)
    scores = torch.cat([_matmul_by_kv_head(qg, k.transpose(1, 2), k.shape[1]) for k in k_parts], dim=-1)
    scores = scores.float() * scale
    if num_q > 1:
        future = torch.ones(num_q, num_q, dtype=torch.bool, device=q.device).triu(1)
        tail = scores[..., -num_q:].view(num_kv_heads, group, num_q, num_q)
        tail.masked_fill_(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out, offset = None, 0
    for v in v_parts:
        part = _matmul_by_kv_head(probs[..., offset : offset + v.shape[1]], v, v.shape[1])
        out = part if out is None else out + part
        offset += v.shape[1]
    return out.view(num_q_heads, num_q, head_dim).transpose(0, 1)


# Up to this many queries a chunk reads its keys in place (_few_queries_over_pieces);
# longer chunks join them (_chunk_attention).
FEW_QUERIES = 16


_attention_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

# Query rows per block in _chunk_attention_bf16: a block's scores [rows, keys]
# are written, softmaxed and read again, so they should stay near the cache
# (256 beat 128 and 512 at 2k-20k keys).
BF16_BLOCK_ROWS = 256


def _chunk_attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """_chunk_attention for bf16 on CPU. oneDNN's bf16 GEMM (AVX512-BF16)
    runs faster than fp32, a rate the flash kernel does not reach in bf16
    (docs/bench_turns_cpu.md, round 3). So: plain matmuls per
    query head over blocks of queries, each block's keys cut at its last
    query (nothing past it is computed) and the causal triangle masked in
    its last columns. As in Hugging Face's eager bf16 attention, the scores
    are rounded to bf16 before a softmax computed in fp32."""
    num_q, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_q_heads // num_kv_heads
    cached = k.shape[1] - num_q
    qh = (q * scale).transpose(0, 1)  # [Hq, Δ, D]
    out = torch.empty(num_q_heads, num_q, head_dim, dtype=q.dtype, device=q.device)
    future = torch.ones(BF16_BLOCK_ROWS, BF16_BLOCK_ROWS, dtype=torch.bool, device=q.device).triu(1)
    for head in range(num_q_heads):
        kh, vh = k[head // group], v[head // group]
        for start in range(0, num_q, BF16_BLOCK_ROWS):
            rows = min(BF16_BLOCK_ROWS, num_q - start)
            seen = cached + start + rows
            scores = torch.mm(qh[head, start : start + rows], kh[:seen].t())
            scores[:, seen - rows :].masked_fill_(future[:rows, :rows], float("-inf"))
            torch.mm(torch.softmax(scores, dim=-1), vh[:seen], out=out[head, start : start + rows])
    return out.transpose(0, 1)


def _chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk of Δ queries [Δ, Hq, D] at the end of L keys [Hkv, L, D], causal
    within the chunk, without a mask: a boolean mask sends SDPA down a path
    that reads all Δ x L scores, about twice the cost of its causal path.

    The keys split in two: the cached prefix, which every query sees whole,
    and the chunk itself, which is causal. The prefix part folds each KV
    head's query group into one longer query block (no K/V copies for GQA);
    the two parts merge by their log-sum-exps. bf16 on CPU goes to
    _chunk_attention_bf16 instead."""
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        return _chunk_attention_bf16(q, k, v, scale)
    num_q, num_q_heads, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[0], k.shape[1]
    group = num_q_heads // num_kv_heads
    cached = num_keys - num_q
    qh = q.transpose(0, 1)  # [Hq, Δ, D]
    if q.device.type != "cpu":
        # The log-sum-exp op is the CPU flash kernel; elsewhere (the oracle
        # of the GPU kernel tests) a mask costs nothing that matters.
        mask = torch.ones(num_q, num_keys, dtype=torch.bool, device=q.device).tril(cached)
        out = F.scaled_dot_product_attention(qh[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    k_new = k[:, cached:].repeat_interleave(group, dim=0)
    v_new = v[:, cached:].repeat_interleave(group, dim=0)
    o_new, lse_new = _attention_with_lse(qh[None], k_new[None], v_new[None], 0.0, True, scale=scale)
    if cached == 0:
        return o_new[0].transpose(0, 1)
    q_folded = qh.reshape(num_kv_heads, group * num_q, head_dim)
    o_old, lse_old = _attention_with_lse(q_folded[None], k[None, :, :cached], v[None, :, :cached], 0.0, False, scale=scale)
    o_old = o_old.reshape(num_q_heads, num_q, head_dim)
    lse_old = lse_old.reshape(num_q_heads, num_q)
    m = torch.maximum(lse_old, lse_new[0])
    w_old, w_new = (lse_old - m).exp()[..., None], (lse_new[0] - m).exp()[..., None]
    out = (o_old.float() * w_old + o_new[0].float() * w_new) / (w_old + w_new)
    return out.to(q.dtype).transpose(0, 1)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    scale: float,
    sliding_window: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = softmax(scale * q[t] K^T + mask) V over the keys its sequence holds
    at positions <= position(t) (and > position(t) - sliding_window when > 0),
    into out (shaped like q) when given, else a new tensor."""
    if out is None:
        out = torch.empty_like(q)
    paged_attention_into(out, q, k_cache, v_cache, meta, scale, sliding_window)
    return out


def paged_attention_into(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    scale: float,
    sliding_window: int = 0,
    longer_than: int = 0,
) -> None:
    """paged_attention into out's rows of the sequences with more than
    longer_than queries (another kernel does the rest)."""
    plan = meta.torch_plans.get((sliding_window, longer_than))
    if plan is None:
        plan = meta.torch_plans[sliding_window, longer_than] = _torch_plan(meta, sliding_window, longer_than)
    k_flat, v_flat = _by_head(k_cache), _by_head(v_cache)
    start = 0
    for q_len, seq_plan in zip(meta.query_lens_list, plan):
        if seq_plan is None:
            start += q_len
            continue
        blocks, mask = seq_plan
        qi = q[start : start + q_len]
        k_parts, v_parts = _pieces(k_flat, blocks), _pieces(v_flat, blocks)
        if mask is None and q_len <= FEW_QUERIES:
            out[start : start + q_len] = _few_queries_over_pieces(qi, k_parts, v_parts, scale)
        else:
            k, v = _joined(k_parts), _joined(v_parts)
            if mask is None:
                out[start : start + q_len] = _chunk_attention(qi, k, v, scale)
            else:
                oi = F.scaled_dot_product_attention(
                    qi.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
                )
                out[start : start + q_len] = oi[0].transpose(0, 1)
        start += q_len


def naive_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """The oracle of paged_attention and the CPU kernel, in float64: each query
    on its own, its visible keys gathered slot by slot through the block table,
    one plain softmax. Slow; for tests."""
    num_q_heads = q.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    tables = meta.block_tables.tolist()
    cu = meta.cu_seqlens_q.tolist()
    for i, s_len in enumerate(meta.seq_lens_list):
        for t in range(cu[i], cu[i + 1]):
            pos = s_len - (cu[i + 1] - t)
            lo = max(0, pos - sliding_window + 1) if sliding_window > 0 else 0
            keys = range(lo, pos + 1)
            pages = [tables[i][p // meta.page_size] for p in keys]
            slots = [p % meta.page_size for p in keys]
            k = k_cache[pages, slots].double()  # [n, Hkv, D]
            v = v_cache[pages, slots].double()
            group = num_q_heads // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            probs = (torch.einsum("hd,nhd->hn", q[t].double(), k) * scale).softmax(-1)
            out[t] = torch.einsum("hn,nhd->hd", probs, v)
    return out


def _rope_factors(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin at the step's positions, [T, 1, D] each, for
    x * c + swap_halves(x) * s: the rotation in HF's rotate_half form with
    -sin folded into the first half (a - b and a + (-b) round alike)."""
    c = cos.index_select(0, positions)
    s = sin.index_select(0, positions)
    return torch.cat((c, c), dim=-1)[:, None, :], torch.cat((-s, s), dim=-1)[:, None, :]


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x fresh (the caller's copy), rotated in place in fp32; in place and out
    of place round alike, and fp32 skips the casts (two dispatches a layer)."""
    t, heads, dim = x.shape
    xf = x if x.dtype == torch.float32 else x.float()
    swapped = xf.view(t, heads, 2, dim // 2).flip(2).view(t, heads, dim)
    rotated = xf.mul_(c).add_(swapped.mul_(s))
    return rotated if rotated.dtype == x.dtype else rotated.to(x.dtype)


def rope_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """Rotate q and k at meta.positions, write rotated k and v into their page
    slots (meta.slot_mapping); return rotated q. With q_norm and k_norm
    (Qwen3's, [D] each), every head of q and k is first RMS-normalized
    (rmsnorm, with eps) by them."""
    if q_norm is not None:
        q, k = rmsnorm(q, q_norm, eps)[0], rmsnorm(k, k_norm, eps)[0]
    # The factors depend on the step alone: made by the first layer, shared
    # by the rest (tables of other sizes, as tests pass, are made afresh).
    if meta.torch_rope is None or meta.torch_rope[0] is not cos:
        meta.torch_rope = (cos, *_rope_factors(cos, sin, meta.positions))
    # q and k rotated in one pass: rotation is elementwise, so joining them
    # changes no bit and halves the ops.
    num_q_heads = q.shape[1]
    qk = _rotate(torch.cat((q, k), dim=1), *meta.torch_rope[1:])  # cat: a fresh tensor, rotated in place
    # Through a [P * page_size, Hkv, D] view (page and slot merge in any
    # layout this file takes; view, unlike reshape, never writes to a copy):
    # two ops a cache fewer than through _by_head.
    slots = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(slots, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, qk[:, num_q_heads:])
    v_cache.view(slots, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, v)
    return qk[:, :num_q_heads]


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """With a residual: h = x + residual; returns (weight * h / rms(h), h).
    Without: returns (weight * x / rms(x), x). Statistics in float32, as HF."""
    if residual is not None:
        x = x + residual
    if x.dtype == weight.dtype == torch.float32:
        # torch's fused op runs the very steps below in C++ (x * rsqrt(mean(x^2)
        # + eps), times weight), bit for bit, without a Python call for each.
        return F.rms_norm(x, weight.shape, weight, eps), x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [gate | up] of a fused gate/up projection
    [T, 2 * intermediate]. Slices, not Tensor.split (a Python wrapper);
    silu's fresh output takes the product in place (the same rounding as
    silu(gate) * up)."""
    n = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :n]).mul_(gate_up[:, n:])


def copy_pages(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """kv[:, :, dst[i]] = kv[:, :, src[i]] for every layer, K and V."""
    kv[:, :, dst] = kv[:, :, src]


def _inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The first index whose cumulative mass exceeds u times the row's total
    (fp64, so the CDF never wobbles), or the last index with positive mass
    when rounding leaves u * total at or past the end."""
    cdf = probs.double().cumsum(0)
    idx = int(torch.searchsorted(cdf, u * float(cdf[-1]), right=True))
    if idx < probs.shape[0]:
        return idx
    positive = (probs > 0).nonzero()
    return int(positive[-1]) if len(positive) else 0


def verify_drafts(
    target: torch.Tensor,
    cu_rows: torch.Tensor,
    drafts: torch.Tensor,
    draft_lens: torch.Tensor,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each sequence's drafts and pick the token after it.

    target [R, V]: sequence i's rows cu_rows[i] .. cu_rows[i+1] (draft_lens[i] + 1
    of them) are the target's distributions at its draft positions and one
    beyond. drafts [B, K] int64 (padded), draft_lens [B] int32 in [0, K].
    Returns num_accepted [B] int32 and next_token [B] int64.

    Greedy (uniforms None, target = logits): accept while argmax(row j) ==
    drafts[i, j]; next_token = argmax of the first mismatching row (row
    draft_len if all match); ties go to the lowest index.

    Sampling (uniforms [B, K+1] in [0, 1), target = probabilities): the draft
    is a point mass, so speculative sampling accepts x = drafts[i, j] iff
    u_j < p_j(x). On the first rejection the token is drawn from the residual,
    p_j with x removed and renormalised, by inverse CDF with the rescaled
    uniform (u_j - p_j(x)) / (1 - p_j(x)), which given the rejection is
    U[0, 1): the emitted token is distributed exactly as p_j. If every draft
    is accepted, the token is drawn from row draft_len with u_{draft_len}.
    Inverse CDF means the first index whose cumulative mass exceeds u times
    the row's total, as a plain decode step draws its token.
    """
    starts = cu_rows.tolist()
    lens = draft_lens.tolist()
    best = target.argmax(-1).tolist() if uniforms is None else None
    num_accepted, next_token = [], []
    for i, n in enumerate(lens):
        first = starts[i]
        if starts[i + 1] - first != n + 1:
            raise ValueError(f"sequence {i} has {starts[i + 1] - first} rows for {n} drafts")
        draft = drafts[i, :n].tolist()
        if best is not None:
            accepted = next((j for j in range(n) if best[first + j] != draft[j]), n)
            token = best[first + accepted]
        else:
            u = uniforms[i].double().tolist()
            rows = target[first : first + n + 1]
            accepted = next((j for j in range(n) if not u[j] < float(rows[j, draft[j]])), n)
            if accepted < n:
                x = draft[accepted]
                p_x = float(rows[accepted, x])
                residual = rows[accepted].clone()
                residual[x] = 0.0
                token = _inverse_cdf(residual, (u[accepted] - p_x) / (1.0 - p_x))
            else:
                token = _inverse_cdf(rows[n], u[n])
        num_accepted.append(accepted)
        next_token.append(token)
    device = target.device
    return (
        torch.tensor(num_accepted, dtype=torch.int32, device=device),
        torch.tensor(next_token, dtype=torch.int64, device=device),
    )
