"""Every field of every RPC, fuzzed against a live server (hypothesis).

Whatever arrives, the answer is OK, INVALID_ARGUMENT with a message that starts with the field's
path, or RESOURCE_EXHAUSTED for a message over the size limit; never INTERNAL or a crash. Well-formed
streams run beside the fuzz the whole time and must come out exactly as when run alone.
"""

from __future__ import annotations

import math
import re
import threading
from collections import Counter

import grpc
import pytest

pytest.importorskip("hypothesis", reason="hypothesis is a development tool the serving lane does not install")

from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import settings as hsettings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from attnserve.v1 import generate_pb2 as pb  # noqa: E402
from service.client import Client  # noqa: E402

pytestmark = pytest.mark.slow

U32 = 2**32 - 1
FIELD = re.compile(r"^(prompt|prompt_token_ids|request_id|n|top_logprobs|echo|logprobs|text"
                   r"|sampling\.\w+|stopping\.\w+)(\[\d+\])?: ")
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}

floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                   st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e30, -1e30, 1.0, 0.5]))
u32 = st.one_of(st.integers(0, U32), st.sampled_from([0, 1, 2, 255, 4096, 2**31, U32]))
texts = st.one_of(st.text(max_size=64),  # any code points, controls included
                  st.text(st.characters(codec="utf-8"), min_size=1000, max_size=4000),
                  st.sampled_from(["", "\x00", "\x00\x01\x7f", "<|endoftext|>", "\ufffd" * 10, "é" * 3000]))


@st.composite
def requests(draw) -> pb.GenerateRequest:
    r = pb.GenerateRequest()
    form = draw(st.sampled_from(["text", "ids", "both", "neither"]))
    if form in ("text", "both"):
        r.prompt = draw(texts)
    if form in ("ids", "both"):
        r.prompt_token_ids.extend(draw(st.lists(u32, max_size=300)))
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if draw(st.booleans()):
            setattr(r.sampling, name, draw(floats))
    if draw(st.booleans()):
        r.sampling.top_k = draw(u32)
    if draw(st.booleans()):
        r.sampling.seed = draw(st.integers(0, 2**64 - 1))
    r.stopping.max_new_tokens = draw(st.one_of(st.integers(0, 16), u32))
    r.stopping.min_new_tokens = draw(st.one_of(st.integers(0, 16), u32))
    r.stopping.stop.extend(draw(st.lists(st.text(max_size=300), max_size=20)))
    r.stopping.stop_token_ids.extend(draw(st.lists(u32, max_size=20)))
    r.stopping.ignore_eos = draw(st.booleans())
    r.n = draw(st.one_of(st.integers(0, 4), u32))
    r.top_logprobs = draw(st.one_of(st.integers(0, 4), u32))
    r.echo, r.logprobs, r.truncate_prompt = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    r.request_id = draw(st.one_of(st.just(""), st.text(max_size=40), st.text(min_size=200, max_size=2000)))
    return r


def shrink(r: pb.GenerateRequest) -> pb.GenerateRequest:
    """Keep generation short where the request is valid, so a fuzz case costs milliseconds."""
    r.stopping.max_new_tokens = min(r.stopping.max_new_tokens, 4) if r.stopping.max_new_tokens < 64 else \
        r.stopping.max_new_tokens
    return r


def answer(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


OUTCOMES: Counter[str] = Counter()  # status code names over the whole module


def check(code: grpc.StatusCode, details: str) -> None:
    OUTCOMES[code.name] += 1
    assert code in ALLOWED, (code, details)
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        assert FIELD.match(details), details


class Background:
    """Well-formed seeded streams, run again and again while the fuzz goes on."""

    REQUESTS = [dict(prompt="Rom.", max_new_tokens=24, seed=1, temperature=0.9),
                dict(prompt="Ham.", max_new_tokens=24, seed=2, temperature=0.7, top_k=20),
                dict(prompt="Mac.", max_new_tokens=24, temperature=0.0, ignore_eos=True)]

    def __init__(self, address: str):
        self.client = Client(address, timeout_s=60)
        self.stop = threading.Event()
        self.results: list[list[list[int]]] = []
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def stream(self, fields: dict) -> list[int]:
        fields = dict(fields)
        return [t for m in self.client.stream_responses(fields.pop("prompt"), **fields) for t in m.token_ids]

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.results.append([self.stream(f) for f in self.REQUESTS])
            except grpc.RpcError as e:
                self.errors.append(f"{e.code().name}: {e.details()}")

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(120)
        self.client.close()


@pytest.fixture(scope="module")
def background(server):
    with Background(server.address) as bg:
        yield bg


FUZZ = hsettings(max_examples=300, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.function_scoped_fixture])


@FUZZ
@given(request=requests())
def test_fuzzed_generate(client, background, request):
    check(*answer(lambda: client.stub.Generate(shrink(request), timeout=60)))


@FUZZ
@given(request=requests())
def test_fuzzed_generate_stream(client, background, request):
    check(*answer(lambda: list(client.stub.GenerateStream(shrink(request), timeout=60))))


@FUZZ
@given(text=texts)
def test_fuzzed_tokenize(client, background, text):
    check(*answer(lambda: client.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=60)))


def test_lone_surrogates_are_refused_by_the_client_library():
    with pytest.raises(ValueError):
        pb.GenerateRequest(prompt="\ud800")


def test_extremes_by_hand(client):
    cases = [
        pb.GenerateRequest(prompt="x" * 9_000_000),  # over the 4 MiB message limit
        pb.GenerateRequest(prompt_token_ids=[1] * 1_000_000),
        pb.GenerateRequest(prompt="Rom.", stopping=pb.StoppingCriteria(stop=[f"s{i}" for i in range(5000)])),
        pb.GenerateRequest(prompt="Rom. " * 5000),  # beyond the context
        pb.GenerateRequest(prompt_token_ids=[U32, 0, 1]),
        pb.GenerateRequest(prompt="", prompt_token_ids=[]),
        pb.GenerateRequest(prompt="Rom.", prompt_token_ids=[1]),
        pb.GenerateRequest(prompt="Rom.", sampling=pb.SamplingParams(temperature=math.nan, top_p=math.inf)),
        pb.GenerateRequest(prompt="Rom.", stopping=pb.StoppingCriteria(max_new_tokens=U32, min_new_tokens=U32)),
        pb.GenerateRequest(prompt="Rom.", n=U32, top_logprobs=U32),
    ]
    codes = []
    for r in cases:
        code, details = answer(lambda r=r: client.stub.Generate(r, timeout=60))
        check(code, details)
        codes.append(code)
    assert codes[0] is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert all(c is grpc.StatusCode.INVALID_ARGUMENT for c in codes[2:])


def test_the_background_streams_were_untouched(server, background):
    """Runs last in this module: the streams beside the fuzz match a quiet server's, every time."""
    background.__exit__()
    assert background.errors == []
    assert len(background.results) >= 3
    with Client(server.address, timeout_s=60) as c:
        quiet = []
        for fields in Background.REQUESTS:
            fields = dict(fields)
            quiet.append([t for m in c.stream_responses(fields.pop("prompt"), **fields) for t in m.token_ids])
    assert all(len(tokens) == 24 for tokens in quiet[2:])  # the ignore_eos one
    assert all(run == quiet for run in background.results)
    # the fuzz reached generation as well as validation
    print(f"fuzz outcomes: {dict(OUTCOMES)}")
    assert OUTCOMES["OK"] >= 20 and OUTCOMES["INVALID_ARGUMENT"] >= 100, OUTCOMES
