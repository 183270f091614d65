"""The keys of a model's generation_config.json that vLLM serves as the defaults of what requests leave unset.

vLLM takes the sampling keys that a model's generation_config.json writes (GENERATION_KEYS) as the
defaults of the requests that leave those fields unset, and its max_new_tokens as the default
max_tokens. This reads them as written: the raw JSON, not transformers' GenerationConfig, whose
class defaults (top_k 50) no file wrote. The data plane reads the file beside the weights
(``dataplane/loader.py``) and describes what it found.
"""

from __future__ import annotations

import json
from pathlib import Path

FILE_NAME = "generation_config.json"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # the request fields' names
GENERATION_KEYS = (*SAMPLING_KEYS, "max_new_tokens")  # max_new_tokens: the default max_tokens
_INTEGER_KEYS = ("top_k", "max_new_tokens")


def read_file(folder: str | Path) -> dict:
    """The JSON object in folder's generation_config.json ({} when there is none); ValueError names a file
    that holds none."""
    path = Path(folder) / FILE_NAME
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, or not JSON
        raise ValueError(f"{path} cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds no JSON object")
    return config


def generation_values(config: dict, where: str) -> dict[str, float | int | None]:
    """The GENERATION_KEYS that config sets, each a number (top_k and max_new_tokens: a 64-bit integer, as
    the data plane describes them) or null; ValueError, naming where, for another value."""
    values = {key: config[key] for key in GENERATION_KEYS if key in config}
    for key, value in values.items():
        integer = key in _INTEGER_KEYS
        ok = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool) and \
            (not integer or -2 ** 63 <= value < 2 ** 63)
        if value is not None and not ok:
            raise ValueError(f"{where}: {key} must be {'a 64-bit integer' if integer else 'a number'}, "
                             f"got {value!r}")
    return values


def written_defaults(config: dict, where: str) -> dict[str, float | int]:
    """The GENERATION_KEYS that a generation_config.json's object writes (a null: not written)."""
    return {key: value for key, value in generation_values(config, where).items() if value is not None}

