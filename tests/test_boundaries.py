"""Architecture rules: the control plane never imports torch; the stubs match proto/."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_control_plane_imports_no_torch():
    code = ("import sys\n"
            "import twinplane.controlplane.main, twinplane.controlplane.engine, twinplane.controlplane.server\n"
            "import twinplane.clients.client, twinplane.clients.launcher\n"
            "bad = [m for m in ('torch', 'transformers', 'triton') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="needs grpcio-tools")
def test_generated_stubs_match_the_proto_files():
    result = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_proto_field_has_a_comment():
    for proto in (ROOT / "proto").glob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith(("option", "syntax"))
            if is_field:
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} has no comment: {stripped}"
