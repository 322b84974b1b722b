"""serve.py's `n` (Week 4 Day 8): n answers to each prompt, added by one engine command
(Engine.add_choices), so that the prompt is prefilled once and the other answers fork from its
pages (the engine's counters on /metrics say how many prompt tokens were prefilled).

What a client sees: choices 0..n-1 (with a completions prompt list of P prompts, P * n choices,
answer j to prompt p at index p * n + j, as OpenAI numbers them), each streamed chunk with its
choice's index; a seeded call reproducible, its answers different, answer j sampled with seed +
j (so equal to the n = 1 answer with that seed); greedy answers all equal to n = 1's; the usage
counting each prompt once; logprobs and response_format per choice; every page back afterwards.

Support code like tests/test_serve.py (its main server's settings: four decode slots, a bounded
paged pool, the prefix cache), driven by the official `openai` client and raw HTTP.
"""

import concurrent.futures
import json

import jsonschema
import pytest
from test_serve import ENGINE_FLAGS, MODEL, PAGED_FLAGS, Server, request, wait_until

from tiny_llm_support import resolve_model
from tiny_llm_support.tokenizer import load_tokenizer

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
PREFILLED, IN_USE = "tiny_llm_prompt_tokens_prefilled_total", "tiny_llm_kv_pages_in_use"
TOKENIZER = load_tokenizer(resolve_model(MODEL))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve-choices"), *ENGINE_FLAGS, *PAGED_FLAGS)
    yield s
    s.stop()


def ask(server, question: str, n: int, stream: bool = False, **fields):
    """([text of each choice], [finish_reason of each], usage) of a chat request."""
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], n=n, max_tokens=12,
        stream=stream, **fields,
    )  # fmt: skip
    if not stream:
        assert [c.index for c in r.choices] == list(range(n)), "choices must be 0..n-1, in order"
        return [c.message.content for c in r.choices], [c.finish_reason for c in r.choices], r.usage
    texts, finish, roles = [""] * n, [None] * n, set()
    for chunk in r:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            roles |= {choice.index} if choice.delta.role else set()
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert roles == set(range(n)), f"the role came for choices {roles}, not for each of {n}"
    return texts, finish, None


def assert_pages_back(server) -> None:
    wait_until(lambda: server.metrics()[IN_USE] == 0, 5, "every page back in the pool (forks "
               "share pages by reference: each must let go of its own)")  # fmt: skip


def test_seeded_n_is_reproducible_different_and_prefilled_once(server):
    question = "Tell me about a blue whale that sings."  # unique here: nothing cached yet
    before = server.metrics()[PREFILLED]
    texts, finish, usage = ask(server, question, 3, temperature=1.0, seed=11)
    prompt = usage.prompt_tokens
    assert server.metrics()[PREFILLED] - before == prompt + 2, (
        f"{server.metrics()[PREFILLED] - before} prompt tokens prefilled for n=3 of a "
        f"{prompt}-token prompt: expected {prompt} + 2 (the first answer prefills the prompt, "
        "each fork only its last token)"
    )
    assert len(set(texts)) > 1, f"seeded answers must differ (seed + i each): {texts}"
    again = ask(server, question, 3, temperature=1.0, seed=11)
    assert again[0] == texts, "a seeded request with n must be reproducible"
    assert usage.completion_tokens == again[2].completion_tokens
    assert usage.prompt_tokens == again[2].prompt_tokens == prompt, "the prompt counts once"
    assert all(f in ("stop", "length") for f in finish), finish
    assert_pages_back(server)


def test_greedy_choices_equal_the_single_answer(server):
    one = ask(server, "What is a KV cache?", 1, temperature=0)[0]
    texts, _, usage = ask(server, "What is a KV cache?", 3, temperature=0)
    assert texts == one * 3, f"greedy n=3 must give n=1's answer three times: {texts} vs {one}"
    assert usage.completion_tokens == 3 * ask(server, "What is a KV cache?", 1, temperature=0)[
        2].completion_tokens  # fmt: skip


def test_sixteen_choices_over_four_slots(server):
    """More choices than slots: the forks wait their turn; all equal, every page back."""
    texts, finish, _ = ask(server, "Who are you?", 16, temperature=0)
    assert len(set(texts)) == 1 and len(texts) == 16, texts
    assert_pages_back(server)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_prompt_list_times_n_numbers_choices_as_openai(server, stream):
    """Two prompts, n=2, seed 5: choice p * 2 + j answers prompt p with seed 5 + j, equal to
    that prompt alone with n=1 and that seed."""
    prompts, n, seed = ["The river keeper said", "Once upon a time"], 2, 5
    common = dict(model=MODEL, temperature=1.0, max_tokens=8)
    alone = [server.client().completions.create(prompt=p, seed=seed + j, **common).choices[0].text
             for p in prompts for j in range(n)]  # fmt: skip
    r = server.client().completions.create(prompt=prompts, n=n, seed=seed, stream=stream, **common)
    if stream:
        texts = [""] * 4
        for chunk in r:
            (choice,) = chunk.choices
            texts[choice.index] += choice.text
    else:
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        texts = [c.text for c in r.choices]
        lengths = [len(TOKENIZER.encode(p)) for p in prompts]
        assert r.usage.prompt_tokens == sum(lengths), "each prompt counts once, not n times"
    assert texts == alone, (
        "choice p * n + j must be answer j to prompt p, sampled with seed + j (OpenAI's order; "
        f"Engine.add_choices' seeds): {texts} vs {alone}"
    )


def test_streamed_choices_equal_whole_ones(server):
    whole = ask(server, "Why is the sky blue?", 3, temperature=1.0, seed=3)
    streamed = ask(server, "Why is the sky blue?", 3, stream=True, temperature=1.0, seed=3)
    assert streamed[:2] == whole[:2], "each chunk must carry its choice's index"


SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer",
                                                                     "minimum": 0, "maximum": 9}},
    "required": ["color", "n"],
    "additionalProperties": False,
}  # fmt: skip


def test_logprobs_and_response_format_per_choice(server):
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick a color."}], n=3,
        temperature=1.0, seed=2, max_tokens=40, logprobs=True, top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
    )  # fmt: skip
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        content = choice.logprobs.content
        tokens = "".join(e.token for e in content).removesuffix("<|im_end|>")  # EOS has one too
        assert tokens == choice.message.content, (
            f"choice {choice.index}: its logprob entries are not its own tokens"
        )
        assert all(len(e.top_logprobs) == 2 for e in content)
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)


def test_echo_with_n(server):
    r = server.client().completions.create(
        model=MODEL, prompt="The cat sat", n=2, echo=True, logprobs=1, max_tokens=3,
        temperature=0,
    )  # fmt: skip
    assert [c.text.startswith("The cat sat") for c in r.choices] == [True, True]
    assert r.choices[0].logprobs.token_logprobs == r.choices[1].logprobs.token_logprobs


BAD = [
    ({"n": 0}, "n", ["greater than or equal to 1"]),
    ({"n": 17}, "n", ["16"]),
    ({"n": "2"}, "n", ["integer"]),
    ({"n": 3, "best_of": 2}, "best_of", ["n = 2"]),
    ({"best_of": 4}, "best_of", ["n = 4"]),
]


@pytest.mark.parametrize("fields, param, words", BAD)
def test_bad_n_is_a_400_naming_the_field(server, fields, param, words):
    before = server.metrics()[PREFILLED]
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields}
    status, _, raw = request(server.port, "POST", TEXT, body)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param, raw
    for word in words:
        assert word in error["message"], f"{word!r} not in {error['message']!r}"
    assert server.metrics()[PREFILLED] == before, "a refused request must not reach the engine"


def test_best_of_equal_to_n_is_accepted(server):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "n": 2, "best_of": 2}
    status, _, raw = request(server.port, "POST", TEXT, body)
    assert status == 200 and len(json.loads(raw)["choices"]) == 2, raw


def test_concurrent_n_requests_share_nothing_they_should_not(server):
    """Several n=3 requests at once over four slots, greedy: each choice equals its prompt's
    greedy n=1 answer."""
    questions = ["What is RoPE?", "Explain continuous batching.", "What is paged attention?"]
    alone = {q: ask(server, q, 1, temperature=0)[0][0] for q in questions}
    with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
        runs = list(pool.map(lambda q: ask(server, q, 3, temperature=0)[0], questions))
    for question, texts in zip(questions, runs):
        assert texts == [alone[question]] * 3, (
            f"{question!r}: {texts} (a fork must read its own parent's pages)"
        )
    assert_pages_back(server)
