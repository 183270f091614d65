"""The command line: `twinplane run`, `twinplane serve` + `twinplane generate`, and `twinplane health`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import Planes
from tests.reliability import interrupt_mid_stream, stop_process
from twinplane.clients.client import Client

CLI = [sys.executable, "-m", "twinplane.clients.cli"]


def _fresh_tmpdir(tmp_path) -> dict:
    """An environment whose TMPDIR is a new empty folder, tmp_path/tmp."""
    (tmp_path / "tmp").mkdir()
    return {**os.environ, "TMPDIR": str(tmp_path / "tmp")}


def _left_in_tmpdir(tmp_path) -> list[str]:
    """What a run left in its TMPDIR, but torch's own cache folder (one per user, shared by every run)."""
    return sorted(p.name for p in (tmp_path / "tmp").iterdir() if not p.name.startswith("torchinductor_"))


def test_run_answers_with_the_embedded_model(smollm2_dir, tmp_path):
    result = subprocess.run([*CLI, "run", "What is the capital of France?", "--max-tokens", "32"],
                            capture_output=True, text=True, timeout=300, env=_fresh_tmpdir(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Paris" in result.stdout
    # shutting down while a step planned ahead is still in flight must be quiet
    assert "Traceback" not in result.stderr and " ERROR " not in result.stderr, result.stderr[-2000:]
    # nor is waiting for the data plane to load its model worth a warning
    assert " WARNING " not in result.stderr, result.stderr[-2000:]
    assert "twinplane: loading the model (default)" in result.stderr
    assert "twinplane: data plane ready" in result.stderr
    assert _left_in_tmpdir(tmp_path) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_run_stopped_by_a_signal_cleans_up(sig, smollm2_dir, tmp_path):
    """Ctrl-C, kill or a closed terminal while it starts: its data plane stops and its socket folder goes."""
    with subprocess.Popen([*CLI, "run", "What is the capital of France?"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                          env=_fresh_tmpdir(tmp_path)) as run:
        try:
            assert "twinplane: loading the model" in run.stderr.readline()
            run.send_signal(sig)
            _, stderr = run.communicate(timeout=60)
        finally:
            run.kill()
    assert run.returncode == 128 + sig, stderr[-2000:]
    assert "[cancelled]" in stderr and "Traceback" not in stderr, stderr[-2000:]
    assert _left_in_tmpdir(tmp_path) == []
    assert subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True).returncode == 1  # no data plane left


def _generate(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "generate", *args, "--server", address], capture_output=True, text=True,
                          timeout=120)


def test_serve_then_generate_streams_text(smollm2_dir, tmp_path):
    address = f"unix://{tmp_path}/cp.sock"
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen([*CLI, "--log-level", "DEBUG", "serve", "--model", str(smollm2_dir), "--device", "cpu",
                               "--listen", address, "--shutdown-grace", "1"], stdin=subprocess.DEVNULL, stderr=log,
                              env=_fresh_tmpdir(tmp_path))
    try:
        with Client(address) as client:
            client.wait_ready(timeout=180)
        for chat in ("--chat", None):  # a model with a chat template gets chat by default
            result = _generate(address, "What is the capital of France?", "--max-tokens", "32", *filter(None, [chat]))
            assert result.returncode == 0, result.stderr[-2000:]
            assert "Paris" in result.stdout
            assert "prompt" in result.stderr and "completion" in result.stderr
        plain = _generate(address, "The capital of France is", "--no-chat", "--max-tokens", "4")
        assert plain.returncode == 0 and "prompt 5 tokens" in plain.stderr, plain.stderr
        bad = _generate(address, "hi", "--top-p", "5")
        assert bad.returncode == 1 and bad.stderr.startswith("error: INVALID_ARGUMENT: "), bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and "top_p" in bad.stderr
        kwargs = _generate(address, "hi", "--chat-template-kwargs", '{"enable_thinking": false}', "--max-tokens", "2")
        assert kwargs.returncode == 0, kwargs.stderr
        taken = _generate(address, "hi", "--chat-template-kwargs", '{"messages": []}')  # the server sets that one
        assert taken.returncode == 1 and "chat.chat_template_kwargs may not set messages" in taken.stderr
        unordered = _generate(address, "hi", "--priority", "3")  # this server schedules first come, first served
        assert unordered.returncode == 1 and "--scheduling-policy priority" in unordered.stderr
        for args, words in ((["--chat-template-kwargs", "[1]"], "a JSON object is needed"),
                            (["--no-chat", "--chat-template-kwargs", "{}"], "is for chat prompts")):
            refused = _generate(address, "hi", *args)
            assert refused.returncode != 0 and words in refused.stderr, refused.stderr
    finally:
        server.terminate()
        start = time.time()
        assert server.wait(60) == 0
        assert time.time() - start < 30
        log.close()
    stderr = (tmp_path / "serve.log").read_text()
    assert f"twinplane: starting the data plane ({smollm2_dir})" in stderr
    assert f"twinplane: data plane ready; serving on {address}" in stderr
    assert f"control plane listening on {address}, data plane unix://" in stderr  # a socket has no port
    # each process keeps what it holds for good out of the garbage collector's full collections
    for process in ("data plane", "engine core", "frontend 0"):
        assert re.search(rf"{process}: \d+ objects kept since start-up are out of the garbage", stderr), process
    assert _left_in_tmpdir(tmp_path) == []


def test_generate_says_in_one_line_when_it_cannot_reach_the_server(tmp_path):
    result = _generate(f"unix://{tmp_path}/nobody.sock", "hi")
    assert result.returncode == 1
    assert result.stderr.startswith("error: UNAVAILABLE: ") and len(result.stderr.strip().splitlines()) == 1, (
        result.stderr)


def test_a_data_plane_without_torch_says_what_to_install(tmp_path):
    """`pip install .` alone is the control plane: a data plane there says which extra it needs and
    exits as one that refused its configuration (serve then stops instead of restarting it)."""
    code = ("import sys; sys.modules['torch'] = None; from twinplane.clients.cli import main; "
            f"sys.exit(main(['dataplane', '--model', 'dummy:tiny-qwen3', '--listen', 'unix://{tmp_path}/dp.sock']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 78, result.stderr
    assert result.stderr == ("twinplane dataplane: error: the data plane needs torch, which is not installed: "
                             "pip install -e '.[embedded]' (with the embedded model) or '.[dataplane]'\n")


def test_a_data_plane_stopped_while_it_loads_exits_at_once(tmp_path):
    """serve and run stop their data plane by closing its stdin; one still loading its model has
    nothing to finish and exits then, rather than being killed once the stop's timeout runs out."""
    from twinplane.clients.launcher import DataPlaneProcess

    child = DataPlaneProcess(["--model", "dummy:qwen3-0.6b", "--device", "cpu"], restart=False)
    child.start()
    time.sleep(3)  # importing torch, or building the model (Qwen3-0.6B's shapes take longer on a CPU)
    child.stop(timeout=5)
    assert child.process.returncode == 0  # -9: killed when the timeout ran out


def test_a_tensor_parallel_data_plane_that_cannot_listen_exits_with_its_workers(taken_port):
    """Rank 0 fails after its workers started (they ignore signals): it ends them and exits."""
    result = _refused("dataplane", "--model", "dummy:tiny-qwen3", "--device", "cpu", "--tensor-parallel-size", "2",
                      "--listen", f"127.0.0.1:{taken_port}", "--insecure", timeout=120)
    assert f"127.0.0.1:{taken_port}: cannot listen there" in result.stderr and result.returncode == 1


def test_serve_on_port_0_says_the_port_it_serves_on(tmp_path):
    server = subprocess.Popen([*CLI, "serve", "--model", "dummy:tiny-qwen3", "--device", "cpu", "--block-size", "16",
                               "--listen", "127.0.0.1:0"], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    try:
        while "serving on" not in (line := server.stderr.readline()):
            assert line, "serve ended before it said where it serves"
        address = line.split("serving on ")[1].strip()
        host, _, port = address.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0, line
        with Client(address) as client:
            assert client.health_check(10) == "SERVING"
    finally:
        server.terminate()
        server.communicate(timeout=60)


def test_ctrl_c_on_generate_cancels_the_request_and_frees_its_blocks(loopback_planes):
    command = [*CLI, "generate", "--server", loopback_planes.address, "--no-chat", "--max-tokens", "3000",
               "--ignore-eos", "The quick brown fox"]
    returncode, stdout, stderr = interrupt_mid_stream(command, loopback_planes)
    assert returncode == 130, stderr
    assert stderr.decode().strip() == "[cancelled]" and stdout  # no traceback


def test_every_flag_has_a_help_text_and_shows_its_default(monkeypatch):
    import argparse

    from twinplane.clients.cli import build_parser

    for name in ("TWINPLANE_API_KEY", "TWINPLANE_DATAPLANE_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, command in [("twinplane", parser), *commands.items()]:
        text = command.format_help()
        assert "`" not in text and "``" not in text, name
        assert command.description, name
        for action in command._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest}: no help text"
            shown = command._get_formatter()._expand_help(action)  # as --help prints it
            flag = f"{name} {action.option_strings[0] if action.option_strings else action.dest}"
            if action.default is None:  # said in words
                assert action.option_strings == [] or "default" in shown, f"{flag}: default not shown"
            elif not isinstance(action.default, bool) and action.default is not argparse.SUPPRESS:
                assert f"(default: {action.default})" in shown, f"{flag}: default not shown"


def _health(address: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "health", "--server", address], capture_output=True, text=True, timeout=60)


def test_health_exits_0_only_once_the_planes_serve(tiny_qwen3_dir, tmp_path):
    """The order Docker Compose starts them in: the control plane's probe fails until its data plane is up."""
    planes = Planes(tmp_path, tiny_qwen3_dir, ("--block-size", "16", "--max-model-len", "512"), listen="127.0.0.1:0")
    try:
        planes.start_controlplane()
        waiting = _health(planes.address)
        assert waiting.returncode == 1 and f"{planes.address} is NOT_SERVING" in waiting.stderr, waiting.stderr
        planes.start_dataplane()
        planes.wait_ready(120)
        for address in (planes.address, planes.dp_address):
            serving = _health(address)
            assert serving.returncode == 0, serving.stderr
            assert serving.stdout.strip() == "SERVING"
    finally:
        planes.stop()


def test_health_fails_on_a_dead_address(tmp_path):
    for address in (f"unix://{tmp_path}/nobody.sock", "127.0.0.1:1"):
        result = _health(address)
        assert result.returncode == 1
        # one line that says why: the connection was refused, or the socket is not there
        assert result.stderr.startswith("error: UNAVAILABLE: failed to connect"), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_generate_refuses_a_value_its_field_cannot_hold_in_one_line(tmp_path):
    result = _generate(f"unix://{tmp_path}/nobody.sock", "hi", "--no-chat", "--max-tokens", "-1")
    assert result.returncode == 1
    assert result.stderr == "twinplane generate: max_tokens=-1: Value out of range: -1\n"


def test_metrics_flags_reach_the_control_plane_config():
    from twinplane.clients.cli import _controlplane, build_parser

    args = build_parser().parse_args(["controlplane", "--metrics-port", "9400", "--metrics-host", "0.0.0.0"])
    config, _ = _controlplane(args, args.dataplane, None)
    assert (config.metrics_port, config.metrics_host) == (9400, "0.0.0.0")


def test_step_size_and_block_size_default_by_device(monkeypatch):
    """On CPU a step holds at most 512 tokens (a prompt of thousands, in one step, would run for tens of
    seconds, past the control plane's stall and data-plane timeouts) unless the flag says otherwise."""
    from twinplane.clients import cli

    def config(*flags: str, cuda: bool):
        monkeypatch.setattr(cli, "_has_cuda", lambda: cuda)
        return cli._dataplane_config(cli.build_parser().parse_args(["dataplane", "--model", "m", *flags]))

    cpu, gpu = config(cuda=False), config(cuda=True)
    assert (cpu.max_num_batched_tokens, cpu.block_size) == (512, 16)
    assert (gpu.max_num_batched_tokens, gpu.block_size) == (8192, 256)
    assert config("--device", "cpu", cuda=True).max_num_batched_tokens == 512
    assert config("--max-num-seqs", "1024", cuda=False).max_num_batched_tokens == 1024
    assert config("--max-num-batched-tokens", "4096", "--block-size", "32", cuda=False).max_num_batched_tokens == 4096


def test_steps_in_flight_flag_reaches_the_config_and_is_checked():
    import pytest

    from twinplane.clients.cli import _controlplane, build_parser
    from twinplane.controlplane.config import ControlPlaneConfig

    args = build_parser().parse_args(["serve", "--max-steps-in-flight", "3"])
    assert _controlplane(args, "unix:///tmp/dp.sock", None)[0].max_steps_in_flight == 3
    assert ControlPlaneConfig(dataplane="x").max_steps_in_flight == 2
    with pytest.raises(ValueError, match="max_steps_in_flight must be >= 1"):
        ControlPlaneConfig(dataplane="x", max_steps_in_flight=0)


def test_max_message_flag_reaches_the_config_and_is_checked():
    from twinplane.clients.cli import _controlplane, build_parser
    from twinplane.controlplane.config import ControlPlaneConfig

    assert _controlplane(build_parser().parse_args(["serve"]), "unix:///tmp/dp.sock", None)[0].max_message_bytes \
        == 16 << 20
    args = build_parser().parse_args(["serve", "--max-message-mb", "64"])
    assert _controlplane(args, "unix:///tmp/dp.sock", None)[0].max_message_bytes == 64 << 20
    for flag in ("0", "2048"):
        with pytest.raises(SystemExit, match=r"--max-message-mb must be in \[1, 2047\], got " + flag):
            _controlplane(build_parser().parse_args(["serve", "--max-message-mb", flag]), "unix:///tmp/dp.sock", None)
    assert ControlPlaneConfig(dataplane="x", max_message_bytes=1).max_message_bytes == 1


def test_served_model_names_reach_the_config_and_are_checked():
    from twinplane.clients.cli import _controlplane, build_parser
    from twinplane.controlplane.config import ControlPlaneConfig

    args = build_parser().parse_args(["serve", "--served-model-name", "org/model", "model"])
    assert _controlplane(args, "unix:///tmp/dp.sock", None)[0].served_model_names == ("org/model", "model")
    args = build_parser().parse_args(["controlplane", "--dataplane", "unix:///tmp/dp.sock"])
    assert _controlplane(args, args.dataplane, None)[0].served_model_names == ()
    for names in (("a", "a"), ("a", " ")):
        with pytest.raises(ValueError, match="served_model_names must be distinct and not blank"):
            ControlPlaneConfig(dataplane="x", served_model_names=names)


def test_scheduling_policy_reaches_the_config_and_is_checked():
    from twinplane.clients.cli import _controlplane, build_parser
    from twinplane.controlplane.config import ControlPlaneConfig

    args = build_parser().parse_args(["serve", "--scheduling-policy", "priority"])
    assert _controlplane(args, "unix:///tmp/dp.sock", None)[0].scheduling_policy == "priority"
    assert ControlPlaneConfig(dataplane="x").scheduling_policy == "fcfs"
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        ControlPlaneConfig(dataplane="x", scheduling_policy="lifo")


@pytest.mark.parametrize("field, value, choices", [("reasoning_parser", "qwen3", "qwen3, deepseek_r1"),
                                                   ("tool_call_parser", "llama3_json", "hermes, llama3_json")])
def test_output_parsers_reach_the_config_and_are_checked(field, value, choices):
    from twinplane.clients.cli import _controlplane, build_parser
    from twinplane.controlplane.config import ControlPlaneConfig

    flag = "--" + field.replace("_", "-")
    for command in (["serve"], ["controlplane", "--dataplane", "x"]):
        config = _controlplane(build_parser().parse_args([*command, flag, value]), "unix:///tmp/dp.sock", None)[0]
        assert getattr(config, field) == value
        unset = _controlplane(build_parser().parse_args(command), "unix:///tmp/dp.sock", None)[0]
        assert getattr(unset, field) is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", flag, "nope"])
    with pytest.raises(ValueError, match=f"{field} must be one of {choices}"):
        ControlPlaneConfig(dataplane="x", **{field: "nope"})


def test_log_level_on_each_plane_and_passed_on_to_the_data_plane():
    from twinplane.clients.cli import _dataplane_child, build_parser

    assert build_parser().parse_args(["controlplane", "--log-level", "debug"]).log_level == "DEBUG"
    assert build_parser().parse_args(["--log-level", "error", "dataplane"]).log_level == "ERROR"
    assert build_parser().parse_args(["dataplane"]).log_level is None  # main() picks INFO for servers
    for command in (["serve", "--log-level", "warning"], ["run", "hi", "--log-level", "warning"]):
        child = _dataplane_child(build_parser().parse_args(command), "unix:///tmp/dp.sock")
        assert child.command[child.command.index("--log-level") + 1] == "WARNING"


def test_controlplane_exits_with_the_reason_when_its_engine_fails(tiny_qwen3_dir, tmp_path):
    """The tokenizer folder the data plane reports, unreadable here, is found only once the data plane
    answers: the process must say why and exit non-zero (so a supervisor restarts it), not stay
    NOT_SERVING for ever."""
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen3_dir, model)
    planes = Planes(tmp_path, model, ("--block-size", "16", "--max-model-len", "512"))
    try:
        planes.start_dataplane()
        (model / "tokenizer.json").unlink()  # the data plane has loaded the model; the control plane finds none
        result = subprocess.run([*CLI, "controlplane", "--dataplane", planes.dp_address, "--listen", "127.0.0.1:0"],
                                capture_output=True, text=True, timeout=180)
    finally:
        planes.stop()
    assert result.returncode != 0
    assert f"engine stopped: it cannot load the tokenizer: no tokenizer.json in {model}" in result.stderr, (
        result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]  # a file to mend, said in one line


def test_a_tokenizer_file_that_cannot_be_read_is_named_in_one_error(tiny_qwen3_dir, tmp_path):
    from twinplane.controlplane.tokenizer import Tokenizer, TokenizerFilesError

    for name, text in (("tokenizer.json", "{not json"), ("tokenizer_config.json", "[1]")):
        folder = tmp_path / name
        shutil.copytree(tiny_qwen3_dir, folder)
        (folder / name).write_text(text)
        with pytest.raises(TokenizerFilesError, match=re.escape(str(folder / name))):
            Tokenizer(folder)


def test_a_data_plane_that_keeps_failing_is_restarted_with_growing_delays(monkeypatch):
    import asyncio

    from twinplane.clients import launcher

    delays: list[float] = []

    class NoWait(launcher.Backoff):  # records each delay and waits none (patching asyncio.sleep would
        def delay(self, ran_for: float) -> float:  # reach every event loop of the test process)
            delays.append(super().delay(ran_for))
            return 0.0

    monkeypatch.setattr(launcher, "Backoff", NoWait)
    child = launcher.DataPlaneProcess([])
    child.command = [sys.executable, "-c", "raise SystemExit(3)"]  # exits at once, like a bad model path

    async def run() -> None:
        child.start()
        watching = asyncio.create_task(child.watch())
        while child.restarts < 8:
            await asyncio.sleep(0.05)
        child.stop()
        await asyncio.gather(watching, return_exceptions=True)

    asyncio.run(asyncio.wait_for(run(), 60))
    assert delays[:8] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_a_data_plane_that_refuses_its_flags_is_not_restarted():
    import asyncio

    from twinplane.clients import launcher

    child = launcher.DataPlaneProcess([])
    child.command = [sys.executable, "-c", f"raise SystemExit({launcher.CONFIG_ERROR_EXIT})"]

    async def run() -> bool:
        refused = asyncio.Event()
        child.start()
        child.start_watching(refused)
        await asyncio.wait_for(refused.wait(), 30)
        await child._watch  # returned: nothing left to restart
        child.stop()
        return refused.is_set()

    assert asyncio.run(run()) and child.restarts == 0


def test_bench_passes_its_server_flags_on(monkeypatch):
    from twinplane.clients import bench
    from twinplane.clients.cli import build_parser

    started = []
    monkeypatch.setattr(bench.subprocess, "Popen", lambda command, **_: started.append(command))
    args = build_parser().parse_args(["bench", "--stream-interval", "2", "--max-steps-in-flight", "3"])
    _, address, _ = bench._start_server(args)
    command = started[0]
    assert command[command.index("--stream-interval") + 1] == "2"
    assert command[command.index("--max-steps-in-flight") + 1] == "3"
    assert command[command.index("--max-waiting-requests") + 1] == str(args.num_requests + 16)
    assert command[command.index("--api-server-count") + 1] == "1" and "unix://" in address
    _, address, reserved = bench._start_server(build_parser().parse_args(["bench", "--api-server-count", "2"]))
    reserved.close()
    command = started[1]  # several frontends share a loopback TCP port, which a unix socket cannot be
    assert command[command.index("--api-server-count") + 1] == "2"
    assert command[command.index("--listen") + 1] == address and address.startswith("127.0.0.1:")


def test_bench_holds_its_frontends_port_while_its_server_runs(monkeypatch):
    """With several frontends bench picks a loopback TCP port and keeps it bound until its server is
    gone: no other program can bind it meanwhile, the frontends can (SO_REUSEPORT, as they bind it)
    and a client's connection reaches them, not the socket that holds the port."""
    import socket

    from twinplane.clients import bench
    from twinplane.clients.cli import build_parser

    monkeypatch.setattr(bench.subprocess, "Popen", lambda command, **_: None)
    _, address, reserved = bench._start_server(build_parser().parse_args(["bench", "--api-server-count", "2"]))
    port = int(address.rsplit(":", 1)[1])
    with reserved:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        with socket.socket() as frontend:
            frontend.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            frontend.bind(("127.0.0.1", port))
            frontend.listen()
            frontend.settimeout(5)
            with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
                connection, peer = frontend.accept()
                connection.close()
                assert peer == client.getsockname()


def test_serve_refuses_a_data_parallel_size_its_addresses_or_gpus_cannot_serve(monkeypatch):
    from twinplane.clients.cli import _dataplane_children, build_parser

    def children(*argv: str) -> str:
        args = build_parser().parse_args(["serve", *argv])
        with pytest.raises(SystemExit) as info:
            _dataplane_children(args, "token")
        return str(info.value)

    assert children("-dp", "0") == "twinplane serve: --data-parallel-size must be >= 1, got 0"
    with pytest.raises(SystemExit) as info:
        _dataplane_children(build_parser().parse_args(["serve", "-dp", "0"]), "token")
    assert info.value.code == 78  # EX_CONFIG
    assert "gives 1 addresses for --data-parallel-size 2" in children("-dp", "2", "--dataplane-listen", "unix:///a")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert "need 2 GPUs; CUDA_VISIBLE_DEVICES lists 1" in children("-dp", "2", "--device", "cuda")
    from twinplane.clients import cli

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(cli, "_gpu_count", lambda: 1)  # GPUs 0 and 1 would be handed out; 1 is not there
    assert "need 4 GPUs; this host has 1" in children("-dp", "2", "-tp", "2", "--device", "auto")
    monkeypatch.setattr(cli, "_gpu_count", lambda: 0)  # auto without GPUs: each data plane on the CPU
    planned = _dataplane_children(build_parser().parse_args(["serve", "-dp", "2"]), "token")
    for child in planned:
        child.stop()  # none started: their socket folders go
    assert len(planned) == 2


def test_dataplane_refuses_a_tensor_parallel_size_that_does_not_split_the_model(tmp_path):
    """One line that names the model's sizes and the TP sizes that work, before any rank starts."""
    from twinplane.dataplane.loader import check_tensor_parallel, load_hf_config

    hf_config = load_hf_config("dummy:tiny-qwen3")  # 4 query heads, 2 KV heads
    for size in (1, 2, 4):
        check_tensor_parallel(hf_config, size)
    result = subprocess.run([*CLI, "dataplane", "--model", "dummy:tiny-qwen3", "--device", "cpu",
                             "--tensor-parallel-size", "3", "--listen", f"unix://{tmp_path}/dp.sock"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 78  # EX_CONFIG: serve does not restart it
    assert "tensor_parallel_size 3 does not split this model" in result.stderr
    assert "sizes that do: [1, 2, 4]" in result.stderr and "Traceback" not in result.stderr


def test_serve_stops_when_its_data_plane_refuses_its_flags():
    """Not restarted again and again: serve exits at once with the data plane's reason, and with its exit
    code (78, EX_CONFIG: what restarts serve should not either)."""
    result = subprocess.run([*CLI, "serve", "--model", "dummy:tiny-qwen3", "--device", "cpu",
                             "--tensor-parallel-size", "3", "--listen", "127.0.0.1:0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 78, result.stderr[-2000:]
    assert result.stderr.count("tensor_parallel_size 3 does not split this model") == 1, result.stderr[-2000:]
    assert "restarting it in" not in result.stderr
    assert "its data plane refused its configuration" in result.stderr


def _refused(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """A command that must stop at once: non-zero, and no traceback (the callers check its message)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TWINPLANE_API_KEY", "TWINPLANE_DATAPLANE_TOKEN")}
    result = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=timeout, env=env,
                            stdin=subprocess.DEVNULL)
    assert result.returncode != 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    return result


@pytest.fixture
def taken_port():
    """A loopback port another socket holds."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]


@pytest.fixture
def grpc_taken_port():
    """A loopback port a gRPC server holds, bound as gRPC binds by default (SO_REUSEPORT): as an earlier
    data plane or control plane holds its port."""
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(None)


def test_a_server_on_a_port_another_grpc_server_holds_is_refused(grpc_taken_port, tmp_path):
    """Neither plane shares its port by accident: a second data plane (or control plane) on a port in use
    fails to start, instead of taking half of the connections meant for the first."""
    busy = f"127.0.0.1:{grpc_taken_port}"
    result = _refused("dataplane", "--model", "dummy:tiny-qwen3", "--device", "cpu", "--listen", busy, "--insecure",
                      timeout=120)
    assert f"--listen {busy}: cannot listen there" in result.stderr, result.stderr[-2000:]
    result = _refused("controlplane", "--dataplane", f"unix://{tmp_path}/dp.sock", "--listen", busy)
    assert f"--listen {busy}: cannot listen there" in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("argv, env, message", [
    (["serve", "--model", "dummy:tiny-qwen3", "--device", "cpu", "--listen", "unix://{tmp}/s.sock"],
     {"TWINPLANE_DATAPLANE_TOKEN": "tok\n"},
     "the data-plane token (--dataplane-token or TWINPLANE_DATAPLANE_TOKEN) must be printable ASCII"),
    (["run", "--model", "dummy:tiny-qwen3", "--device", "cpu", "hi"], {"TWINPLANE_DATAPLANE_TOKEN": "tok en"},
     "the data-plane token (--dataplane-token or TWINPLANE_DATAPLANE_TOKEN) must be printable ASCII"),
    (["controlplane", "--api-key", "two words", "--listen", "unix://{tmp}/s.sock", "--dataplane", "unix:///x.sock"],
     {}, "the API key (--api-key or TWINPLANE_API_KEY) must be printable"),
    (["dataplane", "--model", "dummy:tiny-qwen3", "--device", "cpu", "--token", "caf\u00e9", "--listen",
      "unix://{tmp}/s.sock"], {}, "the token (--token or TWINPLANE_DATAPLANE_TOKEN) must be printable ASCII"),
])
def test_a_key_or_token_grpc_cannot_carry_is_refused_at_start_up(argv, env, message, tmp_path):
    """gRPC metadata carries printable ASCII only: a token read from a file with its newline was taken and
    then failed every connection (the engine core restarting for ever); it is a one-line refusal now, and
    serve and run leave no socket folder behind."""
    command = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    result = subprocess.run([*CLI, *command], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                            env={**_fresh_tmpdir(tmp_path), **env})
    assert result.returncode == 78 and message in result.stderr, (result.returncode, result.stderr[-2000:])
    assert len(result.stderr.strip().splitlines()) == 1 and "tok" not in result.stderr.replace("token", "")
    assert _left_in_tmpdir(tmp_path) == []


def test_serve_refusing_its_flags_leaves_no_socket_folder(tmp_path):
    result = subprocess.run([*CLI, "serve", "--model", "dummy:tiny-qwen3", "--device", "cpu", "--stream-interval", "0"],
                            capture_output=True, text=True, timeout=120, env=_fresh_tmpdir(tmp_path))
    assert result.returncode == 78 and "stream_interval must be > 0, got 0" in result.stderr, result.stderr
    assert _left_in_tmpdir(tmp_path) == []


def test_controlplane_says_which_address_it_cannot_listen_on(taken_port, tmp_path):
    controlplane = ["controlplane", "--dataplane", f"unix://{tmp_path}/dp.sock"]
    busy = f"127.0.0.1:{taken_port}"
    broken = tmp_path / "broken-tokenizer"  # read at start-up, not once a data plane connects
    broken.mkdir()
    (broken / "tokenizer.json").write_text('{"model": ')
    cases = [
        (["--listen", busy], f"--listen {busy}: cannot listen there"),
        (["--listen", "127.0.0.1:99999"], "--listen must be host:port with a port in [0, 65535]"),
        (["--listen", "127.0.0.1:0", "--http-listen", "foo:bar"], "--http-listen must be host:port or a port"),
        (["--listen", "127.0.0.1:0", "--http-listen", busy], f"--http-listen {busy}: cannot listen there"),
        (["--listen", "127.0.0.1:0", "--metrics-port", str(taken_port)], f"cannot serve metrics on {busy}"),
        (["--listen", "127.0.0.1:0", "--shutdown-grace", "-1"], "shutdown_grace must be >= 0, got -1.0"),
        (["--listen", f"unix://{tmp_path}/dp.sock"], f"listen: unix://{tmp_path}/dp.sock is a data plane's address"),
        (["--listen", "127.0.0.1:0", "--dataplane-timeout", "inf"], "dataplane_timeout must be at most 86400.0"),
        (["--listen", "127.0.0.1:0", "--dataplane", "127.0.0.1:99999"], "--dataplane must be host:port with a port in"),
        (["--listen", "localhost:²"], "--listen must be host:port with a port in [0, 65535]"),
        (["--listen", "127.0.0.1:0", "--max-message-mb", "-1"], "--max-message-mb must be in [1, 2047], got -1"),
        (["--listen", "127.0.0.1:0", "--tokenizer", str(tmp_path)], f"tokenizer: no tokenizer.json in {tmp_path}"),
        (["--listen", "127.0.0.1:0", "--tokenizer", str(broken)], f"{broken / 'tokenizer.json'} cannot be read"),
    ]
    for flags, message in cases:
        result = _refused(*controlplane, *flags)
        assert message in result.stderr, (flags, result.stderr)


def test_a_unix_socket_a_server_listens_on_is_refused_and_one_left_behind_is_taken(tmp_path):
    """gRPC would take over the socket of a server still listening there, which nobody could reach then."""
    import socket
    from concurrent import futures

    import grpc

    from twinplane.controlplane.tls import add_port

    live, stale = tmp_path / "live.sock", tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as holder, socket.socket(socket.AF_UNIX) as gone:
        holder.bind(str(live))
        holder.listen()
        gone.bind(str(stale))  # a socket file whose server has gone: closed below, never listening
        gone.close()
        server = grpc.server(futures.ThreadPoolExecutor(1))
        with pytest.raises(OSError, match=f"--listen unix://{live}: another server listens there already"):
            add_port(server, f"unix://{live}")
        add_port(server, f"unix:{stale}")
        server.start()
        try:
            with grpc.insecure_channel(f"unix:{stale}") as channel:
                grpc.channel_ready_future(channel).result(timeout=10)
        finally:
            server.stop(None)
        result = _refused("dataplane", "--model", "dummy:tiny-qwen3", "--device", "cpu", "--listen", f"unix://{live}",
                          timeout=120)
        assert result.returncode == 1 and "another server listens there already" in result.stderr, result.stderr


def test_unix_addresses_are_read_as_grpc_reads_them():
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.tls import check_target, unix_path

    assert [unix_path(a) for a in ("unix:///tmp/a.sock", "unix://tmp/a.sock", "unix:rel.sock", "unix:/abs.sock")] == [
        "/tmp/a.sock", "/tmp/a.sock", "rel.sock", "/abs.sock"]
    assert check_target("unix:///tmp/a b/dataplane.sock") == "unix:///tmp/a b/dataplane.sock"  # a TMPDIR with a space
    for target in ("unix:", "unix://", "host:99999", "host name:5"):
        with pytest.raises(ValueError, match="must be host:port with a port in"):
            check_target(target)
    assert ControlPlaneConfig(dataplane="unix:///tmp/a b/dp.sock").dataplanes == ("unix:///tmp/a b/dp.sock",)


def test_serve_refuses_a_dataplane_listen_address_without_a_port_or_its_folder():
    from twinplane.clients.cli import _dataplane_children, build_parser

    args = build_parser().parse_args(["serve", "--dataplane-listen", "127.0.0.1:70000"])
    with pytest.raises(SystemExit, match="--dataplane-listen must be host:port with a port in"):
        _dataplane_children(args, "token")
    args = build_parser().parse_args(["serve", "--dataplane-listen", "unix:///nowhere/at/all/dp.sock"])
    with pytest.raises(SystemExit, match="unix:///nowhere/at/all/dp.sock: the folder /nowhere/at/all does not exist"):
        _dataplane_children(args, "token")


def test_a_listen_socket_path_that_cannot_be_bound_is_a_config_error(tmp_path):
    """A unix socket path that is a folder, or in a folder that does not exist, would fail to bind as a busy port
    does (exit 1, restarted) though waiting never frees it: every listening flag refuses it up front."""
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.tls import check_listen

    folder = f"unix://{tmp_path}"
    with pytest.raises(ValueError, match=f"--health-listen {folder}: {tmp_path} is a folder; name a socket file in "
                                         f"it, e.g. unix://{tmp_path}/api.sock"):
        check_listen(folder, "--health-listen")
    with pytest.raises(ValueError, match=f"--listen unix://{tmp_path}/no/api.sock: the folder {tmp_path}/no does not"):
        ControlPlaneConfig(dataplane="unix:///tmp/dp.sock", listen=f"unix://{tmp_path}/no/api.sock")
    assert check_listen(f"unix://{tmp_path}/api.sock") == f"unix://{tmp_path}/api.sock"
    result = _refused("dataplane", "--device", "cpu", "--listen", folder)
    assert result.returncode == 78 and f"{tmp_path} is a folder" in result.stderr, result.stderr


def test_start_up_problems_that_a_restart_would_not_mend_exit_78(tmp_path, tiny_qwen3_dir):
    """serve restarts a data plane that exits 1, so these must not: a cut-off checkpoint, a cache path that is a
    file; and run checks its request before it loads the model, and passes on its data plane's 78."""
    cut = tmp_path / "cut"
    shutil.copytree(tiny_qwen3_dir, cut)
    weights = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    socket_path = f"unix://{tmp_path}/dp.sock"
    result = _refused("dataplane", "--model", str(cut), "--device", "cpu", "--listen", socket_path, timeout=120)
    assert result.returncode == 78 and "model.safetensors is not a whole safetensors file" in result.stderr, (
        result.stderr)
    (tmp_path / "a-file").write_text("")
    result = subprocess.run([*CLI, "dataplane", "--device", "cpu", "--listen", socket_path], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "TWINPLANE_CACHE": str(tmp_path / "a-file")})
    assert result.returncode == 78 and "set TWINPLANE_CACHE (or XDG_CACHE_HOME) to a folder" in result.stderr, (
        result.stderr)
    result = _refused("run", "hi", "--model", "dummy:tiny-qwen3", "--device", "cpu", "--max-tokens", "-1")
    assert result.returncode == 78 and "twinplane run: max_tokens=-1" in result.stderr, result.stderr
    result = _refused("run", "hi", "--model", str(tmp_path / "none"), "--device", "cpu", timeout=120)
    assert result.returncode == 78 and "the data plane exited with code 78" in result.stderr, result.stderr


def test_dataplane_refuses_bad_addresses_and_sizes_in_one_line(taken_port, tmp_path, tiny_qwen3_dir):
    dataplane = ["dataplane", "--model", "dummy:tiny-qwen3", "--device", "cpu"]
    socket_path = f"unix://{tmp_path}/dp.sock"
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    shutil.copy(Path(tiny_qwen3_dir) / "config.json", weightless / "config.json")
    reshaped = {}  # config.json edited after the weights were saved: no model that can be built, or not theirs
    for name, change in (("ungrouped", {"num_key_value_heads": 3}), ("wider", {"hidden_size": 128})):
        reshaped[name] = tmp_path / name
        shutil.copytree(tiny_qwen3_dir, reshaped[name])
        config = json.loads((reshaped[name] / "config.json").read_text())
        (reshaped[name] / "config.json").write_text(json.dumps({**config, **change}))
    misread = tmp_path / "misread"  # a generation default that is no number: refused before the weights load
    shutil.copytree(tiny_qwen3_dir, misread)
    (misread / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "top_k": "20"}))
    cases = [
        ([*dataplane, "--listen", "127.0.0.1:99999", "--insecure"], "--listen must be host:port with a port in"),
        ([*dataplane, "--listen", socket_path, "--health-listen", "nowhere"], "--health-listen must be host:port"),
        ([*dataplane, "--listen", socket_path, "--health-listen", socket_path], f"{socket_path} is --listen too"),
        ([*dataplane, "--listen", "unix:"], "--listen must be host:port with a port in [0, 65535], or unix:///path"),
        ([*dataplane, "--listen", socket_path, "--weights-seed", str(2**64)], "seed (--weights-seed) must be in"),
        ([*dataplane, "--listen", socket_path, "--cpu-kv-cache-gib", "0"], "cpu_kv_cache_gib must be > 0, got 0.0"),
        ([*dataplane, "--listen", socket_path, "--cpu-kv-cache-gib", "nan"], "cpu_kv_cache_gib must be > 0, got nan"),
        (["dataplane", "--model", str(broken), "--device", "cpu", "--listen", socket_path],
         f"model '{broken}': It looks like the config file"),
        (["dataplane", "--model", str(weightless), "--device", "cpu", "--listen", socket_path],
         "holds no *.safetensors files"),
        (["dataplane", "--model", str(reshaped["ungrouped"]), "--device", "cpu", "--listen", socket_path],
         "config.json's num_attention_heads (4) must be a positive multiple of its num_key_value_heads (3)"),
        (["dataplane", "--model", str(reshaped["wider"]), "--device", "cpu", "--listen", socket_path],
         "checkpoint tensor 'model.embed_tokens.weight' (49152, 64) does not fit the model config.json describes"),
        (["dataplane", "--model", str(misread), "--device", "cpu", "--listen", socket_path],
         f"{misread / 'generation_config.json'}: top_k must be a 64-bit integer, got '20'"),
        ([*dataplane, "--listen", socket_path, "--max-num-batched-tokens", str(10**14)],  # past any address space
         "the host has no memory for the data plane's limits (2 staging buffers of"),
        ([*dataplane, "--listen", "127.0.0.1:0"], "127.0.0.1:0 is a TCP address, which needs a token"),
        ([*dataplane, "--listen", "127.0.0.1:0", "--insecure", "--tls-cert", str(tmp_path / "cert.pem")],
         "--tls-cert and --tls-key go together"),
    ]
    for argv, message in cases:  # EX_CONFIG: serve does not restart a data plane that refused its flags
        result = _refused(*argv, timeout=120)
        assert message in result.stderr and result.returncode == 78, (argv, result.returncode, result.stderr)
    # a port that is taken may come free: serve restarts that one (the model loads before it listens: 120 s, as above)
    result = _refused(*dataplane, "--listen", f"127.0.0.1:{taken_port}", "--insecure", timeout=120)
    assert f"--listen 127.0.0.1:{taken_port}: cannot listen there" in result.stderr and result.returncode == 1
    # a KV cache larger than the host's memory is refused once the model is loaded, not allocated
    for flags, asked in ((["--num-kv-blocks", str(10**13)], f"num_kv_blocks={10**13}"),
                         (["--cpu-kv-cache-gib", "1e9"], "cpu_kv_cache_gib=1000000000.0")):
        result = _refused(*dataplane, "--listen", socket_path, *flags, timeout=120)
        assert result.returncode == 78, result.stderr[-2000:]  # EX_CONFIG: serve does not restart it
        assert re.search(asked + r" asks for \d+ KV blocks, [\d.]+ GiB at \d+ bytes a block; the host has "
                         r"[\d.]+ GiB free after the weights: at most \d+ blocks fit", result.stderr), result.stderr


def test_bench_refuses_a_workload_it_cannot_draw_and_a_server_that_is_not_there(tmp_path):
    for flags, message in [(["--min-input", "500", "--max-input", "10"], "--min-input and --max-input must be"),
                           (["--request-rate", "0"], "--request-rate must be > 0"),
                           (["--num-requests", "0"], "--num-requests must be >= 1, got 0")]:
        result = _refused("bench", "--server", f"unix://{tmp_path}/nobody.sock", *flags)
        assert message in result.stderr, (flags, result.stderr)
    result = _refused("bench", "--server", f"unix://{tmp_path}/nobody.sock", "--ready-timeout", "1")
    assert "server not ready before the timeout" in result.stderr, result.stderr
    for flags, message in [(["--ready-timeout", "inf"], "--ready-timeout must be in (0, 86400] seconds, got inf"),
                           (["--seed", "-1"], "--seed must be >= 0, got -1"),
                           (["--peak-bandwidth-gbs", "0"], "--peak-bandwidth-gbs and --peak-tflops must be > 0"),
                           (["--save-result", str(tmp_path / "no" / "r.json")], "r.json: its folder does not exist")]:
        result = _refused("bench", "--server", f"unix://{tmp_path}/nobody.sock", *flags)
        assert message in result.stderr, (flags, result.stderr)
    for timeout in ("-1", "inf", "1e300"):  # gRPC would take a deadline that far off as one already passed
        result = _refused("health", "--server", f"unix://{tmp_path}/nobody.sock", "--timeout", timeout)
        assert f"--timeout must be in (0, 86400] seconds, got {float(timeout)}" in result.stderr, result.stderr


def test_generate_refuses_an_api_key_that_cannot_travel_in_metadata(tmp_path):
    result = subprocess.run([*CLI, "generate", "hi", "--server", f"unix://{tmp_path}/nobody.sock"],
                            capture_output=True, text=True, timeout=60, env={**os.environ, "TWINPLANE_API_KEY": "k\n"})
    assert result.returncode == 1 and "the API key (--api-key or TWINPLANE_API_KEY) must be printable ASCII" in (
        result.stderr), result.stderr


def test_bench_stops_when_the_server_it_started_refuses_its_flags():
    started = time.monotonic()
    result = _refused("bench", "--model", "dummy:tiny-qwen3", "--device", "cpu", "--max-num-seqs", "0",
                      "--ready-timeout", "600", timeout=300)
    assert result.returncode == 78 and "the server it started exited with code 78" in result.stderr, result.stderr
    assert time.monotonic() - started < 300  # not the ready timeout


def test_bench_exits_1_when_a_request_does_not_complete(planes_factory, tiny_qwen3_dir):
    planes = planes_factory(tiny_qwen3_dir, "--block-size", "16")
    result = _refused("bench", "--server", planes.address, "--num-requests", "2", "--min-input", "3", "--max-input",
                      "3", "--min-output", "2", "--max-output", "2", "--vocab-limit", "1000000", timeout=120)
    assert result.returncode == 1 and "2 of 2 requests did not complete" in result.stderr, result.stderr


def test_chat_template_takes_a_file_or_the_template_and_must_compile(tmp_path):
    from twinplane.clients.cli import _controlplane, build_parser

    def config(*flags: str):
        return _controlplane(build_parser().parse_args(["serve", *flags]), "unix:///tmp/dp.sock", None)[0]

    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    (tmp_path / "chat.jinja").write_text(template)
    assert config("--chat-template", str(tmp_path / "chat.jinja")).chat_template == template
    assert config("--chat-template", template).chat_template == template
    assert config().chat_template is None
    with pytest.raises(SystemExit, match="'nope.jinja' is no file, nor a template"):
        config("--chat-template", "nope.jinja")
    with pytest.raises(SystemExit, match="chat_template does not compile"):
        config("--chat-template", "{% for m in messages %}")
    (tmp_path / "latin1.jinja").write_bytes("{{ m.role }}: caf\xe9".encode("latin-1"))  # a file, but no UTF-8
    with pytest.raises(SystemExit, match=re.escape(f"chat_template: '{tmp_path}/latin1.jinja' cannot be read as "
                                                   "UTF-8 text: 'utf-8' codec can't decode byte 0xe9")):
        config("--chat-template", str(tmp_path / "latin1.jinja"))


def test_a_data_plane_on_port_0_says_the_ports_it_got():
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.reliability import ProcessLog

    process = subprocess.Popen([*CLI, "dataplane", "--model", "dummy:tiny-qwen3", "--device", "cpu", "--listen",
                                "127.0.0.1:0", "--insecure", "--health-listen", "127.0.0.1:0"],
                               stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    log = ProcessLog(process)
    try:
        ready = log.wait_for(r"ready on 127\.0\.0\.1:(\d+), health on 127\.0\.0\.1:(\d+):", 120)
        port, health_port = int(ready.group(1)), int(ready.group(2))
        assert 0 < port != health_port > 0
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass  # it listens there
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:  # and its health there
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        stop_process(process)


def test_generate_says_why_chat_template_kwargs_do_not_apply(planes_factory, tiny_qwen3_dir, tmp_path):
    model = tmp_path / "no-template"
    shutil.copytree(tiny_qwen3_dir, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    planes = planes_factory(model, "--block-size", "16")
    for flags, why in [([], "this model has no chat template"), (["--no-chat"], "leave out --no-chat")]:
        result = _refused("generate", "hi", "--server", planes.address, "--chat-template-kwargs", '{"a": 1}', *flags)
        assert f"--chat-template-kwargs is for chat prompts; {why}" in result.stderr, result.stderr


def test_client_commands_refuse_a_server_address_grpc_would_take_for_another(monkeypatch):
    """gRPC takes port 99999 as 34463 (modulo 65536), where another server may answer, and fails on an
    empty target in several lines: generate, health and bench refuse both before they connect."""
    from twinplane.clients import bench, cli

    monkeypatch.setattr(bench, "_start_server", lambda args: pytest.fail("bench took --server '' for none"))
    for argv in (["health", "--server", "127.0.0.1:99999", "--timeout", "0.5"], ["health", "--server", ""],
                 ["generate", "hi", "--server", "127.0.0.1:99999"],
                 ["bench", "--server", "127.0.0.1:65536", "--ready-timeout", "1"], ["bench", "--server", ""]):
        args = cli.build_parser().parse_args(argv)
        with pytest.raises(SystemExit, match=f"twinplane {argv[0]}: --server must be host:port with a port in "
                                             r"\[0, 65535\], or unix:///path; got '"):
            args.func(args)


def test_data_plane_flags_reach_a_child_as_given_even_when_they_start_with_a_dash():
    """serve, run and bench hand their data-plane flags on to a child's command line, where a value that
    starts with '-' must not be read as a flag: the child would exit 2, and serve restart it for ever."""
    import math

    from twinplane.clients.cli import _dataplane_child, build_parser

    args = build_parser().parse_args(["--log-level", "info", "serve", "--model=-m", "--cpu-kv-cache-gib=-1e300",
                                      "--gpu-memory-utilization=-inf"])
    child = _dataplane_child(args, "unix:///tmp/dp.sock")
    passed = build_parser().parse_args(child.command[child.command.index("--log-level"):])
    assert (passed.model, passed.cpu_kv_cache_gib, passed.gpu_memory_utilization, passed.listen) == (
        "-m", -1e300, -math.inf, "unix:///tmp/dp.sock")


def test_run_and_bench_refuse_sampling_values_before_a_model_loads(monkeypatch):
    """The server would refuse them, but only once run's or bench's model had loaded (minutes, for a
    large one), and bench would report every request as failed."""
    from twinplane.clients import bench, cli
    from twinplane.controlplane.ipc import CONFIG_ERROR_EXIT, ConfigExit

    monkeypatch.setattr(cli, "_dataplane_child", lambda *a, **k: pytest.fail("run started a data plane"))
    for flags, message in [(["--temperature", "-1"], "temperature must be a finite number >= 0"),
                           (["--top-p", "2"], r"top_p must be in \(0.0, 1.0\], got 2"),
                           (["--top-k", "-5"], r"top_k must be in \[-1, 2147483647\]"),
                           (["--max-tokens", "0"], "max_tokens must be >= 1, got 0")]:
        args = cli.build_parser().parse_args(["run", "hi", "--model", "dummy:tiny-qwen3", *flags])
        with pytest.raises(ConfigExit, match=f"twinplane run: {message}") as refused:
            cli.cmd_run(args)
        assert refused.value.code == CONFIG_ERROR_EXIT
    for value in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit, match="twinplane bench: --temperature must be a finite number >= 0"):
            bench._check_workload(cli.build_parser().parse_args(["bench", "--temperature", value]))
