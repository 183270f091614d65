"""The served model's tokenizer and chat template, without torch.

Reads a Hugging Face folder directly: ``tokenizer.json`` through the
``tokenizers`` library and the chat template (``chat_template.jinja`` or
``tokenizer_config.json``) through a sandboxed Jinja environment, the way
transformers renders it. transformers itself is not imported, since it pulls
in torch and the control plane stays CPU-light.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

CHAT_ROLES = ("system", "user", "assistant", "tool")


class TemplateError(ValueError):
    """The chat template refused the messages."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        self.folder = folder
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}: point --tokenizer at the model's tokenizer "
                                    "files (tokenizer.json, tokenizer_config.json)")
        self._tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text() if template_file.exists() else config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self._template = self._compile(template) if template else None
        self.special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self._tok.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise TemplateError("this model has no chat template; send text or token ids instead")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        # The template already places the special tokens the model expects.
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    @staticmethod
    def _compile(template: str) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(template)
