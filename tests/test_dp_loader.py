"""Loader: dummy weights (deterministic, tied, real shapes on the meta device) and HF folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from twinplane.dataplane.dummy import DUMMY_SHAPES, checkpoint_shapes, dummy_hf_config
from twinplane.dataplane.loader import (build_model, eos_token_ids_of, generation_defaults_of, load_hf_config,
                                       load_model, load_weights)

CPU = torch.device("cpu")
META = torch.device("meta")


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_dummy_weights_are_deterministic_per_seed() -> None:
    first = _state(load_model("dummy:tiny-qwen3", torch.float32, CPU, seed=0).model)
    again = _state(load_model("dummy:tiny-qwen3", torch.float32, CPU, seed=0).model)
    other = _state(load_model("dummy:tiny-qwen3", torch.float32, CPU, seed=1).model)
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert not torch.equal(first[qkv], other[qkv])
    std = first["model.layers.0.mlp.gate_up_proj.weight"].std().item()
    assert 0.015 < std < 0.025
    assert torch.equal(first["model.layers.1.input_layernorm.weight"], torch.ones(64))


@pytest.mark.parametrize("name", ["dummy:tiny-qwen3", "dummy:tiny-llama", "dummy:smollm2-135m"])
def test_tied_embeddings_share_one_tensor(name: str) -> None:
    model = load_model(name, torch.float32, CPU).model if "tiny" in name else build_model(
        load_hf_config(name), None, torch.float32, META)[1]
    assert model.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight


def _hf_meta_shapes(name: str) -> dict[str, tuple[int, ...]]:
    config = dummy_hf_config(name)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


@pytest.mark.parametrize("name,expected_params", [
    ("dummy:qwen3-0.6b", 596_049_920), ("dummy:qwen3-8b", 8_190_735_360), ("dummy:smollm2-135m", 134_515_008)])
def test_real_shapes_on_meta(name: str, expected_params: int) -> None:
    config = load_hf_config(name)
    _, model = build_model(config, None, torch.bfloat16, META)
    assert sum(p.numel() for p in model.parameters()) == expected_params
    spec = model.spec_from_config(config)
    assert checkpoint_shapes(config, spec) == _hf_meta_shapes(name)
    assert sum(int(torch.tensor(s).prod()) for s in checkpoint_shapes(config, spec).values()) == expected_params


def test_dummy_configs_match_the_brief() -> None:
    small = dummy_hf_config("dummy:qwen3-0.6b")
    assert (small.hidden_size, small.num_hidden_layers, small.num_attention_heads, small.num_key_value_heads,
            small.head_dim, small.intermediate_size, small.vocab_size) == (1024, 28, 16, 8, 128, 3072, 151936)
    assert small.tie_word_embeddings and small.max_position_embeddings == 40960
    assert not dummy_hf_config("dummy:qwen3-8b").tie_word_embeddings
    assert set(DUMMY_SHAPES) >= {"qwen3-0.6b", "qwen3-8b", "smollm2-135m", "tiny-qwen3", "tiny-llama"}
    with pytest.raises(ValueError, match="unknown dummy model"):
        load_hf_config("dummy:nope")


def _tiny_folder(tmp_path: Path) -> Path:
    config = dummy_hf_config("dummy:tiny-llama")
    config.vocab_size = 128
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    return tmp_path


def test_eos_ids_and_tokenizer_path_from_folder(tmp_path: Path) -> None:
    folder = _tiny_folder(tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    loaded = load_model(str(folder), torch.float32, CPU)
    assert loaded.eos_token_ids == [2, 7] and loaded.tokenizer_path == ""
    (folder / "generation_config.json").write_text(json.dumps({}))
    assert eos_token_ids_of(str(folder), loaded.hf_config) == [2]
    (folder / "tokenizer_config.json").write_text("{}")
    assert load_model(str(folder), torch.float32, CPU).tokenizer_path == str(folder)


def test_generation_defaults_are_the_sampling_keys_the_file_writes(tmp_path: Path) -> None:
    """As written in generation_config.json (not transformers' GenerationConfig, whose class defaults no file
    wrote); a null is not written; a dummy model has no file."""
    folder = _tiny_folder(tmp_path)
    assert load_model(str(folder), torch.float32, CPU).generation_config == {}  # as transformers saved it
    written = {"eos_token_id": [2], "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0,
               "repetition_penalty": None, "max_new_tokens": 512, "num_beams": 4}
    (folder / "generation_config.json").write_text(json.dumps(written))
    loaded = load_model(str(folder), torch.float32, CPU)
    assert loaded.generation_config == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0,
                                        "max_new_tokens": 512}
    assert generation_defaults_of("dummy:tiny-llama") == {}
    for key, value, kind in (("top_k", 20.5, "a 64-bit integer"), ("max_new_tokens", 2 ** 63, "a 64-bit integer"),
                             ("temperature", "0.6", "a number"), ("top_p", True, "a number")):
        (folder / "generation_config.json").write_text(json.dumps({key: value}))
        with pytest.raises(ValueError, match=f"generation_config.json: {key} must be {kind}, got"):
            generation_defaults_of(str(folder))
    (folder / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="generation_config.json holds no JSON object"):
        load_model(str(folder), torch.float32, CPU)


def test_checkpoint_problems_raise(tmp_path: Path) -> None:
    folder = _tiny_folder(tmp_path)
    _, model = build_model(load_hf_config(str(folder)), None, torch.float32, CPU)
    with pytest.raises(ValueError, match="unset"):
        load_weights(model, [("model.norm.weight", torch.ones(64))])
    with pytest.raises(ValueError, match="no matching"):
        load_weights(model, [("model.bogus.weight", torch.ones(64))])
    save_file({"model.norm.weight": torch.ones(64)}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="unset"):
        load_model(str(folder), torch.float32, CPU)


def test_a_missing_attention_package_says_what_to_install() -> None:
    import importlib.util

    from twinplane.dataplane.attention_backends import get_attention_backend

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    with pytest.raises(ValueError, match=r"'flash_attn_4' cannot be loaded: .*twinplane\[gpu\]"):
        get_attention_backend("flash_attn_4", "cuda")
    assert get_attention_backend("auto", "cpu").name == "torch"


def test_the_checkout_root_does_not_hide_hugging_faces_kernels_package():
    """Run in a checkout (cwd on sys.path), the kernels folder is also found as a top-level
    ``kernels``: the name of Hugging Face's package, which transformers imports when it is
    installed. That import must get Hugging Face's package; where there is none, this folder without a
    version (transformers imports a ``kernels`` without package metadata to read its version, and a
    failing import would break ``import transformers``)."""
    import importlib.metadata
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = "import kernels; print(kernels.__file__)"
    result = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        assert result.returncode == 0, result.stderr
        assert Path(result.stdout.strip()).resolve().is_relative_to(root / "kernels"), result.stdout
    else:
        assert result.returncode == 0, result.stderr
        assert not Path(result.stdout.strip()).resolve().is_relative_to(root / "kernels"), result.stdout
    result = subprocess.run([sys.executable, "-c", "from transformers import LlamaConfig, Qwen3Config"], cwd=root,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
