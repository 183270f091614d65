"""Shared fixtures: real models on disk and both planes running over loopback gRPC.

Every server binds a unix socket in a private temporary folder (or 127.0.0.1),
never anything else.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.reliability import DRAIN_ARGS, DRAIN_SHAPE, stop_process
from twinplane.clients.client import Client
from twinplane.controlplane.config import ControlPlaneConfig
from twinplane.controlplane.main import ControlPlane, Security

NODE_CLIENT = Path(__file__).resolve().parents[1] / "clients" / "node"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=49152, max_position_embeddings=4096,
                  initializer_range=0.1, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded default model, converted once per cache folder."""
    from twinplane.dataplane.embedded import DEFAULT_MODEL, resolve_model

    return Path(resolve_model(DEFAULT_MODEL))


def make_tiny_model(arch: str, folder: Path, tokenizer_dir: Path) -> Path:
    """A random-weight transformers model with a real config, saved as a Hugging Face folder."""
    import torch
    import transformers

    torch.manual_seed({"qwen3": 1, "llama": 2}[arch])
    if arch == "qwen3":
        config = transformers.Qwen3Config(**TINY_SHAPE, rope_theta=1e6, tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**TINY_SHAPE, rope_theta=1e5, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2]}))
    return folder


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("tiny-qwen3"), smollm2_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


class Planes:
    """A data-plane process plus a control plane on its own event-loop thread in this process."""

    def __init__(self, folder: Path, model: str, dataplane_args: tuple[str, ...] = (), *,
                 security: Security = Security(), dp_program: tuple[str, ...] = ("-m", "twinplane.clients.cli"),
                 dp_address: str | None = None, **config):
        self.folder = folder
        self.dp_address = dp_address or f"unix://{folder}/dp.sock"
        self.address = config.pop("listen", f"unix://{folder}/cp.sock")
        # dp_program: what runs the data plane (a test script may stand in for the CLI)
        self.dp_command = [sys.executable, *dp_program, "dataplane", "--model", str(model),
                           "--device", "cpu", "--listen", self.dp_address, *dataplane_args]
        self.config = ControlPlaneConfig(dataplane=self.dp_address, listen=self.address, **config)
        self.security = security
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.dataplane: subprocess.Popen | None = None
        self.plane: ControlPlane | None = None

    def start_dataplane(self) -> None:
        self.dataplane = subprocess.Popen(self.dp_command, stdin=subprocess.DEVNULL)

    def start(self, timeout: float = 120.0) -> Planes:
        self.start_dataplane()
        self.start_controlplane()
        self.wait_ready(timeout)
        return self

    def start_controlplane(self) -> None:
        """Starts the control plane on its thread; it connects to the data plane when one answers."""
        self.thread.start()

        async def start() -> ControlPlane:
            plane = ControlPlane(self.config, self.security)
            await plane.start()
            return plane

        self.plane = self.call(start())
        if self.address.endswith(":0"):  # a TCP port chosen by the OS
            self.address = self.address.removesuffix(":0") + f":{self.plane.port}"

    def wait_ready(self, timeout: float = 120.0) -> None:
        self.call(self.plane.wait_ready(timeout), timeout + 5)

    def call(self, coro, timeout: float | None = 60.0):
        """Runs a coroutine on the control plane's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def engine(self):
        return self.plane.engine

    def client(self, **kwargs) -> Client:
        return Client(self.address, **kwargs)

    def free_blocks(self) -> tuple[int, int]:
        """Free and total KV blocks, as the engine core last reported them."""
        async def read() -> tuple[int, int]:
            core = self.engine.core_snapshot
            return core.free_kv_blocks, core.num_kv_blocks
        return self.call(read())

    def stop(self) -> None:
        """Stops both planes (again: nothing more)."""
        if self.plane is not None and self.thread.is_alive():
            self.call(self.plane.shutdown(grace=0))
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        if self.dataplane is not None:
            stop_process(self.dataplane)


@pytest.fixture
def planes_factory(tmp_path_factory):
    """Starts Planes on demand; stops them all after the test."""
    started: list[Planes] = []

    def make(model, *dataplane_args: str, start_timeout: float = 120.0, **config) -> Planes:
        """config: ControlPlaneConfig fields, plus Planes' security and dp_program; start_timeout: seconds
        both planes get to be ready."""
        planes = Planes(tmp_path_factory.mktemp("planes"), model, tuple(dataplane_args), **config)
        started.append(planes)
        return planes.start(start_timeout)

    yield make
    for planes in started:
        planes.stop()


@pytest.fixture(scope="session")
def shared_planes(tiny_qwen3_dir, tmp_path_factory):
    """Tiny Qwen3 through both planes (max_model_len 512, 1 MiB messages), shared by the reliability
    tests that leave it as they found it: nothing in flight, every KV block free."""
    planes = Planes(tmp_path_factory.mktemp("shared"), tiny_qwen3_dir,
                    ("--block-size", "16", "--max-model-len", "512"), max_message_bytes=1 << 20).start()
    yield planes
    planes.stop()


@pytest.fixture(scope="session")
def loopback_planes(tiny_qwen3_dir, tmp_path_factory):
    """Tiny Qwen3 through both planes, the public API on 127.0.0.1 (a free port): for clients that
    reach the server as any gRPC client would (other languages, reflection)."""
    planes = Planes(tmp_path_factory.mktemp("loopback"), tiny_qwen3_dir, ("--block-size", "16"),
                    listen="127.0.0.1:0").start()
    yield planes
    planes.stop()


@pytest.fixture(scope="session")
def drain_planes(smollm2_dir, tmp_path_factory):
    """The drain tests' model (tests/reliability.py) through both planes, the public API on 127.0.0.1, the
    embedded model's tokenizer. Each token reads all of its weights, so a stream of thousands of tokens outlasts
    a timeout of a few seconds on any machine (a tiny model's take a few seconds here, less on a faster one)."""
    planes = Planes(tmp_path_factory.mktemp("drain"), DRAIN_SHAPE, DRAIN_ARGS, listen="127.0.0.1:0",
                    tokenizer=str(smollm2_dir)).start()
    yield planes
    planes.stop()


@pytest.fixture(scope="session")  # session: checked before the planes start
def node() -> str:
    """The node executable, once the client's packages are installed."""
    node = shutil.which("node")
    missing = [what for what, there in (("node", node),
                                        ("clients/node/node_modules (npm ci --prefix clients/node)",
                                         (NODE_CLIENT / "node_modules" / "@grpc" / "grpc-js").is_dir()))
               if not there]
    if missing:
        reason = f"the Node.js client needs {' and '.join(missing)}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return node
