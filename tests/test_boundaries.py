"""Architecture rules: the control plane never imports torch and needs only the core dependencies;
the stubs match proto/."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
IMPORTED_WHEN_INSTALLED = {"grpc_tools",  # grpc's extension shims import it if it is there (dev extra)
                           "sniffio"}  # so does anyio (under starlette) when the dev extra's httpx brought it


def test_control_plane_imports_no_torch():
    code = ("import sys\n"
            "import twinplane.controlplane.main, twinplane.controlplane.engine, twinplane.controlplane.server\n"
            "import twinplane.controlplane.openai_http\n"
            "import twinplane.clients.client, twinplane.clients.launcher\n"
            "bad = [m for m in ('torch', 'transformers', 'triton') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def core_dependencies() -> list[Requirement]:
    """pyproject's [project] dependencies: all that `pip install .` (the control-plane image) brings."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(line) for line in project["dependencies"]]


def _installed_closure(requirements: list[Requirement]) -> set[str]:
    """The distributions these requirements bring in, following the installed ones' own requirements."""
    todo, seen = list(requirements), set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += [Requirement(line) for line in importlib.metadata.requires(name) or []]
        except importlib.metadata.PackageNotFoundError:
            pass
    return seen


def test_core_dependencies_cover_what_the_control_plane_imports():
    code = ("import sys\n"
            "before = set(sys.modules)\n"
            "import twinplane.controlplane.main, twinplane.clients.cli, twinplane.clients.client\n"
            "import twinplane.clients.bench\n"
            "import twinplane.controlplane.openai_http\n"
            "print(' '.join({m.partition('.')[0] for m in set(sys.modules) - before}))\n")
    modules = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    provided = _installed_closure(core_dependencies()) | {"twinplane"}
    owners = importlib.metadata.packages_distributions()
    missing = {m: owners[m] for m in set(modules) - IMPORTED_WHEN_INSTALLED
               if m in owners and not any(canonicalize_name(d) in provided for d in owners[m])}
    assert not missing, f"imported by the control plane but not brought by its dependencies: {missing}"


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
