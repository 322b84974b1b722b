"""The recorder behind the demo and the chunked-prefill bench (tiny_llm_support.batch_recorder),
fed synthetic BatchStep events on a fake clock, so every number it derives is known exactly.

Not a day file: it checks support code, the same on the skeleton and on the reference.
"""

from dataclasses import dataclass, field

import pytest

from tiny_llm_support.batch_recorder import BatchRecorder, StepError


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0  # any origin: the recorder measures from its creation

    def __call__(self) -> float:
        return self.t


@dataclass
class FakeRequest:
    prompt_idx: int
    prompt_len: int
    generated: list = field(default_factory=list)
    eos_token_ids: frozenset = frozenset({99})
    offset: int = 0
    is_prefill_done: bool = False

    @property
    def prompt_tokens(self) -> list:
        return [0] * self.prompt_len


@dataclass
class Step:  # the fields of BatchStep
    kind: str
    request: FakeRequest | None
    slots: list
    tokens: int = 0
    forward_pass: int = 0


class Run:
    """Reports events to a recorder at chosen times."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.rec = BatchRecorder(self.clock)

    def at(self, t: float, *args, **kwargs) -> None:
        self.clock.t = 100.0 + t
        self.rec.on_step(Step(*args, **kwargs))


def two_requests() -> Run:
    """Two slots, alternating policy, chunks of 4: request 0 (5 prompt tokens, 3 to generate)
    takes two chunks, decodes, then request 1 (3 tokens) is prefilled and both decode."""
    run = Run()
    a, b = FakeRequest(0, 5), FakeRequest(1, 3)
    run.at(1.0, "prefill", a, [None, None], 4, 1)
    a.generated = [7]
    run.at(1.5, "prefill", a, [None, None], 1, 2)  # the last chunk: the first token
    a.generated = [7, 8]
    run.at(2.0, "decode", None, [a, None], 1, 3)
    b.generated = [5]
    run.at(3.0, "prefill", b, [a, None], 3, 4)
    a.generated, b.generated = [7, 8, 9], [5, 6]
    run.at(3.4, "finish", a, [None, b], 0, 5)  # a is done in this decode pass: reported first
    run.at(3.45, "decode", None, [None, b], 2, 5)
    b.generated = [5, 6, 99]  # EOS
    run.at(4.0, "finish", b, [None, None], 0, 6)
    run.at(4.01, "decode", None, [None, None], 1, 6)
    run.clock.t = 100.0 + 4.1
    run.rec.stop()
    return run


def test_passes_are_timed_from_the_previous_pass_to_their_first_event():
    rec = two_requests().rec
    assert [p.number for p in rec.passes] == [1, 2, 3, 4, 5, 6]
    durations = [p.duration for p in rec.passes]
    # pass 6 starts at the last event of pass 5 (3.45) and ends at its first event (4.0)
    assert durations == pytest.approx([1.0, 0.5, 0.5, 1.0, 0.4, 0.55])
    assert [p.duration for p in rec.decode_passes()] == pytest.approx([0.5, 0.4, 0.55])
    assert [p.chunks for p in rec.prefill_passes()] == [[(0, 4)], [(0, 1)], [(1, 3)]]
    assert rec.prefill_time() == pytest.approx(2.5)
    assert rec.decode_time() == pytest.approx(1.45)


def test_decode_gaps_span_prefill_work_between_decode_completions():
    gaps = two_requests().rec.decode_gaps()
    assert [g.seconds for g in gaps] == pytest.approx([1.4, 0.6])
    assert [t for g in gaps for t in (g.start, g.end)] == pytest.approx([2.0, 3.4, 3.4, 4.0])
    assert [g.chunks for g in gaps] == [1, 0]  # request 1's chunk ran inside the first


def test_requests_their_chunks_tokens_and_finish():
    rec = two_requests().rec
    a, b = rec.requests[0], rec.requests[1]
    assert (a.chunks, a.prefilled, a.admitted) == ([4, 1], 5, 0.0)
    assert (b.chunks, b.prefilled, b.admitted) == ([3], 3, pytest.approx(2.0))
    # each token is stamped with the end of the pass that made it
    assert a.token_times == pytest.approx([1.5, 2.0, 3.4])
    assert b.token_times == pytest.approx([3.0, 3.4, 4.0])
    assert (a.ttft, a.finished, a.stop) == (pytest.approx(1.5), pytest.approx(3.4), "length")
    assert (b.ttft, b.finished, b.stop) == (pytest.approx(3.0), pytest.approx(4.0), "eos")
    assert a.decode_rate() == pytest.approx(2 / 1.9)
    assert a.longest_token_gap() == pytest.approx(1.4)


def test_totals_and_throughput():
    rec = two_requests().rec
    assert rec.wall == pytest.approx(4.1)
    assert (rec.prefill_tokens(), rec.decode_tokens(), rec.output_tokens()) == (8, 4, 6)
    assert rec.output_tokens_per_s() == pytest.approx(6 / 4.1)
    assert rec.decode_tokens_per_s() == pytest.approx(4 / 1.45)


def test_no_gap_across_a_stretch_without_decoding_requests():
    """One slot: request 0 finishes, so nobody decodes while request 1 is prefilled."""
    run = Run()
    a, b = FakeRequest(0, 2), FakeRequest(1, 2)
    a.generated = [1]
    run.at(1.0, "prefill", a, [None], 2, 1)
    a.generated = [1, 2]
    run.at(2.0, "decode", None, [a], 1, 2)
    a.generated = [1, 2, 3]
    run.at(3.0, "finish", a, [None], 0, 3)
    run.at(3.0, "decode", None, [None], 1, 3)
    b.generated = [4]
    run.at(9.0, "prefill", b, [None], 2, 4)
    b.generated = [4, 5]
    run.at(10.0, "decode", None, [b], 1, 5)
    assert [p.end for p in run.rec.decode_passes()] == [2.0, 3.0, 10.0]
    assert [g.seconds for g in run.rec.decode_gaps()] == [1.0]  # not 3.0 -> 10.0


def test_one_pass_with_chunks_and_decode_rows():
    """Events that share forward_pass are one model call, whatever their kinds."""
    run = Run()
    a, b = FakeRequest(0, 2), FakeRequest(1, 8)
    a.generated = [1]
    run.at(1.0, "prefill", a, [None, None], 2, 1)
    a.generated = [1, 2]
    run.at(2.0, "prefill", b, [a, None], 4, 2)
    run.at(2.1, "decode", None, [a, None], 1, 2)
    a.generated = [1, 2, 3]
    run.at(3.0, "prefill", b, [a, None], 4, 3)
    run.at(3.2, "decode", None, [a, None], 1, 3)
    assert [(p.chunks, p.decode_rows) for p in run.rec.passes] == [
        ([(0, 2)], 0),
        ([(1, 4)], 1),
        ([(1, 4)], 1),
    ]
    assert run.rec.requests[0].token_times == [1.0, 2.0, 3.0]  # at each pass's end
    [gap] = run.rec.decode_gaps()
    assert (gap.seconds, gap.chunks) == (pytest.approx(1.0), 1)


def test_time_inside_paused_is_left_out():
    run = Run()
    a = FakeRequest(0, 4)
    a.generated = [1]
    run.at(1.0, "prefill", a, [None], 4, 1)
    with run.rec.paused():
        run.clock.t += 5.0  # drawing the screen
    run.clock.t += 0.5
    a.generated = [1, 2]
    run.rec.on_step(Step("decode", None, [a], 1, 2))
    assert run.rec.passes[-1].end == pytest.approx(1.5)
    assert run.rec.passes[-1].duration == pytest.approx(0.5)
    assert run.rec.paused_s == pytest.approx(5.0)


@pytest.mark.parametrize(
    "step, message",
    [
        (Step("prefill", FakeRequest(0, 4), [None], 4, 0), "forward_pass 0"),
        (Step("decode", None, [None], 0, 1), "tokens=0"),
        (Step("prefill", FakeRequest(0, 4), [None], 0, 1), "tokens=0"),
        (Step("rewind", FakeRequest(0, 4), [None], 1, 1), "kind 'rewind'"),
    ],
)
def test_a_step_that_breaks_the_api_is_named(step, message):
    with pytest.raises(StepError, match=message):
        BatchRecorder(FakeClock()).on_step(step)


def test_forward_pass_must_not_go_back():
    run = Run()
    a = FakeRequest(0, 8)
    run.at(1.0, "prefill", a, [None], 4, 2)
    with pytest.raises(StepError, match="forward_pass 1 after pass 2"):
        run.at(2.0, "prefill", a, [None], 4, 1)


def test_scheduling_events_before_the_first_pass_and_preemption():
    """admit carries the number of the last pass (0 before any); a preempted request starts
    its prefill over with the tokens it had generated, and keeps them."""
    run = Run()
    a = FakeRequest(0, 6)
    run.at(0.5, "admit", a, [None], 0, 0)
    a.generated = [1]
    run.at(1.0, "prefill", a, [None], 6, 1)
    a.generated = [1, 2]
    run.at(2.0, "decode", None, [a], 1, 2)
    run.at(2.5, "preempt", a, [None], 0, 2)
    record = run.rec.requests[0]
    assert (record.admitted, record.preemptions, record.to_prefill, record.prefilled) == (
        0.5,
        1,
        7,  # the prompt and every generated token but the last
        0,
    )
    run.at(3.0, "admit", a, [None], 0, 2)
    run.at(4.0, "prefill", a, [None], 4, 3)
    run.at(5.0, "prefill", a, [None], 3, 4)
    assert (record.chunks, record.prefilled, record.generated) == ([6, 4, 3], 7, 2)
    assert [p.number for p in run.rec.passes] == [1, 2, 3, 4]
    assert run.rec.passes[2].start == 3.0  # after the admit that ended the previous pass


def test_waits_admission_and_recomputed_tokens():
    """A request that waited for pages is admitted when its admit event comes; every
    preemption adds the tokens its prefill must compute again."""
    run = Run()
    a = FakeRequest(0, 6)
    run.at(0.2, "wait", a, [None], 0, 0)
    run.at(0.4, "admit", a, [None], 0, 0)
    a.generated = [1]
    run.at(1.0, "prefill", a, [None], 6, 1)
    a.generated = [1, 2, 3]
    run.at(2.0, "decode", None, [a], 1, 2)
    run.at(2.5, "preempt", a, [None], 0, 2)
    run.at(2.6, "wait", a, [None], 0, 2)
    run.at(3.0, "admit", a, [None], 0, 2)  # admitted again: its first admission stays
    run.at(4.0, "prefill", a, [None], 8, 3)
    a.generated = [1, 2, 3, 4]
    run.at(5.0, "decode", None, [a], 1, 4)
    run.at(5.5, "preempt", a, [None], 0, 4)
    record = run.rec.requests[0]
    assert (record.waits, record.admitted, record.preemptions) == (2, pytest.approx(0.4), 2)
    assert record.recomputed == (6 + 2) + (6 + 3)  # the prompt and all generated but the last


def test_a_refused_request_is_over_without_a_token():
    run = Run()
    run.at(0.1, "refuse", FakeRequest(3, 500), [None], 0, 0)
    record = run.rec.requests[3]
    assert (record.stop, record.finished, record.generated, run.rec.passes) == (
        "refused",
        pytest.approx(0.1),
        0,
        [],
    )


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
def test_the_reference_scheduler_with_a_small_page_pool(tiny_gqa_ckpt, policy):
    """Real events (admissions, waits, preemptions, passes of both kinds) add up: every
    token is counted once, every pass has a duration, every prompt token was prefilled."""
    import tiny_llm_ref

    model = tiny_llm_ref.Qwen3Model(tiny_gqa_ckpt)
    prompts = [list(range(5, 5 + n)) for n in (10, 12, 9, 14, 11, 8)]
    pools = model.create_kv_pools(page_size=4, max_pages=8)
    rec = BatchRecorder()
    tiny_llm_ref.batch_generate(
        model, tiny_gqa_ckpt.tokenizer, prompts, 64, 4, 8, pools=pools, on_step=rec.on_step,
        max_new_tokens=12, ignore_eos=True, policy=policy,
    )  # fmt: skip
    rec.stop()
    records = [rec.requests[i] for i in range(len(prompts))]
    assert [r.generated for r in records] == [12] * len(prompts)
    assert sum(r.preemptions for r in records) > 0, "8 pages must force a preemption"
    assert rec.decode_tokens() == rec.output_tokens() - len(prompts)
    for r, prompt in zip(records, prompts):
        assert r.prefilled == r.to_prefill and sum(r.chunks) == len(prompt) + r.recomputed
        assert r.admitted <= r.ttft <= r.finished <= rec.wall
    assert [p.number for p in rec.passes] == list(range(1, len(rec.passes) + 1))
    assert all(p.duration >= 0 for p in rec.passes)
    gaps = rec.decode_gaps()
    assert 0 < len(gaps) < len(rec.decode_passes())
    if policy == "hybrid":
        assert any(p.chunks and p.decode_rows for p in rec.passes), "chunks and decode in a pass"
