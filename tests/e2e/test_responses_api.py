"""`POST /v1/responses` through the official `openai` SDK against a real gateway + worker + Redis (the shared
test stack): plain and streamed (typed events, numbered), message items with instructions, structured output
via `text.format`, usage with cached tokens, stored responses (retrieve, input items, delete; another tenant's
id is a 404) and `previous_response_id`, and 400s naming each field not served."""

from __future__ import annotations

import json

import openai
import pytest

from worker.text.tokenizer import load_tokenizer

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(api_key=stack.key, base_url=stack.base_url + "/v1", max_retries=0, timeout=120)


def test_plain_response_answers_with_usage(client):
    tok = load_tokenizer("default")
    resp = client.responses.create(model="default", input=QUESTION, temperature=0, max_output_tokens=20)
    assert (resp.object == "response" and resp.id.startswith("resp_")
            and resp.status in ("completed", "incomplete"))
    assert "Paris" in resp.output_text and resp.output[0].role == "assistant"
    assert resp.usage.input_tokens == len(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
    assert 0 < resp.usage.output_tokens <= 20
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.usage.input_tokens_details.cached_tokens == 0  # the shared stack runs without a prefix cache


def test_streamed_events_are_typed_numbered_and_whole(client):
    stream = client.responses.create(model="default", input=QUESTION, temperature=0, max_output_tokens=20,
                                     stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert "Paris" in text and final.output_text == text and events[-4].text == text
    assert final.usage.output_tokens > 0


def test_message_items_instructions_and_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    resp = client.responses.create(
        model="default", temperature=0, max_output_tokens=40, instructions="Answer in JSON.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert set(json.loads(resp.output_text)) == {"city"}


def test_stored_responses_continue_a_conversation_and_stay_the_tenants(client, stack):
    first = client.responses.create(model="default", input=QUESTION, temperature=0, max_output_tokens=20,
                                    instructions="Be brief.")
    assert first.store is True
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.instructions == "Be brief."
    (item,) = client.responses.input_items.list(first.id).data
    assert item.role == "user" and item.content[0].text == QUESTION
    follow = client.responses.create(model="default", input="And of Germany?", temperature=0,
                                     max_output_tokens=20, previous_response_id=first.id)
    assert follow.previous_response_id == first.id and follow.instructions is None  # not carried over
    # the follow-up's prompt holds the first turn and its answer, then the new question
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = client.responses.input_items.list(follow.id, order="asc").data
    assert [i.content[0].text for i in items] == ["And of Germany?"]
    other = openai.OpenAI(api_key=stack.batch_key, base_url=stack.base_url + "/v1", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)  # another tenant's id: not found, never forbidden
    with pytest.raises(openai.NotFoundError) as err:
        other.responses.create(model="default", input="hi", max_output_tokens=3,
                               previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(model="default", input="hi", max_output_tokens=3, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_streamed_response_is_stored_whole(client):
    events = list(client.responses.create(model="default", input=QUESTION, temperature=0,
                                          max_output_tokens=20, stream=True))
    final = events[-1].response
    assert final.store is True and client.responses.retrieve(final.id).output_text == final.output_text


@pytest.mark.parametrize("field,value", [("conversation", "conv_x"), ("max_tool_calls", 2),
                                         ("tools", [{"type": "web_search"}]), ("frobnicate", 1)])
def test_fields_not_served_are_400s_naming_them(client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="default", input=QUESTION, max_output_tokens=5,
                                extra_body={field: value})
    assert err.value.status_code == 400 and err.value.body["param"] == field
