"""Speculation through the engine, with each drafter (n-gram prompt lookup,
suffix trees) and with fixed drafts: greedy output identical to plain
decoding (also under a grammar, ending at a stop, at max_tokens, at the
grammar's end), sampling with the target's distribution, rollback exact, and
no draft from another namespace's outputs."""
import pytest
import torch

import agentkv.engine.scheduler as scheduler_module
from agentkv import Engine
from agentkv.engine.step_observer import StepObserver
from agentkv.engine.structured import request_grammar
from agentkv.model.default import SMALL_MODEL_DIR, random_init
from agentkv.model.sampler import SamplingParams, make_generator, probs_from_logits
from agentkv.spec.drafters import DRAFTING
from agentkv.spec.schema_phrases import continuations, schema_phrases
from tests.conftest import assert_all_pages_free
from tests.hf_models import make_hf_model

VOCAB = 320


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec")
    make_hf_model("qwen2-qkvbias", path, seed=3)
    return path


@pytest.fixture(params=DRAFTING)
def engine(ckpt, request):
    return Engine.from_pretrained(ckpt, page_size=8, num_pages=96, drafter=request.param)


def prompt_with_repeats(seed: int, n: int = 40) -> list[int]:
    """Random tokens with copied spans, so the drafter has something to find."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, VOCAB, (n,), generator=g).tolist()
    span = base[5:17]
    return base + span + base[20:30] + span[:6]


def check_consistent(s) -> None:
    # The newest generated token is held but not yet computed; nothing more.
    assert s.table.length == len(s) - 1
    assert len(s.table.pages) == -(-s.table.length // 8)


class StubDrafter:
    """Stands in for the n-gram drafter; keeps no history of its own."""

    draft_len = 6

    def __len__(self) -> int:
        return 0

    def extend(self, tokens) -> None:
        pass

    def truncate(self, n: int) -> None:
        pass

    def record(self, drafted: int, accepted: int) -> None:
        pass


class NoDrafter(StubDrafter):
    """Asks for drafts and never has one."""

    def propose(self, k: int, shared: bool = True) -> list[int]:
        return []


class FixedDrafter(StubDrafter):
    """Always proposes the same tokens."""

    def __init__(self, draft: list[int]):
        self.draft, self.draft_len = draft, len(draft)

    def propose(self, k: int, shared: bool = True) -> list[int]:
        return self.draft[:k]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_k", [1, 3, 8])
def test_greedy_identical_with_and_without_speculation(engine, seed, max_k):
    prompt = prompt_with_repeats(seed)
    outs, stats = [], []
    for speculative in (False, True):
        with engine.session() as s:
            s.append(prompt)
            if speculative:
                s.drafter().max_k = max_k
            outs.append(s.generate(max_tokens=48, ignore_eos=True, speculative=speculative))
            stats.append(engine.stats[-1])
            check_consistent(s)
            assert s.tokens == prompt + outs[-1]
    assert outs[0] == outs[1]
    assert stats[0].drafted_tokens == 0
    assert stats[1].decode_steps <= stats[0].decode_steps


def test_speculation_accepts_and_rejects_and_saves_forwards(engine):
    drafted = accepted = steps_on = steps_off = 0
    for seed in range(6):
        prompt = prompt_with_repeats(seed)
        for speculative in (False, True):
            with engine.session() as s:
                s.append(prompt)
                s.generate(max_tokens=48, ignore_eos=True, speculative=speculative)
                st = engine.stats[-1]
                if speculative:
                    drafted, accepted, steps_on = drafted + st.drafted_tokens, accepted + st.accepted_tokens, steps_on + st.decode_steps
                else:
                    steps_off += st.decode_steps
    # Accepted drafts save forwards (random weights loop, so the n-gram
    # drafts are mostly right here; rejections are covered below).
    assert accepted > 0
    assert steps_on < steps_off


@pytest.mark.parametrize("seed", range(3))
def test_greedy_identical_under_partial_acceptance(engine, seed):
    prompt = prompt_with_repeats(seed)
    with engine.session() as s:
        s.append(prompt)
        truth = s.generate(max_tokens=40, ignore_eos=True, speculative=False)
    calls = [0]

    class Drafter(StubDrafter):
        def propose(self, k, shared=True):
            calls[0] += 1
            done = len(s) - len(prompt)
            right = calls[0] % (k + 1)
            rest = truth[done : done + right]
            wrong = [(truth[done + right] + 1) % VOCAB] if done + right < len(truth) else []
            return (rest + wrong)[:k]

    with engine.session() as s:
        s.append(prompt)
        s.use_drafter(Drafter())
        out = s.generate(max_tokens=40, ignore_eos=True)
        st = engine.stats[-1]
        check_consistent(s)
    assert out == truth
    assert 0 < st.accepted_tokens < st.drafted_tokens


@pytest.mark.parametrize("seed", range(4))
def test_stop_inside_a_draft_leaks_nothing(engine, seed):
    prompt = prompt_with_repeats(seed)
    with engine.session() as s:
        s.append(prompt)
        free_run = s.generate(max_tokens=40, ignore_eos=True, speculative=False)
    for stop_at in (2, 9, 25):
        stop_token = free_run[stop_at]
        expected = free_run[: free_run.index(stop_token) + 1]
        for max_tokens in (40, 7):
            with engine.session() as s:
                s.append(prompt)
                out = s.generate(max_tokens=max_tokens, stop_token_ids=[stop_token], speculative=True)
                assert out == expected[:max_tokens]
                assert s.tokens == prompt + out
                check_consistent(s)
                # The KV kept is exactly that of the emitted tokens.
                more = s.append([7, 8, 9], all_logits=True)
            with engine.session() as ref:
                torch.testing.assert_close(more, ref.append(prompt + out + [7, 8, 9], all_logits=True)[-3:], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_sampling_with_speculation_has_the_target_distribution(engine):
    """Joint law of the first two sampled tokens, with a fixed draft at the
    second position that is sometimes accepted: chi-square against the exact
    law computed from the model's own logits."""
    prompt = prompt_with_repeats(11, 20)
    params = SamplingParams(temperature=1.0, top_k=3)
    with engine.session() as s:
        p1 = probs_from_logits(s.append(prompt)[None], params)[0]
        support1 = p1.nonzero().flatten().tolist()
        exact, p2_of = {}, {}
        for t1 in support1:
            with s.fork() as f:
                p2_of[t1] = probs_from_logits(f.append([t1])[None], params)[0]
            for t2 in p2_of[t1].nonzero().flatten().tolist():
                exact[(t1, t2)] = float(p1[t1] * p2_of[t1][t2])
    # Draft the second most likely second token after the most likely first.
    top1 = max(support1, key=lambda t: float(p1[t]))
    draft = [int(p2_of[top1].argsort(descending=True)[1]), 0]
    counts = dict.fromkeys(exact, 0)
    trials, accepted = 600, 0
    for seed in range(trials):
        with engine.session() as s:
            s.append(prompt)
            s.use_drafter(FixedDrafter(draft))
            out = s.generate(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
            accepted += engine.stats[-1].accepted_tokens
            counts[tuple(out[:2])] += 1
    assert 0 < accepted < trials
    chi2 = sum((counts[c] - trials * p) ** 2 / (trials * p) for c, p in exact.items())
    # 8 degrees of freedom at most; 26.1 is the 0.999 quantile.
    assert chi2 < 26.1, (chi2, counts, exact)


def test_page_accounting_after_rejections(engine):
    with engine.session() as s:
        s.append(prompt_with_repeats(3))
        s.use_drafter(FixedDrafter([1, 2, 3, 4, 5, 6, 7]))  # almost always rejected: rollback every step
        s.generate(max_tokens=30, ignore_eos=True)
        check_consistent(s)
        engine.pool.check()
    assert_all_pages_free(engine)


@pytest.fixture
def suffix_engine(ckpt):
    return Engine.from_pretrained(ckpt, page_size=8, num_pages=96, drafter="suffix")


class DraftSpy(StepObserver):
    def __init__(self):
        self.seen: list[tuple[list[int], list[int]]] = []

    def on_draft(self, req, draft, seconds):
        self.seen.append((list(req.seq.tokens), draft))


def spy_drafts(engine) -> list[tuple[list[int], list[int]]]:
    """Every (history, draft) the scheduler proposes from now on."""
    spy = DraftSpy()
    engine.scheduler.add_observer(spy)
    return spy.seen


def test_suffix_drafts_copy_the_namespace_outputs_and_never_another_namespaces(suffix_engine):
    engine = suffix_engine
    outputs = engine.drafters.outputs
    prompt = prompt_with_repeats(5)
    with engine.session(namespace="a") as s:
        s.append(prompt)
        truth = s.generate(max_tokens=40, ignore_eos=True, speculative=False)
    assert len(outputs.get("a")) == 1 and len(outputs.get("b")) == 0  # a finished output joins its namespace
    # Another output in "a" continues this prompt's end with tokens no one wrote.
    fresh = [t for t in range(VOCAB) if t not in prompt + truth][:8]
    engine.drafters.finished("a", prompt[-12:] + truth[:1] + fresh)
    seen = spy_drafts(engine)
    with engine.session(namespace="a") as s:
        s.append(prompt)
        assert s.generate(max_tokens=40, ignore_eos=True) == truth
        assert s.drafter().from_outputs > 0
    assert any(d[:2] == fresh[:2] for _, d in seen)
    # The same prompt in namespace "b": never a draft from "a".
    seen.clear()
    with engine.session(namespace="b") as s:
        s.append(prompt)
        assert s.generate(max_tokens=40, ignore_eos=True) == truth
    assert seen and not any(set(d) & set(fresh) for _, d in seen)


@pytest.mark.slow
def test_sampling_with_suffix_drafts_has_the_target_distribution(suffix_engine, monkeypatch):
    """The chi-square test above with the suffix drafter's own drafts: the
    namespace's outputs (seeded with a likely pair, then every trial's own
    output) propose the second token. The requests carry no seed (a seeded
    one drafts from its own session only), but their generators are seeded
    here, so the test is repeatable."""
    engine = suffix_engine
    trial_seeds = iter(range(10**6))
    monkeypatch.setattr(scheduler_module, "make_generator", lambda seed: make_generator(next(trial_seeds)))
    prompt = prompt_with_repeats(11, 20)
    params = SamplingParams(temperature=1.0, top_k=3)
    with engine.session() as s:
        p1 = probs_from_logits(s.append(prompt)[None], params)[0]
        exact = {}
        for t1 in p1.nonzero().flatten().tolist():
            with s.fork() as f:
                p2 = probs_from_logits(f.append([t1])[None], params)[0]
            for t2 in p2.nonzero().flatten().tolist():
                exact[(t1, t2)] = float(p1[t1] * p2[t2])
    top1 = max(p1.nonzero().flatten().tolist(), key=lambda t: float(p1[t]))
    engine.drafters.finished("default", [top1, max((t2 for t1, t2 in exact if t1 == top1), key=lambda t2: exact[(top1, t2)])])
    counts = dict.fromkeys(exact, 0)
    trials = drafted = accepted = 0
    for _ in range(600):
        with engine.session() as s:
            s.append(prompt)
            out = s.generate(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
            st = engine.stats[-1]
            drafted, accepted = drafted + st.drafted_tokens, accepted + st.accepted_tokens
            counts[tuple(out[:2])] += 1
            trials += 1
    assert 0 < accepted < drafted
    chi2 = sum((counts[c] - trials * p) ** 2 / (trials * p) for c, p in exact.items())
    assert chi2 < 26.1, (chi2, counts, exact)


def test_a_seeded_sample_does_not_depend_on_other_sessions_outputs(suffix_engine):
    """Which tokens a seeded sample emits depends on what was drafted, so a
    seeded request drafts from its own session only: the namespace's outputs
    (here ones that continue the prompt) leave it unchanged, while an unseeded
    request does draft from them."""
    engine = suffix_engine
    prompt = prompt_with_repeats(7)

    def sample() -> list[int]:
        with engine.session() as s:
            s.append(prompt)
            return s.generate(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)

    before = sample()
    text = prompt + before
    g = torch.Generator().manual_seed(1)
    for i in range(len(prompt) + 1, len(text)):
        engine.drafters.finished("default", text[i - 12 : i] + torch.randint(0, VOCAB, (8,), generator=g).tolist())
    assert sample() == before

    def unseeded_drafts_from_outputs() -> int:
        with engine.session() as s:
            s.append(prompt)
            s.generate(max_tokens=24, temperature=1.0, ignore_eos=True)
            return s.drafter().from_outputs

    # Whether one unseeded reply finds a match in the outputs is chance (its
    # tokens are random; about 1 in 40 drafts none from them): five tries.
    assert any(unseeded_drafts_from_outputs() > 0 for _ in range(5))


def test_page_accounting_after_suffix_draft_rejections(suffix_engine):
    engine = suffix_engine
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    with engine.session(namespace="ref") as ref:
        ref.append(prompt)
        truth = ref.generate(max_tokens=30, ignore_eos=True, speculative=False)
    # Outputs that continue each point of the reply wrongly: their drafts are rejected.
    text = prompt + truth
    for i in range(len(prompt) + 1, len(text)):
        engine.drafters.finished("default", text[i - 12 : i] + torch.randint(0, VOCAB, (8,), generator=g).tolist())
    with engine.session() as s:
        s.append(prompt)
        assert s.generate(max_tokens=30, ignore_eos=True) == truth
        st = engine.stats[-1]
        assert st.drafted_tokens > st.accepted_tokens
        check_consistent(s)
        engine.pool.check()
    assert_all_pages_free(engine)


TOOL = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "required": ["path", "start"],
    "properties": {"path": {"type": "string", "maxLength": 12}, "start": {"type": "integer", "minimum": 1, "maximum": 99}}}}}]


@pytest.fixture(scope="module")
def default_model():
    eng = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=1)
    random_init(eng.model, 0)
    return eng.model, eng.tokenizer


@pytest.mark.parametrize("kind", DRAFTING)
def test_grammar_forced_drafts_end_exactly_at_a_stop_at_max_tokens_and_at_the_grammar_end(default_model, kind):
    engine = Engine(*default_model, num_pages=256, drafter=kind)
    grammar = request_grammar(engine, TOOL, "required", parallel_tool_calls=False)
    messages = [{"role": "user", "content": "Read src/app.py from line 12, then src/app.py again."}]
    prompt = engine.tokenizer.apply_chat_template(messages, tools=TOOL)

    def run(speculative, **kw):
        with engine.session() as s:
            s.append(prompt)
            out = s.generate(speculative=speculative, grammar=grammar, **kw)
            check = s.table.length == len(s) - 1 and len(s.table.pages) == -(-s.table.length // engine.pool.page_size)
            return out, s.finish_reason, engine.stats[-1], check

    plain, reason, _, _ = run(False, max_tokens=120)
    assert reason == "stop" and plain[-1] in engine.eos_token_ids  # the grammar's end
    spec, reason, turn, ok = run(True, max_tokens=120)
    assert spec == plain and reason == "stop" and ok and turn.forced_tokens > 0
    for n in (1, 2, 3, 5, 8, len(plain) - 1):
        out, reason, _, ok = run(True, max_tokens=n)
        assert out == plain[:n] and reason == "length" and ok
    for j in (1, 4, len(plain) // 2):
        stop = plain[j]
        out, reason, _, ok = run(True, max_tokens=120, stop_token_ids=[stop])
        assert out == plain[: plain.index(stop) + 1] and reason == "stop" and ok


def test_drafter_none_never_speculates_not_even_forced_tokens(default_model):
    """--drafter none: a request that asks to speculate decodes one token a
    step, under a grammar too (no forced drafts), with the same output."""
    engine = Engine(*default_model, num_pages=256, drafter="none")
    grammar = request_grammar(engine, TOOL, "required", parallel_tool_calls=False)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Read src/app.py."}], tools=TOOL)
    outs = []
    for speculative in (False, True):
        with engine.session() as s:
            s.append(prompt)
            outs.append(s.generate(max_tokens=60, grammar=grammar, speculative=speculative))
            st = engine.stats[-1]
            assert st.drafted_tokens == 0 and st.forced_tokens == 0 and st.decode_steps == len(outs[-1]) - 1
    assert outs[0] == outs[1]
    with pytest.raises(ValueError, match="drafter must be one of"):
        Engine(*default_model, num_pages=16, drafter="eagle")


MODES_TOOL = [{"type": "function", "function": {"name": "set_mode", "parameters": {
    "type": "object", "required": ["mode"],
    "properties": {"mode": {"enum": ["careful", "reckless", "balanced"]}, "dry_run": {"type": "boolean"},
                   "note": {"type": "string", "maxLength": 8}}}}}]


def test_schema_phrases_and_their_continuations(default_model):
    encode = default_model[1].encode
    phrases = schema_phrases(MODES_TOOL, encode)
    assert tuple(encode(' "dry_run":')) in phrases and tuple(encode(' "reckless')) in phrases
    assert tuple(encode(' "set_mode",')) in phrases
    key = encode(' "dry_run":')
    assert key[1:] in continuations(phrases, [5, 6] + key[:1], 8)
    assert continuations(phrases, [5, 6] + key[:1], 1) == [[t] for t in dict.fromkeys(
        p[1] for p in phrases if p[:1] == tuple(key[:1]))]


@pytest.mark.parametrize("kind", DRAFTING)
def test_schema_drafts_keep_greedy_output_identical(kind):
    """With a drafter that never finds anything, what is drafted past the
    grammar's forced tokens is the schema's names. The trained agent model:
    it spells JSON the way its tokenizer does, as the phrases are."""
    messages = [{"role": "user", "content": "Set the mode to reckless, as a dry run, with the note 'try'."}]
    extra = {}
    for schema in (False, True):
        engine = Engine.from_pretrained("models/agent-8m", num_pages=256, drafter=kind, schema_drafts=schema)
        grammar = request_grammar(engine, MODES_TOOL, "required", parallel_tool_calls=False)
        prompt = engine.tokenizer.apply_chat_template(messages, tools=MODES_TOOL)
        with engine.session() as s:
            s.append(prompt)
            plain = s.generate(max_tokens=80, grammar=grammar, speculative=False)
        with engine.session() as s:
            s.append(prompt)
            s.use_drafter(NoDrafter())
            assert s.generate(max_tokens=80, grammar=grammar) == plain
            check_consistent_pages(s, engine.pool.page_size)
        turn = engine.stats[-1]
        extra[schema] = turn.drafted_tokens - turn.forced_tokens
    assert extra[False] == 0 and extra[True] > 0


def check_consistent_pages(s, page_size: int) -> None:
    assert s.table.length == len(s) - 1 and len(s.table.pages) == -(-s.table.length // page_size)
