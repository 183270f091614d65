"""The Responses API (POST /v1/responses) through the openai SDK, over a data plane that writes
scripted replies: text, reasoning and function calls as output items, the stream's events (checked
against the SDK's types) equal to the whole response, a conversation carried on by sending the
output items back, and what is refused."""

from __future__ import annotations

import json
import typing

import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent

from .test_tools import CALL, FAULT, scripted_planes

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
ANSWER = "It is 18 C and sunny in Paris."
SCRIPTS = [("Think", "<think>Paris is in France.</think>\n\nLet me check.\n" + CALL), ("Paris", CALL),
           ("Long", "one two three four five six seven eight nine ten"), ("Broken", "Half an" + FAULT),
           ("", ANSWER)]
# each event type's class in the SDK, to check an event against
EVENTS = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
          for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory, smollm2_dir):
    """A control plane with the qwen3 reasoning parser and the hermes tool call parser."""
    with scripted_planes(tmp_path_factory.mktemp("responses"), smollm2_dir, SCRIPTS, tool_call_parser="hermes",
                         reasoning_parser="qwen3") as both:
        yield both


@pytest.fixture
def client(scripted) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{scripted[0].plane.http_port}/v1", api_key="x", max_retries=0)


def _events(client: openai.OpenAI, **request) -> list[dict]:
    """The stream's events, each checked against the SDK's types and numbered in order."""
    url = f"{client.base_url}responses"
    events = []
    with httpx.stream("POST", url, json={**request, "stream": True}, timeout=30) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines() if line]
    for name, data in zip(lines[::2], lines[1::2]):
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        EVENTS[event["type"]].model_validate(event)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _streamed(client: openai.OpenAI, **request) -> tuple[list, dict]:
    """The stream's events, and the response the last one holds."""
    events = _events(client, **request)
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    return events, events[-1]["response"]


def _same(streamed: dict, whole: dict) -> None:
    """Equal but for the ids and times each response draws."""
    def plain(response: dict) -> dict:
        output = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]]
        return {**{k: v for k, v in response.items() if k not in ("id", "created_at")}, "output": output}
    assert plain(streamed) == plain(whole)


def test_text_whole_and_streamed(client, scripted):
    whole = client.responses.create(model="scripted", input="Hello!", instructions="Be brief.")
    assert whole.status == "completed" and whole.output_text == ANSWER
    [message] = whole.output
    assert (message.type, message.role, message.content[0].type) == ("message", "assistant", "output_text")
    assert whole.usage.output_tokens == len(scripted[1].tokenizer.encode(ANSWER, add_special_tokens=False)) + 1
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert whole.instructions == "Be brief." and whole.tool_choice == "none"
    assert whole.usage.output_tokens_details.reasoning_tokens == 0
    assert "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello!" in scripted[1].prompts[-1]
    events, last = _streamed(client, model="scripted", input="Hello!", instructions="Be brief.")
    assert events[-1]["type"] == "response.completed"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == ANSWER
    assert [e["type"] for e in events if "delta" not in e][2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    _same(last, whole.model_dump(mode="json", exclude_unset=True))


def test_reasoning_message_and_call_items_in_order(client, scripted):
    whole = client.responses.create(model="scripted", input="Think: the weather in Paris?", tools=TOOLS)
    assert [item.type for item in whole.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = whole.output
    assert reasoning.content[0].text == "Paris is in France." and message.content[0].text == "\n\nLet me check.\n"
    thought = len(scripted[1].tokenizer.encode("<think>Paris is in France.</think>", add_special_tokens=False))
    assert abs(whole.usage.output_tokens_details.reasoning_tokens - thought) <= 1  # the tags' tokens too
    assert (call.name, json.loads(call.arguments), call.call_id[:5]) == ("get_weather", {"city": "Paris"}, "call_")
    events, last = _streamed(client, model="scripted", input="Think: the weather in Paris?", tools=TOOLS)
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Paris is in France."
    [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert (done["name"], done["arguments"], done["output_index"]) == ("get_weather", call.arguments, 2)
    pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(pieces) == call.arguments and len(pieces) > 1  # the arguments stream as the model writes them
    kinds = [e["type"] for e in events if e.get("output_index") == 2]
    assert kinds[0] == "response.output_item.added" and kinds[-2:] == [
        "response.function_call_arguments.done", "response.output_item.done"]
    assert set(kinds[1:-2]) == {"response.function_call_arguments.delta"}
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]
    _same(last, whole.model_dump(mode="json", exclude_unset=True))


def test_the_output_items_carry_the_conversation_on(client, scripted):
    first = client.responses.create(model="scripted", input="Weather in Paris?", tools=TOOLS)
    [call] = first.output
    conversation = [{"role": "user", "content": "Weather in Paris?"}, *[item.model_dump(exclude_none=True)
                                                                      for item in first.output],
                    {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}]
    answer = client.responses.create(model="scripted", input=conversation, tools=TOOLS)
    assert answer.output_text == ANSWER and [item.type for item in answer.output] == ["message"]
    prompt = scripted[1].prompts[-1]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert f'<tool_response id="{call.call_id}">\n18 C, sunny\n</tool_response>' in prompt


def test_max_output_tokens_leaves_the_response_incomplete(client):
    cut = client.responses.create(model="scripted", input="Long?", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and cut.output_text == "one two three"
    assert cut.output[0].status == "incomplete"  # the message the limit cut short
    events, last = _streamed(client, model="scripted", input="Long?", max_output_tokens=3)
    assert events[-1]["type"] == "response.incomplete" and last["status"] == "incomplete"


def test_a_function_call_cut_by_max_output_tokens_is_incomplete(client):
    """Its arguments are not whole: the item says so, in the response and in the stream's events."""
    cut = client.responses.create(model="scripted", input="Paris?", tools=TOOLS, max_output_tokens=22)
    [call] = [item for item in cut.output if item.type == "function_call"]
    assert cut.status == "incomplete" and call.status == "incomplete", cut.output
    assert call.arguments and not call.arguments.endswith("}")
    events, last = _streamed(client, model="scripted", input="Paris?", tools=TOOLS, max_output_tokens=22)
    [done] = [e for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"]
    assert done["item"]["status"] == "incomplete" and last["output"][-1]["status"] == "incomplete"
    whole = client.responses.create(model="scripted", input="Paris?", tools=TOOLS)
    assert [item.status for item in whole.output] == ["completed"] and whole.status == "completed"


@pytest.mark.parametrize("request_fields, param, words", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "function tool"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "input[0].type must be message"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "only text input"),
    ({"input": []}, "input", "input is required"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be in"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text", "text.format must be"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "the tools are get_weather"),
    ({"input": "hi", "instructions": 3}, "instructions", "instructions must be a string"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "[1]"}]}, "input",
     "input[0].arguments must be the JSON text of an object"),
    ({"input": [{"type": "function_call_output", "output": "18 C"}]}, "input", "input[0].call_id is required"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 18}]}, "input",
     "input[0].output must be a string or a list of input_text parts"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]}, "input",
     "input[0].output[0] must be a text part"),
    ({"input": [{"role": "user", "content": 5}]}, "input", "input[0].content must be a string or a list"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include", "are not supported here"),
    ({"input": [{"type": "reasoning", "content": "thinking"}]}, "input", "list of reasoning_text parts"),
    ({"input": "hi", "include": 5}, "include", "include must be a list of strings"),
    ({"input": "hi", "top_logprobs": "2"}, "top_logprobs", "top_logprobs must be an integer in [0, 20], got str"),
    ({"input": "hi", "top_logprobs": -1}, "top_logprobs", "top_logprobs must be in [0, 20], got -1"),
    ({"input": "hi", "truncation": "sometimes"}, "truncation", 'truncation must be auto or disabled, got "sometimes"'),
    ({"input": "hi", "max_tool_calls": -1}, "max_tool_calls", "max_tool_calls must be an integer >= 0, got -1"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning",
     'reasoning must be an object whose effort is one of none, minimal, low, medium, high, xhigh, max, got {"effort"'),
    # the response repeats these as sent: what the API's types refuse would come back in it
    ({"input": "hi", "reasoning": {"summary": "long"}}, "reasoning",
     'reasoning.summary must be one of auto, concise, detailed, got "long"'),
    ({"input": "hi", "metadata": "run 7"}, "metadata", 'metadata must be an object of at most 16 string values'),
    ({"input": "hi", "metadata": {"run": 7}}, "metadata", 'got {"run": 7}'),
    ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16 string values"),
    ({"input": "hi", "metadata": {"k" * 65: "v"}}, "metadata", "a key of at most 64 characters"),
    ({"input": "hi", "metadata": {"k": "v" * 513}}, "metadata", "of at most 512 characters"),
], ids=["previous-response", "built-in-tool", "image-item", "image-part", "no-input", "max-output-tokens",
        "unknown-format", "unknown-function", "instructions-number", "call-arguments", "no-call-id",
        "output-number", "output-image-part", "content-number", "output-logprobs", "reasoning-text",
        "include-not-a-list", "top-logprobs-string", "top-logprobs-negative",
        "truncation", "max-tool-calls", "reasoning-effort", "reasoning-summary", "metadata-string",
        "metadata-number", "metadata-17-pairs", "metadata-long-key", "metadata-long-value"])
def test_what_the_server_cannot_do_gets_400(client, request_fields, param, words):
    reply = httpx.post(f"{client.base_url}responses", json={"model": "scripted", **request_fields}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_reasoning_effort_reaches_the_template_and_the_settings_come_back(client):
    """reasoning.effort is the chat template's reasoning_effort, as chat's; max_tool_calls (of built-in tools,
    which this server runs none of) is taken; the response repeats them and truncation, streamed or not."""
    from twinplane.controlplane.api import Limits
    from twinplane.controlplane.openai_api import parse_request
    from twinplane.controlplane.openai_responses import chat_body

    (call,) = parse_request(chat_body({"input": "hi", "reasoning": {"effort": "high", "summary": "auto"}}),
                            Limits(4096, 4096), "r", chat=True).calls
    assert call.prompt.chat_options.template_kwargs == {"enable_thinking": True, "reasoning_effort": "high"}
    assert "reasoning_effort" not in chat_body({"input": "hi", "reasoning": {"summary": "auto"}})
    request = dict(model="scripted", input="Hello!", reasoning={"effort": "low", "summary": "auto"}, max_tool_calls=2,
                   metadata={"run": "7"})
    whole = client.responses.create(**request)
    assert whole.output_text == ANSWER and whole.metadata == {"run": "7"}
    assert (whole.reasoning.effort, whole.reasoning.summary, whole.max_tool_calls, whole.truncation) == (
        "low", "auto", 2, "disabled")
    _, last = _streamed(client, **request, truncation="auto")
    assert (last["reasoning"], last["max_tool_calls"], last["truncation"]) == (
        {"effort": "low", "summary": "auto"}, 2, "auto")


def test_truncation_auto_leaves_out_the_earliest_input_messages_that_do_not_fit(client, scripted):
    """The data plane's max_model_len is 4096: of turns that add up past it, the earliest are left out, as few as
    let the rest, the instructions and max_output_tokens fit; without truncation the request is refused."""
    turn = "lorem " * 400
    turns = [{"role": ("user", "assistant")[i % 2], "content": f"turn{i} {turn}"} for i in range(8)]
    request = dict(model="scripted", instructions="Be brief.", input=[*turns, {"role": "user", "content": "Hello?"}],
                   max_output_tokens=16)
    refused = httpx.post(f"{client.base_url}responses", json=request, timeout=30)
    assert refused.status_code == 400 and "the prompt has" in refused.json()["error"]["message"]
    whole = client.responses.create(**request, truncation="auto")
    assert whole.output_text == ANSWER and whole.truncation == "auto"
    prompt = scripted[1].prompts[-1]
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>") and "Hello?" in prompt
    kept = [i for i in range(8) if f"turn{i} " in prompt]
    assert kept == list(range(kept[0], 8)) and kept[0] > 0  # the earliest left out, those after kept
    one_more = len(scripted[1].tokenizer.encode(f"turn0 {turn}", add_special_tokens=False))
    assert whole.usage.input_tokens + 16 <= 4096 < whole.usage.input_tokens + 16 + one_more


def test_a_step_that_fails_ends_the_stream_with_an_error_event(client):
    events = _events(client, model="scripted", input="Broken?")
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Half an"
    assert events[-1]["type"] == "error" and "a scripted fault" in events[-1]["message"]
    assert not any(e["type"] in ("response.completed", "response.incomplete") for e in events)
    with pytest.raises(openai.InternalServerError):
        client.responses.create(model="scripted", input="Broken?")
    assert client.responses.create(model="scripted", input="Hello?").output_text == ANSWER  # still serving


def test_a_request_the_server_ends_fails_with_its_item_incomplete():
    """Ended by the server (it shuts down), not by the client: response.failed with an error object, and the
    reasoning it cut short is incomplete, not completed. The SDK's types take the event."""
    from twinplane.controlplane.api import Limits, RequestOutput
    from twinplane.controlplane.openai_api import parse_request
    from twinplane.controlplane.openai_responses import ResponsesBuilder, chat_body
    from twinplane.controlplane.sequence import FinishReason

    body = {"input": "x", "model": "m"}
    builder = ResponsesBuilder(parse_request(chat_body(body), Limits(4096, 4096), "r", chat=True,
                                             reasoning_parser="qwen3"), "resp_r", "m", body, "qwen3", None)
    builder.start()
    builder.add(0, RequestOutput("r", text="<think>half a thou", token_ids=[1, 2, 3]))
    builder.add(0, RequestOutput("r", text="ght", token_ids=[4], finish_reason=FinishReason.ABORTED))
    [last] = builder.finish({"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}})
    EVENTS[last["type"]].model_validate(last)
    response = last["response"]
    assert last["type"] == "response.failed" and response["status"] == "failed"
    assert response["error"]["code"] == "server_error" and response["incomplete_details"] is None
    assert [(item["type"], item["status"]) for item in response["output"]] == [("reasoning", "incomplete")]


def test_a_function_output_of_text_parts_is_their_text():
    """As the API takes it: a function_call_output's output a string or a list of input_text parts."""
    from twinplane.controlplane.openai_responses import chat_body

    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    parts = [{"type": "input_text", "text": "18 C"}, {"type": "input_text", "text": "sunny"}]
    for output, text in ((parts, "18 C\nsunny"), ("18 C", "18 C")):
        messages = chat_body({"input": [{"role": "user", "content": "Weather?"}, call,
                                        {"type": "function_call_output", "call_id": "c1", "output": output}]})
        assert messages["messages"][2] == {"role": "tool", "tool_call_id": "c1", "content": text}


def test_reasoning_items_become_the_thinking_of_the_assistant_message_after_them():
    """As vLLM does: a tool loop's thinking goes back to the template (Qwen3's shows the thinking of the turn
    under way), so the next prompt is what the model wrote."""
    from twinplane.controlplane.openai_responses import chat_body

    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    thought = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Ask the tool."}]}
    messages = chat_body({"input": [{"role": "user", "content": "Weather?"}, thought, call,
                                    {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
                                    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
                                    {"role": "assistant", "content": "It is 18 C."}]})["messages"]
    assert messages[1] == {"role": "assistant", "content": None, "reasoning_content": "Ask the tool.",
                           "tool_calls": [{"id": "c1", "type": "function",
                                           "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert messages[2]["role"] == "tool" and messages[3] == {"role": "assistant", "content": "It is 18 C."}


@pytest.mark.parametrize("items, expected", [
    # reasoning between an assistant's text and a call: the call is a turn of its own, with the thinking
    ([{"role": "assistant", "content": "Let me check."}, "Ask.", "call"],
     [{"role": "assistant", "content": "Let me check."},
      {"role": "assistant", "content": None, "reasoning_content": "Ask.", "tool_calls": ["call"]}]),
    (["Ask.", {"role": "assistant", "content": "Hi."}, "call"],  # a call joins the assistant message before it
     [{"role": "assistant", "content": "Hi.", "reasoning_content": "Ask.", "tool_calls": ["call"]}]),
    (["One. ", "Two.", {"role": "assistant", "content": "Hi."}],  # reasoning items in a row are joined
     [{"role": "assistant", "content": "Hi.", "reasoning_content": "One. Two."}]),
    # reasoning before a message not the model's goes with none: not with a later assistant message
    (["Ask.", {"role": "user", "content": "Go on."}, {"role": "assistant", "content": "Hi."}],
     [{"role": "user", "content": "Go on."}, {"role": "assistant", "content": "Hi."}]),
    (["Ask.", "output", {"role": "assistant", "content": "Hi."}],
     [{"role": "tool", "tool_call_id": "c1", "content": "18 C"}, {"role": "assistant", "content": "Hi."}]),
], ids=["after-text", "before-text", "joined", "before-user", "before-output"])
def test_reasoning_items_go_with_the_next_assistant_message_only(items, expected):
    from twinplane.controlplane.openai_responses import chat_body

    def item(short):  # "call", "output", a message, or the text of a reasoning item
        if short == "call":
            return {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
        if short == "output":
            return {"type": "function_call_output", "call_id": "c1", "output": "18 C"}
        return short if isinstance(short, dict) else {"type": "reasoning", "content": [{"type": "reasoning_text",
                                                                                         "text": short}]}

    chat_call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = chat_body({"input": [{"role": "user", "content": "Weather?"}, *map(item, items)]})["messages"]
    expected = [{**m, "tool_calls": [chat_call]} if "tool_calls" in m else m for m in expected]
    assert messages == [{"role": "user", "content": "Weather?"}, *expected]


def test_a_named_tool_choice_becomes_the_chat_form_and_forces_that_call():
    from twinplane.controlplane.api import Limits
    from twinplane.controlplane.openai_api import parse_request
    from twinplane.controlplane.openai_responses import chat_body

    body = {"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"}}
    chat = chat_body(body)
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["tools"] == [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
    tools = parse_request(chat, Limits(4096, 4096), "r", chat=True, tool_call_parser="hermes").tools
    assert tools.forced == ("get_weather",) and tools.named
    for choice in ("auto", "required", "none"):
        assert chat_body({**body, "tool_choice": choice})["tool_choice"] == choice


def test_tool_choice_auto_without_tools_asks_for_nothing(client):
    """"auto" is the API's default, which clients send with no tools too: taken, as no tool choice; "required"
    without tools still cannot be honoured."""
    from twinplane.controlplane.openai_responses import chat_body

    for tools in (None, []):  # [] defines none here, where chat refuses it
        assert chat_body({"input": "hi", "tools": tools, "tool_choice": "auto"}).keys() == {"messages"}
        answer = client.responses.create(model="scripted", input="Hello!", tools=tools, tool_choice="auto")
        assert answer.output_text == ANSWER and answer.tool_choice == "auto"
    reply = httpx.post(f"{client.base_url}responses", json={"model": "scripted", "input": "hi",
                                                            "tool_choice": "required"}, timeout=30)
    assert reply.status_code == 400 and 'tool_choice "required" needs tools' in reply.json()["error"]["message"]


@pytest.mark.parametrize("text, response_format", [
    ({"format": {"type": "json_object"}}, {"type": "json_object"}),
    ({"format": {"type": "text"}}, {"type": "text"}),
    ({}, {"type": "text"}),
    ({"format": {"type": "json_schema", "name": "p", "schema": TOOLS[0]["parameters"], "strict": True}},
     {"type": "json_schema", "json_schema": {"name": "p", "schema": TOOLS[0]["parameters"], "strict": True}}),
])
def test_text_format_becomes_the_chat_response_format(text, response_format):
    from twinplane.controlplane.api import Limits
    from twinplane.controlplane.json_schema import any_json_regex
    from twinplane.controlplane.openai_api import parse_request
    from twinplane.controlplane.openai_responses import chat_body

    chat = chat_body({"input": "hi", "text": text})
    assert chat["response_format"] == response_format
    regex = parse_request(chat, Limits(4096, 4096), "r", chat=True).calls[0].params.regex
    assert (regex == any_json_regex()) == (response_format["type"] == "json_object")
    assert (regex is None) == (response_format["type"] == "text")


@pytest.mark.parametrize("body, words", [
    ({"text": {"format": {"type": "json_schema", "name": "p"}}},
     ('text.format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name": ..., '
      '"schema": {...}}')),
    ({"text": {"format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {}}}}}, "text.format must be"),
    ({"top_logprobs": 2}, "include: message.output_text.logprobs (and top_logprobs) are not supported here"),
    ({"tool_choice": {"type": "function"}},
     'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}, got {"type": "function"}'),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, 'tool_choice must be "auto", "none"'),
    ({"tool_choice": {"type": "file_search"}}, 'tool_choice must be "auto", "none"'),
    ({"top_logprobs": 2.0}, "top_logprobs must be an integer in [0, 20], got float"),
    ({"top_logprobs": True}, "top_logprobs must be an integer in [0, 20], got bool"),
    ({"top_logprobs": False}, "top_logprobs must be an integer in [0, 20], got bool"),
    ({"top_logprobs": 21}, "top_logprobs must be in [0, 20], got 21"),
    ({"top_logprobs": 2 ** 70}, "top_logprobs must be in [0, 20], got 1180591620717411303424"),
    ({"include": ["reasoning.encrypted_content", 5]}, "include must be a list of strings"),
], ids=["json-schema-without-schema", "chat-json-schema", "top-logprobs", "tool-choice-unnamed",
        "tool-choice-chat-form", "tool-choice-other-tool", "top-logprobs-float", "top-logprobs-true",
        "top-logprobs-false", "top-logprobs-over-20", "top-logprobs-huge", "include-not-strings"])
def test_what_the_responses_api_cannot_take_is_refused_naming_its_field(body, words):
    from twinplane.controlplane.errors import InvalidRequest
    from twinplane.controlplane.openai_responses import chat_body

    with pytest.raises(InvalidRequest) as error:
        chat_body({"input": "hi", **body})
    assert str(error.value).startswith(words)


def test_top_logprobs_0_asks_for_nothing_and_is_taken():
    from twinplane.controlplane.openai_responses import chat_body

    for top in (0, None):
        chat = chat_body({"input": "hi", "top_logprobs": top})
        assert not {"logprobs", "top_logprobs"} & set(chat)


def _items(text: str, size: int, tool_call_parser: str, reasoning_parser: str | None = None) -> list[tuple[str, str]]:
    """The output items (type, text or arguments) of a response whose text came in pieces of size characters."""
    return [(item["type"], item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"])
            for item in _output(text, size, tool_call_parser, reasoning_parser)]


def _output(text: str, size: int, tool_call_parser: str, reasoning_parser: str | None = None,
            reason: str = "stop_token") -> list[dict]:
    """The output of a response whose text came in pieces of size characters, ended for reason."""
    from twinplane.controlplane.api import Limits, RequestOutput
    from twinplane.controlplane.openai_api import parse_request
    from twinplane.controlplane.openai_responses import ResponsesBuilder, chat_body
    from twinplane.controlplane.sequence import FinishReason

    body = {"model": "m", "input": "x", "tools": TOOLS}
    request = parse_request(chat_body(body), Limits(4096, 4096), "r", chat=True, tool_call_parser=tool_call_parser,
                            reasoning_parser=reasoning_parser)
    builder = ResponsesBuilder(request, "resp_r", "m", body, reasoning_parser, tool_call_parser)
    builder.start()
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for i, piece in enumerate(pieces):
        builder.add(0, RequestOutput("r", text=piece, token_ids=[0],
                                     finish_reason=FinishReason(reason) if i == len(pieces) - 1 else None))
    [last] = builder.finish({"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                             "prompt_tokens_details": {"cached_tokens": 0}})
    return last["response"]["output"]


def test_output_items_keep_the_order_the_model_wrote_them_however_the_text_was_cut():
    """Text after a call that came in the same piece as the call goes after it, in an item of its own, as it
    does when every token comes alone."""
    text = "<think>Ask.</think>\nBefore.\n" + CALL + "\nBetween.\n" + CALL.replace("Paris", "Lyon") + "\nAfter."
    expected = [("reasoning", "Ask."), ("message", "\nBefore.\n"), ("function_call", '{"city": "Paris"}'),
                ("message", "\nBetween.\n"), ("function_call", '{"city": "Lyon"}'), ("message", "\nAfter.")]
    assert _items(text, 1, "hermes", "qwen3") == expected
    for size in (2, 3, 7, 16, 50, len(text)):
        assert _items(text, size, "hermes", "qwen3") == expected, size


@pytest.mark.parametrize("parser, text", [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}\nDone.'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}\nDone.')])
def test_text_after_the_calls_of_a_json_parser_comes_after_them(parser, text):
    """llama3_json and mistral write their calls first and what follows the last one is content: it goes after
    the call's item, whether the text came in one piece or token by token."""
    for size in (1, len(text)):
        assert [kind for kind, _ in _items(text, size, parser)] == ["function_call", "message"], size


def test_mistral_text_before_its_tag_comes_before_the_calls_in_the_same_piece():
    """Mistral's content runs up to [TOOL_CALLS]: text before the tag goes before the call's item, also when the
    tag and the call come in the same piece as that text."""
    text = 'Sure.\n[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    for size in (1, 4, len(text)):
        assert _items(text, size, "mistral") == [("message", "Sure.\n"), ("function_call", '{"city": "Paris"}')], size


@pytest.mark.parametrize("parser, text, statuses", [
    ("hermes", "<think>Ask.</think>Hi" + CALL + " and mo", ["completed", "completed", "completed", "incomplete"]),
    ("hermes", "Hi" + CALL, ["completed", "completed"]),  # the call's block closed: whole
    ("hermes", "Hi" + CALL[:-3], ["completed", "incomplete"]),  # its block cut short
    ("llama3_json", '{"name": "get_weather", "parameters": {}}; {"name": "get_weather", "parameters": {"ci',
     ["completed", "incomplete"])])
def test_only_the_item_the_cut_left_short_is_incomplete_however_the_text_was_cut(parser, text, statuses):
    """Cut by max_output_tokens, the item the text ends in is incomplete and those that ended before it are
    whole: the same whether the last output brought one token or many (--stream-interval, a stream that
    fell behind)."""
    for size in (1, 5, len(text)):
        output = _output(text, size, parser, "qwen3", reason="length")
        assert [item["status"] for item in output] == statuses, size
