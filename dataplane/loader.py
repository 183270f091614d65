"""Build a model from a Hugging Face folder or a ``dummy:<shape>`` name and fill its weights.

Every checkpoint tensor goes through the ``weight_loader`` of the parameter it belongs to
(packed q/k/v and gate/up tensors through the packed layer's loader with their shard id),
so tensor-parallel sharding lives in the layers, not here. Loading fails with ValueError
on unknown tensors and on parameters the checkpoint leaves unset.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, PretrainedConfig

from twinplane.controlplane.generation_config import FILE_NAME, read_file, written_defaults
from twinplane.dataplane.attention_backends.base import AttentionBackend
from twinplane.dataplane.dummy import checkpoint_shapes, dummy_hf_config, dummy_weights, is_dummy
from twinplane.dataplane.models.decoder import DecoderForCausalLM
from twinplane.dataplane.models.registry import model_class_for

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class LoadedModel:
    model: DecoderForCausalLM
    hf_config: PretrainedConfig
    architecture: str
    eos_token_ids: list[int]
    tokenizer_path: str  # the model folder when it holds tokenizer files, else ""
    # the sampling defaults its generation_config.json writes, by key (controlplane/generation_config.py)
    generation_config: dict[str, float | int]


def load_hf_config(model: str) -> PretrainedConfig:
    """The transformers config of a model folder or a ``dummy:<shape>`` name."""
    if is_dummy(model):
        return dummy_hf_config(model)
    if not (Path(model) / "config.json").is_file():
        raise ValueError(f"model {model!r} is neither a folder with config.json nor a dummy:<shape> name")
    try:
        return AutoConfig.from_pretrained(model)
    except OSError as exc:  # e.g. config.json is not JSON
        raise ValueError(f"model {model!r}: {exc}") from None


def check_shape(hf_config: PretrainedConfig, model: str) -> None:
    """Raises ValueError for a config.json the model cannot be built from: its heads do not group
    (query heads a multiple of KV heads), or an activation other than SiLU."""
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if not (kv_heads >= 1 and heads >= 1 and heads % kv_heads == 0):
        raise ValueError(f"model {model!r}: config.json's num_attention_heads ({heads}) must be a positive "
                         f"multiple of its num_key_value_heads ({kv_heads})")
    activation = getattr(hf_config, "hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"model {model!r}: config.json's hidden_act {activation!r} is not supported; only "
                         "'silu' is")


def check_tensor_parallel(hf_config: PretrainedConfig, tensor_parallel_size: int) -> None:
    """Raises ValueError unless the model's heads and MLP split evenly over tensor_parallel_size
    ranks: query heads and the intermediate size divide by it, and KV heads either divide by it
    or divide it (then each is replicated on several ranks)."""
    tp = tensor_parallel_size
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    intermediate = hf_config.intermediate_size
    if heads % tp or intermediate % tp or (kv_heads % tp and tp % kv_heads):
        sizes = [n for n in range(1, heads + 1)
                 if heads % n == 0 and intermediate % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]
        raise ValueError(f"tensor_parallel_size {tp} does not split this model ({heads} query heads, {kv_heads} KV "
                         f"heads, intermediate size {intermediate}); sizes that do: {sizes}")


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _generation_config(model: str) -> dict:
    """The model folder's generation_config.json as it is written ({} for a dummy model or without the file)."""
    return {} if is_dummy(model) else read_file(model)


def eos_token_ids_of(model: str, hf_config: PretrainedConfig) -> list[int]:
    """EOS ids from generation_config.json when it names any, else from config.json."""
    return _as_id_list(_generation_config(model).get("eos_token_id")) or \
        _as_id_list(getattr(hf_config, "eos_token_id", None))


def generation_defaults_of(model: str) -> dict[str, float | int]:
    """The sampling defaults (and max_new_tokens) that the model's generation_config.json writes; ValueError
    for one that is not a number. The control plane checks their ranges, as it checks a request's."""
    return written_defaults(_generation_config(model), str(Path(model) / FILE_NAME))


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(hf_config: PretrainedConfig, backend: AttentionBackend | None, dtype: torch.dtype,
                device: torch.device) -> tuple[str, DecoderForCausalLM]:
    """(architecture, model with uninitialised weights) built directly on ``device`` (may be meta)."""
    architecture, model_cls = model_class_for(hf_config)
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(hf_config, backend)
    return architecture, model.eval()


def _target(name: str, mapping: dict[str, tuple[str, str | int]]) -> tuple[str, str | int | None]:
    for checkpoint_part, (packed_part, shard_id) in mapping.items():
        if f".{checkpoint_part}." in name:
            return name.replace(f".{checkpoint_part}.", f".{packed_part}."), shard_id
    return name, None


def load_weights(model: DecoderForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy (checkpoint name, full tensor) pairs into the model through the weight loaders."""
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or (model.tie_word_embeddings and name == "lm_head.weight"):
            continue
        param_name, shard_id = _target(name, model.packed_modules_mapping)
        if param_name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
        param = params[param_name]
        loader = getattr(param, "weight_loader", None)
        try:
            if shard_id is not None:
                loader(param, tensor, shard_id)
            elif loader is not None:
                loader(param, tensor)
            elif param.shape != tensor.shape:
                raise ValueError(f"parameter {tuple(param.shape)}, checkpoint {tuple(tensor.shape)}")
            else:
                param.data.copy_(tensor)
        except (ValueError, RuntimeError) as exc:  # RuntimeError: a shard past the tensor's end (narrow)
            raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)} does not fit the model config.json "
                             f"describes: {exc}") from None
        seen.add(param_name)
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"checkpoint leaves {len(missing)} parameters unset, e.g. {missing[:3]}")


def safetensors_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the folder's *.safetensors files (one or many shards)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder!r}")
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except SafetensorError as exc:  # truncated or not a safetensors file: a copy that did not finish
            raise ValueError(f"{file} is not a whole safetensors file ({exc})") from None


def load_model(model: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
               backend: AttentionBackend | None = None) -> LoadedModel:
    """Config, model and weights for a folder or ``dummy:<shape>``."""
    hf_config = load_hf_config(model)
    architecture, net = build_model(hf_config, backend, dtype, device)
    if is_dummy(model):
        shapes = checkpoint_shapes(hf_config, net.spec_from_config(hf_config))
        load_weights(net, dummy_weights(shapes, seed, dtype, device))
        tokenizer_path = ""
    else:
        load_weights(net, safetensors_weights(model))
        has_tokenizer = any((Path(model) / f).is_file() for f in TOKENIZER_FILES)
        tokenizer_path = model if has_tokenizer else ""
    return LoadedModel(net, hf_config, architecture, eos_token_ids_of(model, hf_config), tokenizer_path,
                       generation_defaults_of(model))
