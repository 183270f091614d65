"""Runs the data plane: load the model, size the KV cache, serve StepPlans."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from twinplane.controlplane.event_loop import freeze_heap
from twinplane.controlplane.tls import bound_address
from twinplane.dataplane.config import DataPlaneConfig
from twinplane.dataplane.embedded import model_name, resolve_model
from twinplane.dataplane.server import create_health_server, create_server
from twinplane.dataplane.stopping import Stop

log = logging.getLogger("twinplane.dataplane")


def check_config(config: DataPlaneConfig) -> DataPlaneConfig:
    """The config with its model resolved to a folder (or dummy name) and named as given, after
    checking that the model's config loads and describes a model that can be built, that a folder
    holds weights, that its generation_config.json's sampling defaults are numbers, and that the model
    splits over the tensor-parallel ranks; ValueError says what is wrong."""
    from twinplane.dataplane.loader import (check_shape, check_tensor_parallel, generation_defaults_of,  # torch
                                            is_dummy, load_hf_config)

    config = dataclasses.replace(config, model=resolve_model(config.model),
                                 model_name=config.model_name or model_name(config.model))
    hf_config = load_hf_config(config.model)
    if not is_dummy(config.model) and not any(Path(config.model).glob("*.safetensors")):
        raise ValueError(f"model {config.model!r} holds no *.safetensors files: its weights are needed")
    check_shape(hf_config, config.model)
    generation_defaults_of(config.model)  # before the weights load, which may take minutes
    check_tensor_parallel(hf_config, config.tensor_parallel_size)
    return config


def _projections(runner) -> str:
    """The start-up line's note on projections: quack's GEMM takes those of one wave, where it runs."""
    from twinplane.kernels import wave_gemm

    return ", quack's GEMM for projections of one wave" if wave_gemm.in_use(runner.device, runner.dtype) else ""


def serve(config: DataPlaneConfig, listen: str, token: str | None = None, credentials=None,
          health_listen: str | None = None, stop: Stop | None = None) -> None:
    """Serves until stop (stopping.py; by default SIGTERM or SIGINT), over TLS with
    grpc.ServerCredentials, and health alone in plaintext on health_listen when given; then stops
    the servers and releases the runner."""
    from twinplane.dataplane.model_runner import ModelRunner  # imports torch

    stop = stop or Stop()
    config = check_config(config)  # before any rank starts
    workers = None
    if config.tensor_parallel_size > 1:
        from twinplane.dataplane.tensor_parallel import TensorParallelWorkers

        workers = TensorParallelWorkers(config)  # spawns ranks 1..N-1; this process becomes rank 0
    try:
        runner = ModelRunner(config)
        server, port, servicer = create_server(runner, listen, token, workers, credentials)
        listen = bound_address(listen, port)
        servers = [server]
        if health_listen:
            health, health_port = create_health_server(health_listen)
            servers.append(health)
            health_listen = bound_address(health_listen, health_port)
        freeze_heap("data plane")
        for each in servers:
            each.start()
    except BaseException:  # an address it cannot listen on, a model that does not fit, Ctrl-C
        if workers is not None:
            workers.kill()  # they ignore signals; nothing else would end them
        raise
    desc = runner.describe()
    log.info("data plane ready on %s%s%s: %s, %s, %d KV blocks of %d tokens in %s, attention %s%s",
             listen, " (TLS)" if credentials is not None else "",
             f", health on {health_listen}" if health_listen else "", desc.model, desc.dtype, desc.num_kv_blocks,
             desc.block_size, desc.kv_cache_dtype, desc.attention_backend, _projections(runner))
    stop.wait()
    for each in servers:
        each.stop(grace=2.0).wait()
    servicer.close()  # waits for a Step stream's last launch, then stops the workers and the runner
    log.info("data plane stopped")
