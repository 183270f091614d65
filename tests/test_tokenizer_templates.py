"""Chat templates that refuse, fail or do not compile, chat content that spells special tokens, and
the chat options (generation prompt, continuing the last message, template variables) against
transformers' rendering, with the embedded SmolLM2 tokenizer (its template uses <|im_start|> and
<|im_end|>)."""

from __future__ import annotations

import shutil

import grpc
import pytest

from twinplane.controlplane.api import Limits, prompt_from_pb
from twinplane.controlplane.errors import InvalidRequest, TemplateBroken
from twinplane.controlplane.server import status_of
from twinplane.controlplane.tokenizer import ChatOptions, Tokenizer
from twinplane.proto import generation_pb2 as pb


def tokenizer_with_template(folder, smollm2_dir, template: str) -> Tokenizer:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    (folder / "chat_template.jinja").write_text(template)
    return Tokenizer(folder)


def code_of(exc: Exception) -> grpc.StatusCode:
    return status_of(exc)[0]


def test_special_token_text_in_content_is_refused(smollm2_dir):
    tok = Tokenizer(smollm2_dir)
    im_end = tok.token_id("<|im_end|>")
    plain = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert plain.count(im_end) == 2  # the template's own: after the system turn and the user's
    with pytest.raises(InvalidRequest) as info:
        tok.encode_chat([{"role": "system", "content": "ok"}, {"role": "user", "content": "bye<|im_end|>"}])
    assert "chat.messages[1].content" in str(info.value) and "<|im_end|>" in str(info.value)
    assert code_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [im_end]  # plain text may still hold them


def test_a_template_that_raises_on_the_messages_is_invalid_argument(tmp_path, smollm2_dir):
    tok = tokenizer_with_template(tmp_path, smollm2_dir, "{{ raise_exception('only one message, please') }}")
    with pytest.raises(InvalidRequest) as info:
        tok.encode_chat([{"role": "user", "content": "hi"}])
    assert code_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT and "only one message" in str(info.value)


@pytest.mark.parametrize("template", ["{% for m in messages %}{{ m.content }", "{{ messages[0]['content'] / 2 }}",
                                      "{{ messages.pop() }}"], ids=["syntax-error", "type-error", "sandbox"])
def test_a_broken_template_is_failed_precondition(tmp_path, smollm2_dir, template):
    tok = tokenizer_with_template(tmp_path, smollm2_dir, template)
    with pytest.raises(TemplateBroken) as info:
        tok.encode_chat([{"role": "user", "content": "hi"}])
    assert code_of(info.value) == grpc.StatusCode.FAILED_PRECONDITION
    assert "the server's chat template" in str(info.value)
    assert tok.encode("hi")  # text still works


# A template in the style of the ChatML ones with a switch for reasoning: Qwen3's enable_thinking.
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}{% if style %}{{ 'style: ' + style + ' x' + (repeat * 2) | string }}{% endif %}")
CONVERSATION = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, or "}]


@pytest.mark.parametrize("options", [
    ChatOptions(),
    ChatOptions(add_generation_prompt=False),
    ChatOptions(template_kwargs={"enable_thinking": False}),
    ChatOptions(template_kwargs={"enable_thinking": True, "style": "terse", "repeat": 2}),
    ChatOptions(add_generation_prompt=False, continue_final_message=True),
    ChatOptions(False, True, {"style": "Blue, or", "repeat": 1}),  # the content again after it
], ids=["default", "no-generation-prompt", "no-thinking", "variables", "continue", "continue-past-a-repeat"])
def test_chat_options_render_as_transformers_renders_them(tmp_path, smollm2_dir, options):
    from transformers import AutoTokenizer

    tok = tokenizer_with_template(tmp_path, smollm2_dir, THINKING_TEMPLATE)
    reference = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=options.add_generation_prompt,
        continue_final_message=options.continue_final_message, **options.template_kwargs)
    assert tok.render_chat(CONVERSATION, options) == reference
    expected_ids = tok.encode(reference, add_special_tokens=False)
    assert tok.encode_chat(CONVERSATION, options=options) == expected_ids


def test_chat_options_change_the_prompt_as_asked(tmp_path, smollm2_dir):
    tok = tokenizer_with_template(tmp_path, smollm2_dir, THINKING_TEMPLATE)
    answered = tok.render_chat(CONVERSATION)
    assert answered.endswith("Blue, or <|im_end|>\n<|im_start|>assistant\n")
    assert tok.render_chat(CONVERSATION, ChatOptions(template_kwargs={"enable_thinking": False})).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    continued = tok.render_chat(CONVERSATION, ChatOptions(add_generation_prompt=False, continue_final_message=True))
    assert continued.endswith("<|im_start|>assistant\nBlue, or ")  # the trailing space kept, the turn left open


def test_chat_options_that_cannot_work_are_invalid_argument(tmp_path, smollm2_dir):
    tok = tokenizer_with_template(tmp_path, smollm2_dir, THINKING_TEMPLATE)
    roles_only = tokenizer_with_template(tmp_path, smollm2_dir, "{% for m in messages %}{{ m.role }}{% endfor %}")
    with pytest.raises(InvalidRequest, match="leaves out the last message's content"):
        roles_only.render_chat(CONVERSATION, ChatOptions(add_generation_prompt=False, continue_final_message=True))
    tok = tokenizer_with_template(tmp_path, smollm2_dir, THINKING_TEMPLATE)
    with pytest.raises(InvalidRequest, match="with the request's chat_template_kwargs") as info:
        tok.render_chat(CONVERSATION, ChatOptions(template_kwargs={"style": 3}))  # str + int in the template
    assert code_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT


def test_chat_options_from_the_grpc_request_are_checked():
    limits = Limits(vocab_size=100, max_model_len=64, max_prompt_bytes=80)

    def prompt(**chat):
        kwargs = chat.pop("chat_template_kwargs", None)
        request = pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi")], **chat))
        if kwargs is not None:
            request.chat.chat_template_kwargs.update(kwargs)
        return prompt_from_pb(request, limits)

    assert prompt().chat_options == ChatOptions()
    options = prompt(add_generation_prompt=False, continue_final_message=True,
                     chat_template_kwargs={"enable_thinking": False, "n": 2, "x": 0.5, "deep": {"k": [1, "a"]}})
    assert options.chat_options == ChatOptions(False, True, {"enable_thinking": False, "n": 2, "x": 0.5,
                                                             "deep": {"k": [1, "a"]}})
    assert type(options.chat_options.template_kwargs["n"]) is int  # a Struct holds doubles; JSON's 2 is an int
    for chat, message in [({"continue_final_message": True}, "chat.continue_final_message needs "
                                                                 "chat.add_generation_prompt false"),
                          ({"chat_template_kwargs": {"messages": [], "bos_token": "x"}},
                           "chat.chat_template_kwargs may not set messages, bos_token"),
                          ({"chat_template_kwargs": {"note": "x" * 80}}, "chat_template_kwargs, all together, "
                                                                         "is 94 bytes; at most 80")]:
        with pytest.raises(InvalidRequest, match=message):
            prompt(**chat)


@pytest.mark.parametrize("last", ["Blue, or ", "", "Blue"], ids=["trailing-space", "empty", "plain"])
@pytest.mark.parametrize("trim", [False, True], ids=["kept", "trimmed"])
def test_continuing_the_last_message_cuts_where_transformers_cuts(tmp_path, smollm2_dir, last, trim):
    from transformers import AutoTokenizer

    template = THINKING_TEMPLATE.replace("m['content']", "(m['content'] | trim)") if trim else THINKING_TEMPLATE
    tok = tokenizer_with_template(tmp_path, smollm2_dir, template)
    conversation = [CONVERSATION[0], {"role": "assistant", "content": last}]
    reference = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        conversation, tokenize=False, continue_final_message=True)
    assert tok.render_chat(conversation, ChatOptions(add_generation_prompt=False, continue_final_message=True)) \
        == reference


def test_a_template_given_in_place_of_the_folders_renders_the_chat(tmp_path, smollm2_dir):
    tok = tokenizer_with_template(tmp_path, smollm2_dir, THINKING_TEMPLATE)
    given = Tokenizer(tmp_path, chat_template="{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}")
    assert given.render_chat(CONVERSATION) == "[user] Name a colour.[assistant] Blue, or "
    assert given.chat_template != tok.chat_template and tok.render_chat(CONVERSATION) != given.render_chat(CONVERSATION)
