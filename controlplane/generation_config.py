"""The server's defaults for what a request leaves unset, from the model's generation_config.json, as vLLM's.

vLLM serves the sampling keys a model's generation_config.json writes (GENERATION_KEYS) as the
defaults of the requests that leave those fields unset, and its max_new_tokens as the default
max_tokens (``--generation-config auto``, the default): the data plane reads the file beside the
weights (``dataplane/loader.py``) and describes what it found. ``--generation-config vllm`` serves
none of them; a folder's path serves that folder's file, read here. ``--override-generation-config``
(a JSON object) goes over what was read, whichever it was; a null there drops a key. A request's
own value always wins, and a key none of these sets keeps the built-in default
(``api.sampling_options``). The raw JSON is read, not transformers' GenerationConfig, whose class
defaults (top_k 50) no file wrote. The defaults pass a request's checks once they are known: a bad
one stops the server with a message naming its file or flag.
"""

from __future__ import annotations

import json
from pathlib import Path

from twinplane.controlplane.errors import InvalidRequest

FILE_NAME = "generation_config.json"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # the request fields' names
GENERATION_KEYS = (*SAMPLING_KEYS, "max_new_tokens")  # max_new_tokens: the default max_tokens
_INTEGER_KEYS = ("top_k", "max_new_tokens")
AUTO, VLLM = "auto", "vllm"  # --generation-config: the file the data plane read, or none; else a folder
OVERRIDE_FLAG = "--override-generation-config"


class GenerationConfigError(ValueError):
    """A default that a request could not send: the message names its file or flag, and how to start anyway."""


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


def server_defaults(mode: str, override: dict, described: dict) -> dict[str, float | int]:
    """The defaults in force, by the request fields' names (max_new_tokens as max_tokens). mode: --generation-config;
    override: --override-generation-config's object; described: the model's file as the data plane read it
    (DescribeResponse.generation_config's fields), for auto. GenerationConfigError names a value a request
    could not send."""
    if mode == AUTO:
        read, where = described, f"the model's {FILE_NAME} (read by the data plane)"
    elif mode == VLLM:
        read, where = {}, ""
    else:
        where = str(Path(mode) / FILE_NAME)
        read = written_defaults(read_file(mode), where)
    _check({key: value for key, value in read.items() if key not in override}, where, _file_remedy)
    _check({key: value for key, value in override.items() if value is not None}, OVERRIDE_FLAG, _override_remedy)
    merged = {key: value for key, value in {**read, **override}.items() if value is not None}
    return {("max_tokens" if key == "max_new_tokens" else key): value for key, value in merged.items()}


def check_flags(mode: str, override: dict) -> None:
    """Refuses (ValueError) a --generation-config other than auto, vllm or a folder holding the file, and an
    override with a key or value a request could not send; with a folder, the file's values too (with auto,
    they come with the data plane)."""
    if mode not in (AUTO, VLLM) and not (Path(mode) / FILE_NAME).is_file():
        raise ValueError(f"--generation-config must be {AUTO}, {VLLM} or a folder holding {FILE_NAME}, got {mode!r}")
    unknown = sorted(set(override) - set(GENERATION_KEYS))
    if unknown:
        raise ValueError(f"{OVERRIDE_FLAG} takes the keys {', '.join(GENERATION_KEYS)}; got {', '.join(unknown)}")
    generation_values(override, OVERRIDE_FLAG)
    server_defaults(mode, override, {})


def _check(values: dict, where: str, remedy) -> None:
    for key, value in values.items():
        if why := _why_refused(key, value):
            raise GenerationConfigError(f"{where}: {why}; {remedy(key)}")


def _why_refused(key: str, value: float | int) -> str | None:
    """What a request sending value for key would be told (None: nothing); max_new_tokens is any count >= 1,
    as it only lowers what fits."""
    if key == "max_new_tokens":
        return None if value >= 1 else f"max_new_tokens must be >= 1, got {value}"
    from twinplane.controlplane.api import sampling_options  # here: the data plane reads the file without the API

    try:
        sampling_options({key: value}, prefix="")
    except InvalidRequest as exc:
        return str(exc)
    return None


def _file_remedy(key: str) -> str:
    return (f"mend the file, or start the control plane with {OVERRIDE_FLAG} '{{\"{key}\": null}}' (the built-in "
            f"default) or --generation-config {VLLM} (none of the file's defaults)")


def _override_remedy(key: str) -> str:
    return f"give {OVERRIDE_FLAG} a value a request could send for {key}, or null for the built-in default"
