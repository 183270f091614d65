"""The ``twinplane`` command: run either plane, both, a prompt, a health check, or a benchmark."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from twinplane.controlplane.event_loop import run as run_event_loop

DEFAULT_DATAPLANE = "127.0.0.1:50061"
DEFAULT_LISTEN = "127.0.0.1:50051"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _add_dataplane_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data plane")
    g.add_argument("--model", default="default",
                   help="Hugging Face folder, 'dummy:<shape>' (random weights), or 'default' (SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 256 on GPU, 16 on CPU)")
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--num-kv-blocks", type=int, default=0, help="0 = measure (GPU) or use --cpu-kv-cache-gib")
    g.add_argument("--cpu-kv-cache-gib", type=float, default=1.0)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "flash_attn_4", "flash_attn_2", "torch"])
    g.add_argument("--weights-seed", type=int, default=0, help="seed of dummy weights and unseeded sampling")


def _dataplane_config(args: argparse.Namespace):
    from twinplane.dataplane.config import DataPlaneConfig

    block_size = args.block_size
    if block_size is None:
        block_size = 16 if args.device == "cpu" or not _has_cuda() else 256
    return DataPlaneConfig(
        model=args.model, device=args.device, dtype=args.dtype, block_size=block_size,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
        num_kv_blocks=args.num_kv_blocks, cpu_kv_cache_gib=args.cpu_kv_cache_gib,
        tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend, seed=args.weights_seed)


def _dataplane_argv(args: argparse.Namespace) -> list[str]:
    """The data-plane flags of args, to pass on to a child process."""
    out = []
    for name in ("model", "device", "dtype", "block_size", "max_model_len", "max_num_seqs",
                 "max_num_batched_tokens", "gpu_memory_utilization", "num_kv_blocks", "cpu_kv_cache_gib",
                 "tensor_parallel_size", "attention_backend", "weights_seed"):
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out + (["--enforce-eager"] if args.enforce_eager else [])


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def _add_controlplane_args(p: argparse.ArgumentParser, listen_default: str = DEFAULT_LISTEN) -> None:
    g = p.add_argument_group("control plane")
    g.add_argument("--listen", default=listen_default, help="public API address (loopback unless told otherwise)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    g.add_argument("--max-waiting-requests", type=int, default=4096)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-prefill-tokens-with-decode", type=int, default=None,
                   help="cap on prefill tokens in a step that also decodes (steadier inter-token latency)")
    g.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed message after the first; more means fewer messages under heavy load")
    g.add_argument("--max-steps-in-flight", type=int, default=2,
                   help="steps planned and sent to the data plane before the oldest one's result is applied")
    g.add_argument("--shutdown-grace", type=float, default=10.0, help="seconds in-flight streams get on SIGTERM")
    g.add_argument("--tls-cert", default=None)
    g.add_argument("--tls-key", default=None)
    g.add_argument("--api-key", default=None, help="require this key (default: $TWINPLANE_API_KEY if set)")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics over HTTP on this port (/metrics); off when not given")
    g.add_argument("--metrics-host", default=None,
                   help="address /metrics binds to (default: the host of --listen, or 127.0.0.1 for a unix socket)")
    g.add_argument("--http-listen", default=None,
                   help="serve the OpenAI-compatible HTTP API here: host:port, or a port on 127.0.0.1; off when not given")


def _controlplane(args: argparse.Namespace, dataplane: str, token: str | None):
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.main import Security

    config = ControlPlaneConfig(
        dataplane=dataplane, dataplane_token=token, listen=args.listen, tokenizer=args.tokenizer,
        max_waiting_requests=args.max_waiting_requests, enable_prefix_caching=not args.no_prefix_caching,
        shutdown_grace=args.shutdown_grace, max_prefill_tokens_with_decode=args.max_prefill_tokens_with_decode,
        stream_interval=args.stream_interval, max_steps_in_flight=args.max_steps_in_flight,
        metrics_port=args.metrics_port, metrics_host=args.metrics_host, http_listen=args.http_listen)
    security = Security(args.tls_cert, args.tls_key, args.api_key or os.environ.get("TWINPLANE_API_KEY"))
    return config, security


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default here)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", dest="sample_seed", type=int, default=None)


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                seed=args.sample_seed)


# ---- commands ---------------------------------------------------------------------------------


def cmd_dataplane(args: argparse.Namespace) -> int:
    from twinplane.dataplane.main import serve

    serve(_dataplane_config(args), args.listen, args.token or os.environ.get("TWINPLANE_DATAPLANE_TOKEN"))
    return 0


def cmd_controlplane(args: argparse.Namespace) -> int:
    from twinplane.controlplane.main import serve

    config, security = _controlplane(args, args.dataplane, args.dataplane_token)
    run_event_loop(serve(config, security))
    return 0


def _dataplane_child(args: argparse.Namespace, address: str, restart: bool = True):
    """The data plane as a child process, with args' data-plane flags and log level."""
    from twinplane.clients.launcher import DataPlaneProcess

    return DataPlaneProcess(_dataplane_argv(args) + ["--listen", address], restart=restart, log_level=args.log_level)


def cmd_serve(args: argparse.Namespace) -> int:
    from twinplane.clients.launcher import private_socket_address
    from twinplane.controlplane.main import serve

    address = args.dataplane_listen or private_socket_address()
    child = _dataplane_child(args, address)
    config, security = _controlplane(args, address, None)

    async def main() -> None:
        child.start()
        child.start_watching()
        try:
            await serve(config, security)
        finally:
            child.stop()

    run_event_loop(main())
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from twinplane.clients.client import Client

    prompt = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    with Client(args.server, api_key=args.api_key or os.environ.get("TWINPLANE_API_KEY")) as client:
        return _stream_to_terminal(client.generate(**prompt, **_sampling_kwargs(args)))


def cmd_health(args: argparse.Namespace) -> int:
    """One health check, for container health checks: exit 0 when the server says SERVING, else 1."""
    import grpc

    from twinplane.clients.client import Client

    with Client(args.server) as client:
        try:
            status = client.health_status(args.timeout)
        except grpc.RpcError as error:
            status = f"{error.code().name} ({error.details()})"
    if status != "SERVING":
        print(f"twinplane health: {args.server} is {status}", file=sys.stderr)
        return 1
    print(status)
    return 0


def _stream_to_terminal(stream) -> int:
    finish = None
    for chunk in stream:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        finish = chunk
    sys.stdout.write("\n")
    if finish is not None and finish.usage is not None:
        u = finish.usage
        print(f"[{finish.finish_reason}; prompt {u.prompt_tokens} tokens, completion {u.completion_tokens}, "
              f"cached {u.cached_prompt_tokens}]", file=sys.stderr)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Both planes on loopback, one prompt, then both stop."""
    from twinplane.clients.client import AsyncClient
    from twinplane.clients.launcher import private_socket_address
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.main import ControlPlane

    address = private_socket_address()
    child = _dataplane_child(args, address, restart=False)
    prompt = {"prompt": args.prompt} if args.no_chat else {"messages": [{"role": "user", "content": args.prompt}]}

    async def main() -> int:
        child.start()
        plane = ControlPlane(ControlPlaneConfig(dataplane=address, listen="127.0.0.1:0"))
        await plane.start()
        try:
            await _wait_ready(plane, child)
            async with AsyncClient(f"127.0.0.1:{plane.port}") as client:
                async for chunk in client.generate(**prompt, **_sampling_kwargs(args)):
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
            sys.stdout.write("\n")
            return 0
        finally:
            await plane.shutdown(grace=0)
            child.stop()

    return run_event_loop(main())


async def _wait_ready(plane, child) -> None:
    while not plane.engine.ready.is_set():
        if child.process.poll() is not None:
            raise SystemExit(f"the data plane exited with code {child.process.returncode}")
        await asyncio.sleep(0.1)


def cmd_bench(args: argparse.Namespace) -> int:
    from twinplane.clients.bench import run_bench

    return run_bench(args)


def _add_log_level(p: argparse.ArgumentParser, default=None) -> None:
    p.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=default,
                   help="default: INFO for servers, WARNING otherwise")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="twinplane", description=__doc__)
    _add_log_level(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("dataplane", help="run the data plane (model + KV cache)")
    _add_dataplane_args(p)
    p.add_argument("--listen", default=DEFAULT_DATAPLANE, help="address, e.g. 127.0.0.1:50061 or unix:///path")
    p.add_argument("--token", default=None, help="require this token from the control plane "
                                                 "(default: $TWINPLANE_DATAPLANE_TOKEN if set)")
    _add_log_level(p, argparse.SUPPRESS)  # here, or before the command
    p.set_defaults(func=cmd_dataplane)

    p = sub.add_parser("controlplane", help="run the control plane (public API + scheduler)")
    p.add_argument("--dataplane", default=DEFAULT_DATAPLANE, help="data-plane address")
    p.add_argument("--dataplane-token", default=os.environ.get("TWINPLANE_DATAPLANE_TOKEN"))
    _add_controlplane_args(p)
    _add_log_level(p, argparse.SUPPRESS)
    p.set_defaults(func=cmd_controlplane)

    p = sub.add_parser("serve", help="run both planes (the data plane as a child process)")
    _add_dataplane_args(p)
    _add_controlplane_args(p)
    p.add_argument("--dataplane-listen", default=None, help="data-plane address (default: a private unix socket)")
    _add_log_level(p, argparse.SUPPRESS)  # the data plane gets it too
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="stream a completion from a running server")
    p.add_argument("prompt")
    p.add_argument("--server", default=DEFAULT_LISTEN)
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    p.add_argument("--api-key", default=None)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("health", help="check a server's grpc.health.v1 status: exit 0 when SERVING, 1 otherwise")
    p.add_argument("--server", default=DEFAULT_LISTEN, help="either plane's address, e.g. unix:///path")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    p.set_defaults(func=cmd_health)

    p = sub.add_parser("run", help="start both planes on loopback, answer one prompt, stop")
    p.add_argument("prompt")
    p.add_argument("--no-chat", action="store_true", help="send the prompt as plain text, not as a chat message")
    _add_dataplane_args(p)
    _add_sampling_args(p)
    _add_log_level(p, argparse.SUPPRESS)  # the data plane gets it too
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("bench", help="throughput and latency benchmark through the gRPC path")
    _add_dataplane_args(p)
    from twinplane.clients.bench import add_bench_args

    add_bench_args(p)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.log_level is None:
        args.log_level = "INFO" if args.command in ("dataplane", "controlplane", "serve") else "WARNING"
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
