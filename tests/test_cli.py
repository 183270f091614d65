"""The command line: `twinplane run`, and `twinplane serve` + `twinplane generate`."""

from __future__ import annotations

import subprocess
import sys
import time

from twinplane.clients.client import Client

CLI = [sys.executable, "-m", "twinplane.clients.cli"]


def test_run_answers_with_the_embedded_model(smollm2_dir):
    result = subprocess.run([*CLI, "run", "What is the capital of France?", "--max-tokens", "32"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Paris" in result.stdout


def test_serve_then_generate_streams_text(smollm2_dir, tmp_path):
    address = f"unix://{tmp_path}/cp.sock"
    server = subprocess.Popen([*CLI, "serve", "--model", str(smollm2_dir), "--device", "cpu", "--listen", address,
                               "--shutdown-grace", "1"], stdin=subprocess.DEVNULL)
    try:
        with Client(address) as client:
            client.wait_ready(timeout=180)
        result = subprocess.run([*CLI, "generate", "What is the capital of France?", "--chat", "--server", address,
                                 "--max-tokens", "32"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "Paris" in result.stdout
        assert "prompt" in result.stderr and "completion" in result.stderr
    finally:
        server.terminate()
        start = time.time()
        assert server.wait(60) == 0
        assert time.time() - start < 30


def test_metrics_flags_reach_the_control_plane_config():
    from twinplane.clients.cli import _controlplane, build_parser

    args = build_parser().parse_args(["controlplane", "--metrics-port", "9400", "--metrics-host", "0.0.0.0"])
    config, _ = _controlplane(args, args.dataplane, None)
    assert (config.metrics_port, config.metrics_host) == (9400, "0.0.0.0")


def test_log_level_on_each_plane_and_passed_on_to_the_data_plane():
    from twinplane.clients.cli import _dataplane_child, build_parser

    assert build_parser().parse_args(["controlplane", "--log-level", "debug"]).log_level == "DEBUG"
    assert build_parser().parse_args(["--log-level", "error", "dataplane"]).log_level == "ERROR"
    assert build_parser().parse_args(["dataplane"]).log_level is None  # main() picks INFO for servers
    for command in (["serve", "--log-level", "warning"], ["run", "hi", "--log-level", "warning"]):
        child = _dataplane_child(build_parser().parse_args(command), "unix:///tmp/dp.sock")
        assert child.command[child.command.index("--log-level") + 1] == "WARNING"
