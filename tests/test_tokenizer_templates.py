"""Chat templates that refuse, fail or do not compile, and chat content that spells special tokens,
with the embedded SmolLM2 tokenizer (its template uses <|im_start|> and <|im_end|>)."""

from __future__ import annotations

import shutil

import grpc
import pytest

from twinplane.controlplane.errors import InvalidRequest, TemplateBroken
from twinplane.controlplane.server import status_of
from twinplane.controlplane.tokenizer import Tokenizer


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
