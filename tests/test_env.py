"""`finetune env`: as a user runs it on this machine (no GPU), and in-process with
torch.cuda and the driver's GPU listing faked: an older GPU, an H100, a flash_attn built
for another torch, and a torch that does not import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from importlib import metadata
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, run_cli
from finetune.commands import machine
from finetune.config.derived import kernels
from finetune.launch import probe
from finetune.report.summary import PACKAGES

KEYS = {"finetune", "python", "platform", "packages", "driver", "torch", "torchvision",
        "gpus", "device", "precision", "attention", "liger", "bitsandbytes", "flash_attn"}


# CI's torch is the CPU build; a CUDA build (bash setup.sh --cuda) runs on a CPU machine too
BUILD = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _env_cli(*args: str, tmp_path, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "finetune", "env", *args], cwd=tmp_path,
                            text=True, capture_output=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    return result, time.monotonic() - started


@pytest.mark.slow
def test_env_on_this_machine(tmp_path):
    result, seconds = _env_cli(tmp_path=tmp_path)
    print(f"finetune env: {seconds:.1f} s")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    out = result.stdout
    for name in PACKAGES:
        assert f"  {name:<14}{_version(name) or 'not installed'}" in out
    assert f"  torch         {_version('torch')} ({BUILD})" in out
    assert "GPUs, NVIDIA driver unknown (no nvidia-smi answered)\n  none that torch sees" in out
    assert "  device        cpu: no NVIDIA GPU: none in /proc/driver/nvidia" in out
    assert "  precision     fp32: the CPU computes in fp32" in out
    assert "  attention     finetune_varlen: its reference kernel on the CPU" in out
    if _version("liger-kernel") is None:
        assert ("  liger-kernel  no: not installed (sft's fused kernels on CUDA)\n"
                '                fix: pip install -e ".[gpu]"') in out
    if _version("flash-attn") is None:
        assert ("flash-attn    no: not installed (optional: without it sft runs PyTorch's "
                "flash varlen kernel)\n                fix: MAX_JOBS=4 pip install flash-attn "
                "--no-build-isolation") in out
    assert len(out.splitlines()) <= 30  # one screen


@pytest.mark.slow
def test_env_json_parses_with_stable_keys(tmp_path):
    # forked from the warm interpreter: the cold start a user makes is the test above's
    result = run_cli("env", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert set(found) == KEYS
    assert found["packages"] == {name: _version(name) for name in PACKAGES}
    assert found["finetune"] == _version("finetune")
    assert found["torch"] == {"build": BUILD, "error": None, "fix": None}
    assert found["gpus"] == [] and found["driver"] is None
    assert found["device"]["value"] == "cpu" and found["device"]["why"].startswith("no NVIDIA")
    assert found["precision"] == {"value": "fp32", "why": "the CPU computes in fp32",
                                  "fix": None}
    assert found["attention"]["value"] == "finetune_varlen"
    if _version("liger-kernel") is None:
        assert found["liger"]["usable"] is False and found["liger"]["fix"] == machine.GPU_EXTRA
    if _version("flash-attn") is None:
        assert found["flash_attn"] == {
            "usable": False, "fix": machine.FLASH_INSTALL,
            "why": "not installed (optional: without it sft runs PyTorch's flash varlen kernel)"}
    if _version("bitsandbytes"):
        assert found["bitsandbytes"] == {"usable": True, "fix": None,
                                         "why": "imports: peft.type qlora can run"}


def test_a_torch_that_does_not_import_is_reported(tmp_path):
    """Not a traceback: the torch-free facts, and what torch's failure leaves unknown."""
    site = tmp_path / "site" / "torch"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("raise ImportError('libtorch_cpu.so: cannot open')\n")
    result, _ = _env_cli("--json", tmp_path=tmp_path, PYTHONPATH=str(tmp_path / "site"))
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    error = "torch does not import (ImportError: libtorch_cpu.so: cannot open)"
    assert found["torch"] == {"build": None, "error": error, "fix": None}
    assert found["packages"]["torch"] == _version("torch")  # read without importing it
    assert found["precision"]["value"] == "fp32"  # the CPU needs no torch to decide
    if _version("bitsandbytes"):
        assert found["bitsandbytes"]["why"] == "bitsandbytes needs torch, which does not import"
    text = machine.render(found)
    assert f"  torch         {_version('torch')} ({error})" in text
    assert f"  none that torch sees ({error})" in text


@pytest.mark.slow  # two cold starts
def test_a_torchvision_built_for_another_torch_is_one_line(tmp_path):
    """What `pip install torchvision` beside a local torch wheel leaves (PyPI's build, made
    for PyPI's torch): `import torchvision` fails, and transformers imports it wherever it
    loads a model or data. `finetune env` names it with its fix; any other command stops
    in that one line instead of transformers' "Could not import module" traceback."""
    site = tmp_path / "site"
    (site / "torchvision").mkdir(parents=True)
    (site / "torchvision" / "__init__.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n")
    (site / "torchvision-0.28.0.dist-info").mkdir()
    (site / "torchvision-0.28.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    problem = (f"torchvision 0.28.0 is installed but does not import beside torch "
               f"{_version('torch')} (RuntimeError: operator torchvision::nms does not "
               f"exist), and transformers imports it wherever it loads a model or data: "
               f"{machine.TORCHVISION_FIX}")
    result, _ = _env_cli("--json", tmp_path=tmp_path, PYTHONPATH=str(site))
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["packages"]["torchvision"] == "0.28.0"
    assert found["torchvision"] == {"value": None, "why": problem,
                                    "fix": machine.TORCHVISION_FIX}
    assert ("  torchvision   0.28.0 (does not import: it was built for another torch)\n"
            f"                fix: {machine.TORCHVISION_FIX}") in machine.render(found)
    config = REPO / "configs" / "quickstart" / "sft.yaml"
    result = subprocess.run([sys.executable, "-m", "finetune", "data", str(config), "-n", "1"],
                            cwd=tmp_path, text=True, capture_output=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(site)})
    assert (result.returncode, result.stderr) == (2, f"error: {problem}\n"), result.stderr


def test_a_bogus_flag_is_one_error_line(tmp_path):
    result = run_cli("env", "--bogus", cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: finetune: unrecognized arguments: --bogus (see finetune --help)"]


def test_the_cli_starts_without_torch():
    """env's module is imported at every CLI start: it must not bring torch."""
    code = ("import sys\n"
            "from finetune.cli import build_parser\nbuild_parser()\n"
            "assert 'finetune.commands.machine' in sys.modules\n"
            "heavy = [m for m in ('torch', 'transformers', 'bitsandbytes') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr  # the bound is the modules, not a clock


@pytest.fixture
def gpus(monkeypatch, tmp_path):
    """A machine with these GPUs ((name, major, minor) each), as its NVIDIA driver lists
    them in /proc and torch.cuda reports them (the idea of tests/test_gpu_paths.py)."""
    kernels.installed.cache_clear()
    # bitsandbytes is not what these tests are about; its real import is the slow tests'.
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))

    def _gpus(*found: tuple[str, int, int]):
        listed = tmp_path / "proc-gpus"
        props = [SimpleNamespace(name=name, major=major, minor=minor, total_memory=16 * 2**30)
                 for name, major, minor in found]
        for i in range(len(props)):
            (listed / f"0000:0{i}:00.0").mkdir(parents=True)
        monkeypatch.setattr(probe, "PROC_GPUS", listed)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props[i])
        monkeypatch.setattr(torch.cuda, "get_device_capability",
                            lambda i=0: (props[i].major, props[i].minor))
        return machine.facts({})  # no CUDA_VISIBLE_DEVICES, no nvidia-smi on PATH

    yield _gpus
    kernels.installed.cache_clear()


def test_a_gpu_without_bf16_gets_fp16_and_sdpa(gpus):
    found = gpus(("Tesla V100-SXM2-16GB", 7, 0))
    assert found["device"] == {"value": "cuda", "fix": None,
                               "why": f"1 NVIDIA GPU(s) in {probe.PROC_GPUS}"}
    assert found["gpus"] == [{"index": 0, "name": "Tesla V100-SXM2-16GB", "capability": "7.0",
                              "memory_gib": 16.0}]
    assert found["precision"]["value"] == "fp16"
    assert found["precision"]["why"] == \
        "Tesla V100-SXM2-16GB has no native bf16 (compute capability 7.0)"
    why = ("Tesla V100-SXM2-16GB has compute capability 7.0; flash attention kernels need "
           "8.0 (Ampere)")
    assert found["attention"] == {"value": "sdpa", "why": why, "fix": None}
    assert found["flash_attn"] == {"usable": False, "why": why, "fix": None}  # no use here
    text = machine.render(found)
    assert "  0  Tesla V100-SXM2-16GB, compute capability 7.0, 16.0 GiB" in text
    assert "  precision     fp16: Tesla V100-SXM2-16GB has no native bf16" in text
    assert f"  attention     sdpa: {why}" in text
    json.dumps(found)


def test_an_h100_gets_bf16_and_torch_varlen(gpus):
    found = gpus(("NVIDIA H100 80GB HBM3", 9, 0), ("NVIDIA H100 80GB HBM3", 9, 0))
    assert [g["index"] for g in found["gpus"]] == [0, 1]
    assert found["precision"] == {"value": "bf16", "fix": None, "why":
                                  "NVIDIA H100 80GB HBM3 computes bf16 natively (compute "
                                  "capability 9.0)"}
    assert found["attention"]["value"] == "finetune_varlen"
    assert found["attention"]["why"] == "PyTorch's flash varlen kernel (no flash-attn needed)"
    assert found["flash_attn"]["fix"] == machine.FLASH_INSTALL
    assert found["bitsandbytes"]["usable"] is True
    if _version("liger-kernel") is None:
        assert found["liger"]["fix"] == machine.GPU_EXTRA
    assert "  attention     finetune_varlen: PyTorch's flash varlen kernel" in \
        machine.render(found)


def test_a_flash_attn_that_does_not_import_is_broken_with_its_fix(gpus, monkeypatch, tmp_path):
    """A flash_attn built for another torch: find_spec finds it, importing it fails."""
    package = tmp_path / "site" / "flash_attn"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c105ErrorC2E')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    found = gpus(("NVIDIA H100 80GB HBM3", 9, 0))
    broken = ("flash_attn is installed but does not import (ImportError: flash_attn_2_cuda.so: "
              "undefined symbol: _ZN3c105ErrorC2E); reinstall it for torch")
    assert found["flash_attn"]["usable"] is False
    assert found["flash_attn"]["why"].startswith(broken)
    assert found["flash_attn"]["fix"] == machine.FLASH_REBUILD
    assert found["attention"]["value"] == "finetune_varlen"  # passed over, said why
    assert found["attention"]["why"].startswith(broken)
    text = machine.render(found)
    assert f"  flash-attn    no: {broken}" in text
    assert f"fix: pip uninstall -y flash-attn && {machine.FLASH_INSTALL} --no-cache-dir" in text


def test_a_driver_gpu_that_torch_does_not_see(monkeypatch, tmp_path):
    """A CPU build of torch next to an NVIDIA driver: auto probes cuda, and runs stop."""
    listed = tmp_path / "proc-gpus"
    (listed / "0000:01:00.0").mkdir(parents=True)
    monkeypatch.setattr(probe, "PROC_GPUS", listed)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))
    found = machine.facts({})
    problem = f"torch {_version('torch')} is a CPU build"
    assert found["gpus"] == []
    assert found["device"] == {"value": "cuda", "fix": "bash setup.sh --cuda",
                               "why": f"1 NVIDIA GPU(s) in {listed}; but {problem}, so runs "
                                      "with distributed.device auto stop"}
    assert found["precision"] == found["attention"] == {
        "value": None, "why": f"not known: {problem}", "fix": None}
    assert f"  precision     ?: not known: {problem}" in machine.render(found)
