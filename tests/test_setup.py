"""setup.sh and the README's first screen: the options, the CUDA check and which torch build
each route installs, without installing anything. setup.sh runs in a copy of the files it
reads, with a stand-in .venv/bin/python: `-m pip` only records its arguments, and `import
torch` finds a stand-in whose build (CPU or CUDA) each test chooses."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

CPU_COMMAND = "bash setup.sh && .venv/bin/finetune train configs/quickstart/sft.yaml"
TEST_COMMAND = "bash setup.sh && .venv/bin/python -m pytest"
CUDA_COMMAND = ("bash setup.sh --cuda && .venv/bin/finetune train configs/quickstart/sft.yaml"
                " distributed.device=cuda")
SEP = "\x1f"  # between the arguments of one recorded pip call

# .venv/bin/python: `-m pip ...` is recorded in $FAKE_LOG and acted out on $FAKE_STATE (a
# folder with a file per package installed: torch, torchvision); anything else runs the
# real Python with the stand-in torch first on the path.
FAKE_PYTHON = r"""#!/usr/bin/env bash
if [ "$1" = -m ] && [ "$2" = pip ]; then
  shift 2
  (IFS=$'\x1f'; printf '%s\n' "$*") >> "$FAKE_LOG"
  case "$1" in
    show) [ -e "$FAKE_STATE/${!#}" ]; exit ;;
    uninstall) shift; for name in "$@"; do rm -f "$FAKE_STATE/$name"; done; exit 0 ;;
    config) echo "global.find-links='/opt/wheels'"; exit 0 ;;
  esac
  report=
  while [ $# -gt 0 ]; do
    case "$1" in
      --help) echo "  --report <file>"; exit 0 ;;
      --report) report=$2; shift ;;
      torchvision==*) mkdir -p "$FAKE_STATE"; touch "$FAKE_STATE/torchvision" ;;
      torch==*) mkdir -p "$FAKE_STATE"; touch "$FAKE_STATE/torch"
        [ -z "$report" ] || printf '{"install": [{"metadata": {"name": "torch"},
          "download_info": {"url": "file:///wheels/torch-2.13.0+cpu.whl"}}]}' > "$report" ;;
    esac
    shift
  done
  exit 0
fi
PYTHONPATH="$FAKE_SITE" exec "$REAL_PYTHON" "$@"
"""
FAKE_TORCH = """import os
__version__ = os.environ["FAKE_TORCH_VERSION"]
class version:
    cuda = os.environ.get("FAKE_TORCH_CUDA") or None
"""


@pytest.fixture
def tree(tmp_path):
    """A copy of what setup.sh reads, with the stand-in .venv/bin/python."""
    root = tmp_path / "tree"
    for name in ("setup.sh", "pyproject.toml", "constraints.txt", "finetune/__init__.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, root / name)
    python = root / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    (tmp_path / "site" / "torch").mkdir(parents=True)
    (tmp_path / "site" / "torch" / "__init__.py").write_text(FAKE_TORCH)
    return root


def setup_sh(root: Path, *args: str, cuda_build: bool = False, path: str | None = None,
             **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    environ.update(
        FAKE_LOG=str(root.parent / "pip.log"), FAKE_STATE=str(root.parent / "installed"),
        FAKE_SITE=str(root.parent / "site"), REAL_PYTHON=sys.executable,
        FAKE_TORCH_VERSION="2.13.0" if cuda_build else "2.13.0+cpu",
        FAKE_TORCH_CUDA="13.0" if cuda_build else "", **env)
    if path is not None:
        environ["PATH"] = path + os.pathsep + environ["PATH"]
    return subprocess.run(["bash", str(root / "setup.sh"), *args], env=environ,
                          capture_output=True, text=True, timeout=60)


def pip_calls(root: Path) -> list[list[str]]:
    """The pip calls since the last look (the log is emptied)."""
    log = root.parent / "pip.log"
    if not log.exists():
        return []
    calls = [line.split(SEP) for line in log.read_text().splitlines()]
    log.unlink()
    return [call for call in calls if call[:2] != ["install", "--help"]]


def installs(calls: list[list[str]]) -> list[str]:
    """What each `pip install` installed: torch (and torchvision) or the editable extras."""
    return [" ".join(a for a in call if re.match(r"torch(vision)?==|\.\[", a))
            for call in calls if call[0] == "install"]


TORCH_AND_VISION = "torch==2.13.0 torchvision==0.28.0"  # its release for that torch


@pytest.mark.parametrize("args", [["--bogus"], ["--help"], ["-h"], ["--torch-index"],
                                  ["--torch-index", "--cuda"], ["--cuda", "extra"]])
def test_usage_exits_2_and_installs_nothing(tmp_path, args):
    shutil.copy(REPO / "setup.sh", tmp_path / "setup.sh")
    result = subprocess.run(["bash", str(tmp_path / "setup.sh"), *args], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2
    usage = result.stdout + result.stderr
    assert usage.count("usage: bash setup.sh [--cuda] [--torch-index URL] [--latest]") == 1
    for option in ("--cuda", "--torch-index URL", "--latest"):
        assert re.search(rf"^  {re.escape(option)} ", usage, re.M), option
    assert [p.name for p in tmp_path.iterdir()] == ["setup.sh"]


def test_cpu_route_is_the_one_ci_runs(tree):
    result = setup_sh(tree)
    assert result.returncode == 0, result.stderr
    calls = pip_calls(tree)
    # no torchvision: PyPI's, built for PyPI's torch, does not import beside a local one
    assert installs(calls) == ["torch==2.13.0", ".[test]"]
    for call in calls:  # both at the tested versions, torch as the machine's pip offers it
        assert call[call.index("-c") + 1] == "constraints.txt"
        assert "--index-url" not in call and "--report" not in call
    assert setup_sh(tree).returncode == 0 and pip_calls(tree) == []  # idempotent


def test_latest_route_upgrades_all_but_torch(tree):
    shutil.copytree(tree / ".venv", tree / ".venv-latest")
    assert setup_sh(tree, "--latest").returncode == 0
    calls = pip_calls(tree)
    assert installs(calls) == ["torch==2.13.0", ".[test]"]
    for call in calls:
        assert call[call.index("-c") + 1] == ".venv-latest/torch.txt"
        assert call[call.index("--upgrade") + 1:][:2] == ["--upgrade-strategy", "eager"]
    assert (tree / ".venv-latest" / "torch.txt").read_text().split() == TORCH_AND_VISION.split()
    assert not (tree / ".venv" / ".finetune-install").exists()


def test_cuda_route_checks_the_build_then_installs_the_gpu_extra(tree):
    result = setup_sh(tree, "--cuda", cuda_build=True)
    assert result.returncode == 0, result.stderr
    assert installs(pip_calls(tree)) == [TORCH_AND_VISION, ".[test,gpu,vlm]"]
    assert "torch 2.13.0 (CUDA 13.0)" in result.stdout
    assert setup_sh(tree, "--cuda", cuda_build=True).returncode == 0
    assert pip_calls(tree) == []
    # Back to the CPU route: pip would keep the CUDA torch (2.13.0 satisfies torch==2.13.0),
    # so it is uninstalled first, with the torchvision built for it; and the other way again.
    assert setup_sh(tree).returncode == 0
    calls = pip_calls(tree)
    assert [c[0] for c in calls] == ["show", "show", "uninstall", "install", "install"]
    assert calls[2][-2:] == ["torch", "torchvision"]
    assert not (tree.parent / "installed" / "torchvision").exists()
    assert setup_sh(tree, "--cuda", cuda_build=True).returncode == 0
    calls = pip_calls(tree)
    assert [c[0] for c in calls] == ["show", "show", "uninstall", "install", "install"]
    assert calls[2][-1] == "torch"  # no torchvision was there
    assert installs(calls) == [TORCH_AND_VISION, ".[test,gpu,vlm]"]


def test_cuda_route_stops_on_a_cpu_build_and_says_how_to_fix_it(tree):
    result = setup_sh(tree, "--cuda", PIP_FIND_LINKS="/opt/wheels")
    assert result.returncode == 1
    assert installs(pip_calls(tree)) == [TORCH_AND_VISION]  # finetune is not installed
    message = result.stderr
    assert "installed torch 2.13.0+cpu, a build without CUDA" in message
    assert "pip took it from: file:///wheels/torch-2.13.0+cpu.whl" in message
    assert "global.find-links='/opt/wheels'" in message
    lines = [line.strip() for line in message.splitlines()]
    assert "env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null bash setup.sh --cuda" in lines
    assert ("bash setup.sh --cuda --torch-index https://download.pytorch.org/whl/cu126"
            in lines)
    assert not (tree / ".venv" / ".finetune-install").exists()
    # The next try replaces that torch and its torchvision, though the stamp says nothing
    # about them.
    result = setup_sh(tree, "--cuda", cuda_build=True)
    assert result.returncode == 0, result.stderr
    calls = pip_calls(tree)
    assert [c[0] for c in calls] == ["show", "show", "uninstall", "install", "install"]
    assert calls[2][-2:] == ["torch", "torchvision"]


def test_torch_index_is_passed_to_the_torch_step_as_one_argument(tree):
    index = "file:///wheel house/cu126; echo $HOME"  # quoted all the way to pip
    assert setup_sh(tree, "--cuda", "--torch-index", index, cuda_build=True).returncode == 0
    torch_step, finetune_step = [c for c in pip_calls(tree) if c[0] == "install"]
    assert torch_step[torch_step.index("--index-url") + 1] == index
    assert torch_step[-2:] == TORCH_AND_VISION.split()  # both from the index
    assert "constraints.txt" not in torch_step  # the index has its own copies of the deps
    assert finetune_step[finetune_step.index("-c") + 1] == "constraints.txt"
    assert "--index-url" not in finetune_step
    # A CPU build from it: the commands that fix it keep the index, quoted.
    result = setup_sh(tree, "--cuda", f"--torch-index={index}/")
    assert result.returncode == 1
    assert f"The index {index}/ serves no CUDA build of torch==2.13.0" in result.stderr
    [again] = [line for line in result.stderr.splitlines() if "PIP_CONFIG_FILE" in line]
    assert shlex.split(again)[-5:] == [
        "bash", "setup.sh", "--cuda", "--torch-index", f"{index}/"]
    pip_calls(tree)
    # Another index for the same build reinstalls torch.
    assert setup_sh(tree, "--cuda", f"--torch-index={index}x", cuda_build=True).returncode == 0
    assert [c[0] for c in pip_calls(tree)] == ["show", "show", "uninstall", "install", "install"]
    # Without --cuda (PyTorch's CPU index): torchvision with torch, no gpu extra, and the
    # vlm extra, as with torchvision on every route
    assert setup_sh(tree, f"--torch-index={index}").returncode == 0
    assert installs(pip_calls(tree)) == [TORCH_AND_VISION, ".[test,vlm]"]


@pytest.mark.parametrize("system,machine", [("Darwin", "arm64"), ("Linux", "ppc64le")])
def test_cuda_route_refuses_platforms_without_cuda_builds(tree, tmp_path, system, machine):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    uname = bin_dir / "uname"
    uname.write_text(f'#!/bin/sh\n[ "$1" = -s ] && echo {system} || echo {machine}\n')
    uname.chmod(0o755)
    result = setup_sh(tree, "--cuda", path=str(bin_dir))
    assert result.returncode == 1
    assert f"this machine is {system} {machine}" in result.stderr
    assert "Use: bash setup.sh" in result.stderr
    assert pip_calls(tree) == []


def test_readme_first_screen_names_both_install_commands():
    readme = (REPO / "README.md").read_text()
    first_screen = readme[:readme.index("\n## ")]
    # The two commands open the README, unchanged (CI runs the second: .ci/run).
    assert readme.startswith(f"# finetune\n\n```bash\n{CPU_COMMAND}\n{TEST_COMMAND}\n```\n")
    assert TEST_COMMAND in (REPO / ".ci" / "run").read_text()
    assert f"```bash\n{CUDA_COMMAND}\n```" in first_screen
    assert ".venv/bin/finetune env" in first_screen
    assert len(first_screen.splitlines()) <= 40
    assert "\n## Install\n" in readme
    # Install for your hardware, then run an example; the reference lives in docs/.
    assert readme.index("\n## Install\n") < readme.index("\n## Quickstart\n")
