"""Property test over the experiment loader and overrides (issue 13): the project's own
configs, mutated (keys deleted, values replaced by hostile or mistyped ones, raw text
spliced in, hostile overrides), always answer exit 0 or exit 2 with `error:` lines, no
other exception (the loader's budgets bound the work; no clock is asserted). A fixed, derandomized budget (1,500 examples) of about 20 s."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO
from finetune.cli import main

SEEDS = sorted(p for p in (REPO / "configs").glob("*/*.yaml") if p.parent.name != "sweeps")
HOSTILE_TEXT = ["", " ", "~nosuchuser/x", "a\0b", "x" * 300, "https://u:pw@host/x",
                "1" + "0" * 400, "-1" + "0" * 30, "99999999999", "4294967296", ".nan",
                "../../../../etc/passwd", "nan", ".inf", "-5", "1e400", "0x10", "{", "[",
                "*a", "&a [*a]", "!!python/name:os.system", "é", "١٢", "tiny-lama",
                "hf_token_value", "a\nb", "${HOME}", "'", '"', "%", "@", "`x`", "\t"]
SCALARS = st.one_of(
    st.sampled_from(HOSTILE_TEXT), st.text(max_size=20), st.booleans(), st.none(),
    st.integers(min_value=-2**70, max_value=2**70), st.floats(allow_nan=True),
    st.sampled_from([0, -1, 1, 2**32, 2**63, -0.0, float("nan"), float("inf")]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.one_of(st.text(max_size=8), st.integers(), st.booleans()), inner,
                    max_size=3)), max_leaves=6)
SNIPPETS = ["*undefined", "&a [*a]", "!!python/name:os.system", "\t", "{", "? [a]\n: 1",
            "- x", "x: !!int '1e400'", "x: &x\n  y: *x", "%YAML 1.1", "---\n---", ":",
            "training:\n  1: 2", "<<: *a", '"a\\nb": 1', "'x\ty': 2"]
KEYS = ["training.learning_rate", "training.seed", "training.max_length", "model.name_or_path",
        "data.train", "data.train.0.path", "method", "extends", "distributed.num_processes",
        "training.report_to", "training.hub_token", "peft.r", "classify.labels.0",
        "training.per_device_train_batch_size", "model.attn_implementation", "x.y.z",
        "training.1", "data.train.²", "name", "training.a\nb", "model.\x1b[31m",
        "distributed.num_machines", "distributed.strategy", "distributed.deepspeed.nvme_path",
        "distributed.deepspeed.offload_optimizer", "model.revision", "output.dir", "peft.r",
        "training.hub_model_id", "classify.max_length", "ppo.max_new_tokens"]


def _paths(data, prefix=()):
    """Every (path, value) of a loaded config, sections included."""
    if isinstance(data, dict):
        for key, value in data.items():
            yield prefix + (key,), value
            yield from _paths(value, prefix + (key,))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield prefix + (i,), value
            yield from _paths(value, prefix + (i,))


def _set(data, path, value):
    node = data
    for part in path[:-1]:
        node = node[part]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value


_DELETE = object()


@st.composite
def cases(draw):
    """(file bytes, overrides) from one of the project's configs."""
    seed = draw(st.sampled_from(SEEDS))
    text = seed.read_text()
    data = yaml.safe_load(text)
    for _ in range(draw(st.integers(0, 3))):
        paths = [p for p, _ in _paths(data)]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        how = draw(st.sampled_from(["delete", "replace", "wrap", "stringify"]))
        old = dict(_paths(data))[path]
        new = {"delete": _DELETE, "replace": draw(VALUES), "wrap": [old],
               "stringify": str(old)}[how]
        _set(data, path, new)
    raw = yaml.safe_dump(data, allow_unicode=True, sort_keys=False) if data else ""
    if draw(st.booleans()):
        lines = raw.splitlines()
        at = draw(st.integers(0, len(lines)))
        lines.insert(at, draw(st.sampled_from(SNIPPETS)))
        raw = "\n".join(lines) + "\n"
    body = raw.encode("utf-8", "surrogatepass")
    if draw(st.integers(0, 9)) == 0:
        body += draw(st.sampled_from([b"\xff\xfe", b"x: \x00", b"\xe9"]))
    overrides = draw(st.lists(st.tuples(st.sampled_from(KEYS), st.one_of(
        st.sampled_from(HOSTILE_TEXT), st.text(max_size=12))), max_size=3))
    return _case_name(seed), body, [f"{key}={value}" for key, value in overrides]


def _case_name(seed: Path) -> str:
    """Where a case of this seed is written: beside it, under another name, so relative
    paths and `extends: ../quickstart/sft.yaml` resolve and the seeds stay intact."""
    return f"{seed.parent.name}/case-{seed.name}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """configs/ linked item by item, so the configs' relative paths resolve."""
    root = tmp_path_factory.mktemp("fuzz")
    for folder in ("quickstart", "examples"):
        (root / folder).mkdir()
        for item in (REPO / "configs" / folder).iterdir():
            (root / folder / item.name).symlink_to(item)
    return root


def outcome(root: Path, case, capsys) -> tuple[int | None, str]:
    """(exit code, stderr) of `finetune validate` in-process; an exception other than
    SystemExit propagates."""
    name, body, overrides = case
    path = root / name
    path.write_bytes(body)
    capsys.readouterr()
    code = main(["validate", str(path), *overrides])
    return code, capsys.readouterr().err


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_validate_answers_every_mutated_config(workdir, capsys, online, case):
    code, err = outcome(workdir, case, capsys)
    assert code in (0, 2), err
    assert "Traceback" not in err
    if code == 2:
        assert err and all(line.startswith("error: ") for line in err.splitlines()), err


def test_fuzz_seeds_are_the_project_configs():
    assert {seed.parent.name for seed in SEEDS} == {"quickstart", "examples"}


COMMANDS = [["render", "--out", "bundle"], ["launch", "--dry-run"],
            ["slurm", "--nodes", "2", "--time", "01:00:00"], ["estimate", "--json"]]
# Values validate may well accept, and the extremes of their ranges.
PLAUSIBLE = {
    "distributed.strategy": ["none", "ddp", "deepspeed", "fsdp"],
    "distributed.num_machines": [1, 2, 3, 100_000],
    "distributed.num_processes": [1, 2, 6, 1_000_000],
    "distributed.processes_per_machine": [1, 2, 8, 1024],
    "distributed.device": ["auto", "cpu", "cuda"],
    "distributed.launcher": ["accelerate", "torchrun"],
    "distributed.main_process_ip": ["10.0.0.1", "node-1.cluster", "::1"],
    "distributed.main_process_port": [1, 65535],
    "distributed.deepspeed.zero_stage": [0, 1, 2, 3],
    "distributed.deepspeed.offload_optimizer": ["none", "cpu", "nvme"],
    "distributed.deepspeed.offload_params": ["none", "cpu"],
    "distributed.deepspeed.nvme_path": ["/nvme", "a b/'c'"],
    "distributed.fsdp.version": [1, 2],
    "peft.type": ["none", "lora", "qlora"],
    "peft.r": [1, 65536],
    "precision": ["auto", "bf16", "fp16", "fp32"],
    "training.max_length": [1, 2**31 - 1, "null"],
    "training.per_device_train_batch_size": [1, 2**31 - 1],
    "training.gradient_accumulation_steps": [1, 7],
    "training.max_steps": [1, 2**63 - 1],
    "output.dir": ["runs/a b", "out/%j%", "it's", "x" * 250],
    "name": ["a", "a.b-c_d", "x" * 200],
    "model.revision": ["main", "v1.0/x"],
}


@st.composite
def plausible(draw):
    """(seed name, its bytes, overrides) likely to pass validate."""
    seed = draw(st.sampled_from(SEEDS))
    keys = draw(st.lists(st.sampled_from(sorted(PLAUSIBLE)), max_size=4, unique=True))
    return _case_name(seed), seed.read_bytes(), [f"{k}={draw(st.sampled_from(PLAUSIBLE[k]))}"
                                                 for k in keys]


@pytest.mark.slow
@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(case=plausible(), command=st.sampled_from(COMMANDS))
def test_what_validate_accepts_every_command_accepts(workdir, capsys, online, monkeypatch,
                                                     case, command):
    """render, launch --dry-run, slurm and estimate answer whatever validate accepted with
    exit 0 or one-line errors, and write no credentials into what they write."""
    code, _ = outcome(workdir, case, capsys)
    if code != 0:
        return
    out = workdir / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    monkeypatch.chdir(out)
    code = main([command[0], str(workdir / case[0]), *case[2], *command[1:]])
    captured = capsys.readouterr()
    assert code in (0, 2), (code, captured.err)
    if code == 2:
        assert all(line.startswith("error: ") for line in captured.err.splitlines()), captured.err
    written = [p.read_bytes() for p in out.rglob("*") if p.is_file()]
    assert not any(b"u:pw@" in text for text in [captured.out.encode(), *written])
