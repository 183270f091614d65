"""The served model's tokenizer and chat template, without torch.

Reads a Hugging Face folder directly: ``tokenizer.json`` through the
``tokenizers`` library and the chat template (``chat_template.jinja`` or
``tokenizer_config.json``) through a sandboxed Jinja environment, the way
transformers renders it. transformers itself is not imported, since it pulls
in torch and the control plane stays CPU-light.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from twinplane.controlplane.errors import InvalidRequest, TemplateBroken

CHAT_ROLES = ("system", "user", "assistant", "tool")
# the text fields of a message beside role, content and an assistant's tool_calls, passed to the template when set
MESSAGE_FIELDS = ("name", "tool_call_id", "reasoning_content")
# template variables the server sets itself, which a request's template kwargs may not replace
SERVER_TEMPLATE_NAMES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception",
                         "strftime_now")


@dataclass(frozen=True)
class ChatOptions:
    """How chat messages become a prompt: followed by the template's generation prompt (the
    opening of an assistant turn), or with the last message left open for the model to continue
    (a reply begun for it); the tools the model may call (the template's ``tools``); and extra
    variables for the template, e.g. Qwen3's enable_thinking."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict = field(default_factory=dict)
    tools: list[dict] | None = None


class TemplateError(InvalidRequest):
    """The chat template refused the messages (its raise_exception)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(f"the chat template refused the messages: {message}")


# appended to the last message's content when it is to be continued; the render is cut where it lands
_OPEN_END = "<twinplane: the last message stops here> "


def _cut_at_open_end(text: str) -> str:
    """The rendered chat up to the end of the last message's content (marked with _OPEN_END), as
    transformers' continue_final_message cuts it: where the template trims the content's trailing
    whitespace, so is the cut."""
    at = text.rfind(_OPEN_END.strip())
    if at < 0:
        raise InvalidRequest("continue_final_message: the chat template leaves out the last message's content, "
                             "so there is nothing to continue")
    return text[:at] if text.startswith(_OPEN_END, at) else text[:at].rstrip()


def chat_texts(messages: list[dict], name: str, variables: dict) -> list[tuple[str, str]]:
    """What each message field but the role, and each template variable given (a value, or None
    for none), adds to the prompt as text (JSON unless a string), named as the client's API names
    it: "chat.messages[0].content", "chat.tools" beside "chat.messages"."""
    texts = [(f"{name}[{i}].{key}", value) for i, message in enumerate(messages) for key, value in message.items()
             if key != "role"]
    texts += [(name.removesuffix("messages") + key, value) for key, value in variables.items() if value]
    return [(where, value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
            for where, value in texts]


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        return value.get("content")
    return value if isinstance(value, str) else None


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes-to-unicode table, inverted: the byte each character of a byte-level BPE token stands for
    (printable Latin-1 characters for themselves, the other bytes as U+0100 onwards, in byte order)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    table.update({chr(0x100 + k): b for k, b in enumerate(b for b in range(256) if b not in printable)})
    return table


def _byte_level_bytes(piece: str | None) -> bytes | None:
    alphabet = _byte_level_alphabet()
    if piece is None or not all(c in alphabet for c in piece):  # no such id, or not a byte-level piece
        return None
    return bytes(alphabet[c] for c in piece)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _sentencepiece_bytes(piece: str | None) -> bytes | None:
    if piece is None:
        return None
    byte = _BYTE_PIECE.fullmatch(piece)  # byte fallback
    return bytes([int(byte[1], 16)]) if byte else piece.replace("\u2581", " ").encode()


class TokenizerFilesError(ValueError):
    """A tokenizer folder whose files are missing or cannot be read: what a restart would not mend."""


class Tokenizer:
    def __init__(self, folder: str | Path, chat_template: str | None = None):
        """chat_template: a template's text, in place of the folder's. TokenizerFilesError names the file
        that is missing or cannot be read."""
        folder = Path(folder)
        self.folder = folder
        if not (folder / "tokenizer.json").is_file():
            raise TokenizerFilesError(f"no tokenizer.json in {folder}: point --tokenizer at the model's tokenizer "
                                      "files (tokenizer.json, tokenizer_config.json)")
        try:
            self._tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # the tokenizers library raises a bare Exception for a file it cannot parse
            raise TokenizerFilesError(f"{folder / 'tokenizer.json'} cannot be read: {exc}") from None
        config_path = folder / "tokenizer_config.json"
        template_file = folder / "chat_template.jinja"
        try:
            config = json.loads(config_path.read_text()) if config_path.exists() else {}
            if not isinstance(config, dict):
                raise ValueError(f"a JSON object is needed, not {type(config).__name__}")
            template = template_file.read_text() if template_file.exists() else config.get("chat_template")
        except (OSError, ValueError) as exc:
            raise TokenizerFilesError(f"{config_path} or {template_file.name} cannot be read: {exc}") from None
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        if isinstance(template, list):  # named templates: use "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        template = chat_template if chat_template is not None else template
        self.chat_template: str | None = template
        self._template, self._template_error = None, None
        if template:
            try:
                self._template = self.compile_template(template)
            except jinja2.TemplateError as exc:  # served anyway: text and token ids still work
                self._template_error = f"the server's chat template does not compile: {exc}"
        special = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self.special_ids = set(special)
        longest_first = sorted(special.values(), key=len, reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, longest_first))) if special else None
        self._token_bytes: list[bytes | None] | None = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self._tok.token_to_id(text)

    def is_special(self, text: str) -> bool:
        """Whether text is one special token, which decoding with skip_special_tokens leaves out."""
        return self.token_id(text) in self.special_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch lets other threads run while it works (encode holds the GIL throughout)
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def spaces_special_tokens(self) -> bool:
        """Whether decoding puts a space between two special tokens, as a tokenizer without a decoder (or with
        WordPiece's) joins every token; byte-level and SentencePiece decoders join them as they are."""
        token = min(self.special_ids, default=None)
        return token is not None and self.decode([token, token], False) != self.decode([token], False) * 2

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's own text, special tokens included."""
        return self._tok.decode_batch([[i] for i in token_ids], skip_special_tokens=False)

    def token_bytes(self) -> list[bytes | None]:
        """The bytes each token id adds to decoded text (None for special tokens and unused ids), for the
        masks of structured outputs: byte-level BPE tokens through GPT-2's byte alphabet, SentencePiece
        ones with "\u2581" as a space and "<0xHH>" as that byte; other added tokens as their UTF-8 text."""
        if self._token_bytes is None:
            kinds, piece_bytes = self._pieces
            if piece_bytes is None:
                raise ValueError(f"token bytes: the tokenizer's decoder ({', '.join(map(str, kinds))}) is neither "
                                 "byte-level BPE nor SentencePiece")
            added = self._tok.get_added_tokens_decoder()
            self._token_bytes = [(None if added[i].special else added[i].content.encode()) if i in added
                                 else piece_bytes(self._tok.id_to_token(i)) for i in range(self.vocab_size)]
        return self._token_bytes

    @functools.cached_property
    def _pieces(self):
        """The decoder's kinds, and how one of its vocabulary's pieces maps to the bytes it adds to decoded text
        (None: neither byte-level BPE nor SentencePiece)."""
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        if "ByteLevel" in kinds:
            return kinds, _byte_level_bytes
        if kinds & {"Metaspace", "Replace", "ByteFallback"}:
            return kinds, _sentencepiece_bytes
        return kinds, None

    def logprob_bytes(self, token_id: int, text: str) -> bytes:
        """A token's bytes (OpenAI's logprobs ``bytes``), given its text (``token_texts``): the text's, but
        for a token that holds part of a character (its text alone a replacement character) the bytes of
        that part, so that the parts of one character join into it."""
        piece_bytes = self._pieces[1]
        part = piece_bytes(self._tok.id_to_token(token_id)) if "\ufffd" in text and piece_bytes else None
        return text.encode() if part is None else part

    def render_chat(self, messages: list[dict], options: ChatOptions = ChatOptions()) -> str:
        """The template's text for messages: InvalidRequest when the template refuses them (or fails
        with the request's template kwargs), TemplateBroken when the template itself fails."""
        if self._template_error:
            raise TemplateBroken(self._template_error)
        if self._template is None:
            raise InvalidRequest("this model has no chat template; send text or token ids instead")
        if options.continue_final_message:
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _OPEN_END}]
        try:
            text = self._template.render(**options.template_kwargs, messages=messages, tools=options.tools,
                                         add_generation_prompt=options.add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError:
            raise
        except Exception as exc:  # noqa: BLE001 -- whatever a template raises, the template is at fault
            failed = f"chat template failed: {type(exc).__name__}: {exc}"
            if options.template_kwargs:  # the request's values may be what it cannot take
                raise InvalidRequest(f"the {failed} (with the request's chat_template_kwargs)") from exc
            raise TemplateBroken(f"the server's {failed}") from exc
        return _cut_at_open_end(text) if options.continue_final_message else text

    def encode_chat(self, messages: list[dict], name: str = "chat.messages",
                    options: ChatOptions = ChatOptions(), add_special_tokens: bool = False) -> list[int]:
        """Token ids of the rendered messages; content may not spell out special tokens, which only the
        template places (else a message could forge turns, e.g. end its own and start the system's).
        ``name``: what the client's API calls the messages; add_special_tokens: the tokenizer's own (a BOS)
        too, beside the template's."""
        for where, text in chat_texts(messages, name, {"tools": options.tools}) if self._special_text else ():
            found = self._special_text.search(text)
            if found:
                raise InvalidRequest(f"{where} holds {found.group()!r}, a special token of this model that only the "
                                     "chat template may place; remove it or send text")
        return self.encode(self.render_chat(messages, options), add_special_tokens=add_special_tokens)

    @staticmethod
    def compile_template(template: str) -> jinja2.Template:
        """The template, compiled as transformers compiles it (jinja2.TemplateError when it cannot be)."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(template)
