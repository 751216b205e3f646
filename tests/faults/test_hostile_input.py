"""Hostile input against a real gateway: every bad body gets its exact OpenAI error, nothing crashes.

Runs against the fault suite's stack (real redis-server, `tiny-random` worker,
gateway with a 2 s body timeout). Each case asserts status, `type`, `code` and
`param`: malformed JSON, a non-JSON content type, a 10 MB body (declared and
chunked), 100k-deep nesting, huge `max_tokens`, negative/NaN/Infinity numbers,
invalid UTF-8 and lone surrogate escapes, out-of-vocabulary token ids, 5,000
stop strings, prompts over the context window, and slowloris headers and bodies
trickled over a raw socket (cut off by the gateway's header and body deadlines). The
last test checks the aftermath: no 5xx but 503 in the gateway's own counters, no
internal error logged, process up, normal request OK.
"""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest

from tests.faults.conftest import BODY_TIMEOUT_S, assert_served_cleanly, expect_error, post
from tests.gateway_stack import GatewayStack

# generous: the first test also pays for starting the session stack (bounded by its 240 s ready timeout)
pytestmark = pytest.mark.timeout(330)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
VOCAB = 49152  # the default model's tokenizer
CONTEXT = 8192


def body(**fields: object) -> bytes:
    return json.dumps({"model": "default", "prompt": "Hi", "max_tokens": 2, **fields}).encode()


def raw_request(stack: GatewayStack, head_extra: str, first_bytes: bytes, *, trickle: bytes = b"",
                interval: float = 0.0, deadline_s: float = 30.0) -> tuple[bytes, float, bool]:
    """POST over a raw socket: headers, `first_bytes`, then `trickle` one byte per `interval`.

    Returns (everything the server sent, seconds from the headers until the first response
    byte, whether the server closed the connection), all within `deadline_s`.
    """
    head = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {stack.key}\r\n"
            f"Content-Type: application/json\r\n{head_extra}\r\n").encode()
    return exchange(stack, head + first_bytes, trickle, interval, deadline_s)


def exchange(stack: GatewayStack, initial: bytes, trickle: bytes, interval: float,
             deadline_s: float) -> tuple[bytes, float, bool]:
    """Send `initial`, then `trickle` byte by byte until the server answers or closes (see raw_request)."""
    port = int(stack.base_url.rsplit(":", 1)[1])
    received, closed, first_at = b"", False, None
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        start = time.monotonic()
        sock.sendall(initial)
        pending = memoryview(trickle)
        while time.monotonic() - start < deadline_s and not closed:
            readable, _, _ = select.select([sock], [], [], interval or 0.1)
            if readable:
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    data = b""
                if first_at is None and data:
                    first_at = time.monotonic() - start
                received += data
                closed = not data
            elif len(pending) and first_at is None:
                try:
                    sock.sendall(pending[:1])
                except OSError:
                    closed = True
                pending = pending[1:]
        return received, (first_at if first_at is not None else float("inf")), closed


def parse_raw(response: bytes) -> tuple[int, dict]:
    head, _, rest = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(rest)


def test_invalid_json(fault_stack):
    for bad in (b'{"model": "default", "prompt": ', b"", b"not json", b'{"model": "default",}'):
        expect_error(post(fault_stack, COMPLETIONS, bad), 400, None, None)
    expect_error(post(fault_stack, COMPLETIONS, b'["model", "default"]'), 400, None, None)


def test_wrong_content_type(fault_stack):
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        resp = post(fault_stack, COMPLETIONS, body(), headers={"content-type": ctype})
        expect_error(resp, 415, "unsupported_media_type", None)
    # JSON with parameters or a +json suffix is JSON
    assert post(fault_stack, COMPLETIONS, body(), headers={"content-type": "application/json; charset=utf-8"}
                ).status_code == 200


def test_ten_megabyte_body_declared(fault_stack):
    # Refused on the Content-Length header alone, before any of the 10 MB is read.
    response, first, _ = raw_request(fault_stack, "Content-Length: 10000000\r\nConnection: close\r\n",
                                     b'{"model": "default", ')
    status, err = parse_raw(response)
    assert status == 413 and first < 10
    assert (err["error"]["type"], err["error"]["code"], err["error"]["param"]) == \
        ("invalid_request_error", "request_too_large", None)


def test_ten_megabyte_body_chunked(fault_stack):
    def chunks():  # no Content-Length: the running total trips the limit while reading
        yield b'{"model": "default", "prompt": "'
        for _ in range(100):
            yield b"x" * 100_000
        yield b'"}'

    resp = httpx.post(fault_stack.base_url + COMPLETIONS, content=chunks(), timeout=60,
                      headers={"authorization": f"Bearer {fault_stack.key}",
                               "content-type": "application/json"})
    expect_error(resp, 413, "request_too_large", None)


def test_deeply_nested_json(fault_stack):
    depth = 100_000
    expect_error(post(fault_stack, COMPLETIONS, b"[" * depth + b"]" * depth), 400, None, None)
    nested = b'{"model": "default", "prompt": "Hi", "extra": ' + b"[" * depth + b"]" * depth + b"}"
    err = expect_error(post(fault_stack, COMPLETIONS, nested), 400, None, None)
    assert "nested" in err["message"]
    objects = b'{"a": ' * depth + b"1" + b"}" * depth
    expect_error(post(fault_stack, CHAT, objects), 400, None, None)


@pytest.mark.parametrize("max_tokens", [4097, 2**31 - 1, 2**31, 10**30])
def test_huge_max_tokens(fault_stack, max_tokens):
    expect_error(post(fault_stack, COMPLETIONS, body(max_tokens=max_tokens)), 400, None, "max_tokens")


@pytest.mark.parametrize(("raw", "param"), [
    (b'"temperature": -1', "temperature"),
    (b'"temperature": NaN', "temperature"),
    (b'"temperature": Infinity', "temperature"),
    (b'"temperature": 1e999', "temperature"),
    (b'"top_p": NaN', "top_p"),
    (b'"top_p": -0.5', "top_p"),
    (b'"top_p": 0', "top_p"),
    (b'"max_tokens": -5', "max_tokens"),
    (b'"max_tokens": 0', "max_tokens"),
    (b'"max_tokens": NaN', "max_tokens"),
    (b'"max_tokens": -Infinity', "max_tokens"),
    (b'"max_tokens": 2.5', "max_tokens"),
    (b'"top_k": -2', "top_k"),
    (b'"seed": 18446744073709551616', "seed"),
    (b'"seed": NaN', "seed"),
    (b'"logprobs": -1', "logprobs"),
    (b'"n": -1', "n"),
])
def test_negative_nan_infinite_numbers(fault_stack, raw, param):
    content = b'{"model": "default", "prompt": "Hi", ' + raw + b"}"
    expect_error(post(fault_stack, COMPLETIONS, content), 400, None, param)


def test_number_with_ten_thousand_digits(fault_stack):
    content = b'{"model": "default", "prompt": "Hi", "max_tokens": ' + b"9" * 10_000 + b"}"
    expect_error(post(fault_stack, COMPLETIONS, content), 400, None, None)


def test_invalid_utf8(fault_stack):
    for raw in (b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"):  # incl. encoded surrogate
        content = b'{"model": "default", "prompt": "a' + raw + b'b", "max_tokens": 2}'
        expect_error(post(fault_stack, COMPLETIONS, content), 400, None, None)
    chat = b'{"model": "default", "messages": [{"role": "user", "content": "\xff"}]}'
    expect_error(post(fault_stack, CHAT, chat), 400, None, None)


def test_lone_surrogate_escapes(fault_stack):
    # Valid JSON grammar, but not text: the tokenizer would raise on it.
    for field in (b'"prompt": "a\\ud800b"', b'"prompt": "\\udfff"', b'"prompt": "x", "stop": ["\\ud83d"]',
                  b'"prompt": "x", "model": "\\ud800"'):
        content = b'{"model": "default", "max_tokens": 2, ' + field + b"}"
        expect_error(post(fault_stack, COMPLETIONS, content), 400, None, None)
    # a proper escaped pair (what json.dumps sends for emoji) is fine
    ok = post(fault_stack, COMPLETIONS,
              b'{"model": "default", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2}')
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("ids", [[1, VOCAB], [-1], [0, 2**40], [VOCAB * 1000]])
def test_token_ids_out_of_range(fault_stack, ids):
    expect_error(post(fault_stack, COMPLETIONS, body(prompt=ids)), 400, None, "prompt")


def test_token_ids_of_wrong_type(fault_stack):
    for ids in ([1, "2"], [1, 2.0], [1, True], [None]):
        expect_error(post(fault_stack, COMPLETIONS, body(prompt=ids)), 400, None, "prompt")
    # [[1], [2]] is a batch of two token-id prompts (served); a wrong type inside a batch names its prompt
    for ids, param in (([[1], ["2"]], "prompt[1]"), ([[1], 2], "prompt[1]"), ([[1, None]], "prompt")):
        expect_error(post(fault_stack, COMPLETIONS, body(prompt=ids)), 400, None, param)


def test_five_thousand_stop_strings(fault_stack):
    stops = [f"s{i}" for i in range(5000)]
    expect_error(post(fault_stack, COMPLETIONS, body(stop=stops)), 400, None, "stop")
    expect_error(post(fault_stack, CHAT, json.dumps({"model": "default", "stop": stops, "messages": [
        {"role": "user", "content": "Hi"}]}).encode()), 400, None, "stop")


def test_prompt_over_context_window(fault_stack):
    ids = [1000] * (CONTEXT + 10)
    expect_error(post(fault_stack, COMPLETIONS, body(prompt=ids)), 400, "context_length_exceeded", "prompt")
    chat = {"model": "default", "messages": [{"role": "user", "content": "hello " * (CONTEXT + 10)}]}
    expect_error(post(fault_stack, CHAT, json.dumps(chat).encode()), 400,
                 "context_length_exceeded", "messages")


def test_prompt_plus_max_tokens_over_context(fault_stack):
    key = fault_stack.stack.create_tenant("roomy", max_tokens=100_000)
    ids = [1000] * (CONTEXT - 100)
    resp = post(fault_stack, COMPLETIONS, body(prompt=ids, max_tokens=200), key=key)
    expect_error(resp, 400, "context_length_exceeded", "prompt")


def test_slowloris_body_times_out(fault_stack):
    # Content-Length promises 1,000 bytes; 1 byte arrives every 0.2 s, so the body would take 200 s.
    start = time.monotonic()
    response, first, closed = raw_request(fault_stack, "Content-Length: 1000\r\n", b'{"model"',
                                          trickle=b" " * 990, interval=0.2, deadline_s=BODY_TIMEOUT_S + 10)
    status, err = parse_raw(response)
    assert status == 408, response[:300]
    assert (err["error"]["type"], err["error"]["code"], err["error"]["param"]) == \
        ("invalid_request_error", "request_timeout", None)
    assert BODY_TIMEOUT_S - 0.5 <= first <= BODY_TIMEOUT_S + 3, first
    assert closed and time.monotonic() - start < BODY_TIMEOUT_S + 8, "the server kept the connection open"


def test_stalled_body_times_out(fault_stack):
    # Headers and part of the body, then nothing at all.
    response, first, closed = raw_request(fault_stack, "Content-Length: 500\r\n", b'{"model": "default"',
                                          deadline_s=BODY_TIMEOUT_S + 10)
    assert parse_raw(response)[0] == 408 and first <= BODY_TIMEOUT_S + 3 and closed


def test_slow_headers_are_cut_off(fault_stack):
    # The classic slowloris: the request line, then header bytes at 5 per second, never a blank line.
    start = time.monotonic()
    received, _, closed = exchange(fault_stack, f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\n".encode(),
                                   b"X-Slow: " + b"a" * 500, 0.2, BODY_TIMEOUT_S + 10)
    assert closed and received == b"", received[:200]
    assert time.monotonic() - start < BODY_TIMEOUT_S + 3


def test_silent_connection_is_closed(fault_stack):
    start = time.monotonic()
    received, _, closed = exchange(fault_stack, b"", b"", 0.0, BODY_TIMEOUT_S + 10)
    assert closed and received == b"" and time.monotonic() - start < BODY_TIMEOUT_S + 3


def test_gateway_survives_and_serves(fault_stack):
    """After all of the above (this module runs in file order): no 5xx but 503, still up, still serving."""
    assert_served_cleanly(fault_stack)


def test_an_early_response_closes_the_connection(fault_stack):
    """A 401 (or 404) sent before the body is read closes the connection: a keyless client trickling a body
    byte now and then once held it open forever (the server waited on the unread body without a deadline)."""
    port = int(fault_stack.base_url.rsplit(":", 1)[1])
    for path in (COMPLETIONS, "/v1/nowhere"):
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: 1000\r\n\r\n{{").encode()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(head)
            received, closed, start = b"", False, time.monotonic()
            while not closed and time.monotonic() - start < 5:
                readable, _, _ = select.select([sock], [], [], 0.2)
                if readable:
                    try:
                        data = sock.recv(65536)
                    # closed with our trickled bytes unread: the kernel sends RST
                    except ConnectionResetError:
                        data = b""
                    received += data
                    closed = not data
                else:
                    try:
                        sock.sendall(b" ")  # a slow body, one byte at a time
                    except OSError:
                        closed = True
            if received:  # an RST may overtake the answer on loopback; the close is what this test is about
                assert received.split(b" ", 2)[1] in (b"401", b"404"), received[:80]
            assert closed, \
                f"{path}: the connection stayed open {time.monotonic() - start:.1f}s after the answer"
