"""Hostile values against the generated scripts (launch.sh, job.sbatch): a value with a
line break is refused before anything is written; any other value is quoted so that the
scripts, run with stub launchers, start exactly one command with exactly that value."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import DATA, TINY_MODEL, run_cli
from finetune import cli
from finetune.config import load_experiment
from finetune.errors import RunError
from finetune.render.scripts import launch_argv, launch_script, sbatch_script
from finetune.config.script_values import host_problem, slurm_time, time_seconds
from finetune.rundir.paths import check_run_dir

# Legal directory names that a careless script would run: none may run anything.
HOSTILE = "x $(touch PWNED) `touch PWNED`; touch PWNED; '\"#*%j$HOME&|<>"
NEWLINE = "debug\ntouch PWNED"


def base(**extra) -> dict:
    return {"method": "sft", "model": {"name_or_path": str(TINY_MODEL), "init": "random"},
            "data": {"train": f"{DATA}/sft_train.jsonl"}, **extra}


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def stub(directory: Path, name: str, record: Path, body: str = "") -> Path:
    """An executable that appends its argv ($0 first), NUL-separated, to `record`."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(f"#!/bin/bash\nprintf '%s\\0' \"$0\" \"$@\" >> {shlex.quote(str(record))}\n"
                    "printf '\\n' >> " + shlex.quote(str(record)) + "\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def calls(record: Path) -> list[list[str]]:
    if not record.exists():
        return []
    return [line.rstrip("\0").split("\0") for line in record.read_text().split("\0\n") if line]


def no_pwned(root: Path) -> None:
    assert not list(root.rglob("PWNED")), "a hostile value ran a command"


def stub_env(bin_dir: Path) -> dict:
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
def test_launch_sh_with_hostile_paths_runs_only_the_stub(tmp_path, launcher):
    run_dir = tmp_path / HOSTILE / "run"
    bin_dir = tmp_path / f"bin {HOSTILE}"
    record = tmp_path / "argv"
    python = stub(bin_dir, "python", record)
    for name in ("accelerate", "torchrun", "python3"):
        stub(bin_dir, name, record)
    exp = load_experiment(write_yaml(tmp_path / "e.yaml", base(distributed={
        "strategy": "ddp", "num_processes": 4, "num_machines": 2, "launcher": launcher,
        "main_process_ip": "node-1.cluster"})))
    script = tmp_path / "launch.sh"
    script.write_text(launch_script(exp, run_dir, python=str(python)))
    for rank in (0, 1):
        done = subprocess.run(["bash", str(script), str(rank)], cwd=tmp_path, env=stub_env(bin_dir),
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    assert calls(record) == [launch_argv(exp, run_dir, 0, str(python)),
                             launch_argv(exp, run_dir, 1, str(python))]
    assert str(run_dir / "experiment.yaml") in calls(record)[0]
    no_pwned(tmp_path)


def test_launch_sh_takes_only_a_rank_of_the_run(tmp_path):
    """One exec line whatever the number of machines (100,000 machines wrote 21 MB);
    a rank that is not one of the run's refuses to start anything."""
    bin_dir = tmp_path / "bin"
    record = tmp_path / "argv"
    python = stub(bin_dir, "python", record)
    exp = load_experiment(write_yaml(tmp_path / "e.yaml", base(distributed={
        "strategy": "ddp", "num_machines": 100_000, "num_processes": 100_000})))
    script = tmp_path / "launch.sh"
    script.write_text(launch_script(exp, tmp_path / "run", python=str(python)))
    assert script.stat().st_size < 2000
    for rank in ("100000", "-1", "01", "1e3", "0;touch PWNED", "$(touch PWNED)", " 1"):
        done = subprocess.run(["bash", str(script), rank], cwd=tmp_path, env=stub_env(bin_dir),
                              capture_output=True, text=True)
        assert done.returncode == 2 and "machine rank must be 0..99999" in done.stderr, rank
    done = subprocess.run(["bash", str(script), "99999"], cwd=tmp_path, env=stub_env(bin_dir))
    assert done.returncode == 0
    assert calls(record) == [launch_argv(exp, tmp_path / "run", 99999, str(python))]
    no_pwned(tmp_path)


def test_job_sbatch_with_hostile_paths_runs_only_the_stub(tmp_path):
    run_dir = tmp_path / HOSTILE / "run"
    bin_dir = tmp_path / f"bin {HOSTILE}"
    record = tmp_path / "argv"
    python = stub(bin_dir, "python", record)
    # hostnames: a long list, so a reader that stops after the first line (head) would
    # end scontrol with SIGPIPE, which pipefail turns into a failed job.
    stub(bin_dir, "scontrol", tmp_path / "scontrol", 'case "$2" in\n'
         "  hostnames) echo n1; echo n2; seq 200000 ;;\n"
         "  node) echo 'NodeName=n1 Arch=x86_64 NodeAddr=10.0.0.7 NodeHostName=n1' ;;\n"
         "esac\n")
    # srun: each node runs the task (the words from `bash` on) with its SLURM_NODEID.
    stub(bin_dir, "srun", tmp_path / "srun", 'while [ "$1" != bash ]; do shift; done\n'
         'for node in 0 1; do SLURM_NODEID=$node "$@" || exit $?; done\n')
    exp = load_experiment(write_yaml(tmp_path / "e.yaml", base(
        distributed={"strategy": "ddp", "num_machines": 2, "device": "cpu"})))
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch_script(exp, run_dir, nodes=2, gpus_per_node=0, time="10",
                                    partition="debug,high", signal_seconds=60,
                                    python=str(python)))
    env = {**stub_env(bin_dir), "SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "n[1-2]"}
    done = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    expected = [[str(python), "-m", "finetune", "launch", str(run_dir / "experiment.yaml"),
                 "--machine-rank", str(node), "--main-process-ip", "10.0.0.7",
                 "--main-process-port", "20123"] for node in (0, 1)]
    assert calls(record) == expected
    text = script.read_text()
    assert "#SBATCH --time=0-00:10:00" in text and "#SBATCH --partition=debug,high" in text
    output = next(line for line in text.splitlines() if "--output=" in line)
    # sbatch strips the quotes; % of the path doubled, SLURM's own %j kept.
    assert shlex.split(output[len("#SBATCH "):]) == \
        [f"--output={str(run_dir).replace('%', '%%')}/slurm-%j.out"]
    no_pwned(tmp_path)
    # sbatch reads a backslash in an #SBATCH line as an escape: refused, not mangled.
    with pytest.raises(RunError, match="contains a backslash"):
        sbatch_script(exp, tmp_path / "a\\b", nodes=2, gpus_per_node=0, time="10",
                      partition=None, signal_seconds=60, python=str(python))


@pytest.mark.slow
@pytest.mark.parametrize("command", ["render", "launch", "slurm", "train"])
@pytest.mark.parametrize("key, value", [
    ("distributed.main_process_ip", "127.0.0.1\ntouch PWNED"),
    ("output.dir", "out\ntouch PWNED"),
    ("output.dir", "out\x00x"),
    ("name", "abc\n"),
    ("distributed.main_process_ip", "$(touch PWNED)"),
])
def test_a_line_break_or_shell_text_in_a_yaml_value_is_refused(tmp_path, command, key, value):
    section, _, field = key.rpartition(".")
    data = base(**({section: {field: value}} if section else {field: value}))
    config = write_yaml(tmp_path / "e.yaml", data)
    extra = ["--nodes", "1", "--time", "10"] if command == "slurm" else []
    result = run_cli(command, str(config), *extra, cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and key in errors[0], result.stderr
    assert not (tmp_path / "runs").exists() and not list(tmp_path.rglob("launch.sh"))
    no_pwned(tmp_path)


def _main(argv: list[str], capsys) -> tuple[int, str]:
    """cli.main in this process: exit 0 or 2 with `error:` lines, nothing else escapes."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own error exit
        code = exc.code
    err = capsys.readouterr().err
    assert code in (0, 2) and "Traceback" not in err, err
    return code, err


@pytest.mark.parametrize("flags, message", [
    (["slurm", "--nodes", "1", "--time", "10", "--gpus-per-node", "-3"],
     "--gpus-per-node: must be 0..1024, got -3"),
    (["slurm", "--nodes", "1", "--time", "10", "--signal-seconds", "-5"],
     "--signal-seconds: must be 0..65535, got -5"),
    (["slurm", "--nodes", "1", "--time", "00:99:99"], "seconds and minutes go up to 59"),
    (["slurm", "--nodes", "1", "--time", "01:00:00\n"], "is not a SLURM time limit"),
    (["slurm", "--nodes", "1", "--time", "1-24"], "hours up to 23 after a day count"),
    (["slurm", "--nodes", "1", "--time", "0"], "0 means no limit"),
    (["slurm", "--nodes", "1", "--time", "5", "--signal-seconds", "300"],
     "--signal-seconds 300 is not before the time limit 5"),
    (["slurm", "--nodes", "0", "--time", "10"], "--nodes: must be 1..100000, got 0"),
    (["slurm", "--nodes", "1", "--time", "10", "--partition", NEWLINE], "not a partition name"),
    (["slurm", "--nodes", "1", "--time", "10", "--partition", "a;b"], "not a partition name"),
    (["launch", "--machine-rank", "5"], "--machine-rank 5: the experiment has 1 machine(s)"),
    (["launch", "--machine-rank", "-1"], "--machine-rank: must be 0..99999"),
    (["launch", "--num-processes", "0"], "--num-processes: must be 1..1000000, got 0"),
    (["launch", "--num-processes", "-2"], "--num-processes: must be 1..1000000, got -2"),
    (["launch", "--num-machines", "0"], "--num-machines: must be 1..100000"),
    (["launch", "--main-process-port", "70000"], "--main-process-port: must be 1..65535"),
    (["launch", "--main-process-ip", "10.0.0.1\ntouch PWNED"], "not a host name or IP"),
    (["launch", "--num-processes", "2x"], "expected a whole number, got '2x'"),
    (["slurm", "--nodes", "999999999", "--time", "10"], "--nodes: must be 1..100000"),
    (["launch", "--num-machines", "999999999"], "--num-machines: must be 1..100000"),
    (["estimate", "--gpus", "0"], "--gpus: must be 1..1000000, got 0"),
    (["estimate", "--seq-len", "1" + "0" * 400], "--seq-len: expected a whole number"),
    (["estimate", "--gpu-memory", "9" * 400 + "GB"], "past any device"),
    (["estimate", "--gpu-memory", "1e20GB"], "cannot read '1e20GB' as a memory size"),
    (["estimate", "--gpu-memory", "100000000000000000000GB"], "past any device"),
    (["estimate", "--gpu-memory", "-5GB"], "--gpu-memory: expected one argument"),
])
def test_out_of_range_flags_are_refused(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    config = write_yaml(tmp_path / "e.yaml", base())
    code, err = _main([flags[0], str(config), *flags[1:], *(
        ["--dry-run"] if flags[0] == "launch" else [])], capsys)
    assert code == 2 and message in err, err
    assert [line[:7] for line in err.splitlines()] == ["error: "], err  # one line, no usage
    assert not (tmp_path / "runs").exists()
    no_pwned(tmp_path)


@pytest.mark.parametrize("command", ["render", "launch", "slurm", "train"])
def test_an_impossible_run_directory_is_one_error(tmp_path, capsys, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    extra = {"slurm": ["--nodes", "1", "--time", "10"], "launch": ["--dry-run"]}.get(command, [])
    cases = {"afile": "is a file, not a directory",
             "afile/sub": "which is a file, not a directory",
             "a" * 300: "more than the 255 the file system allows",
             "/".join(["b" * 200] * 25): "paths would pass the system's"}
    for out, message in cases.items():
        config = write_yaml(tmp_path / "e.yaml", base(output={"dir": str(tmp_path / out)}))
        code, err = _main([command, str(config), *extra], capsys)
        assert code == 2 and message in err and err.count("error:") == 1, err


def test_render_out_that_is_a_file_or_holds_a_directory_named_like_a_file(tmp_path, capsys,
                                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = write_yaml(tmp_path / "e.yaml", base())
    (tmp_path / "afile").write_text("x")
    code, err = _main(["render", str(config), "--out", str(tmp_path / "afile")], capsys)
    assert code == 2 and "is a file, not a directory" in err
    (tmp_path / "bundle" / "launch.sh").mkdir(parents=True)
    code, err = _main(["render", str(config), "--out", str(tmp_path / "bundle")], capsys)
    assert code == 2 and "cannot write" in err and "launch.sh" in err, err
    (tmp_path / "runs" / "e" / "job.sbatch").mkdir(parents=True)
    code, err = _main(["slurm", str(config), "--nodes", "1", "--time", "10"], capsys)
    assert code == 2 and "job.sbatch is a directory, not a file" in err, err


def test_a_run_directory_that_cannot_be_created_is_one_error(tmp_path, capsys, monkeypatch):
    if os.geteuid() == 0:
        pytest.skip("root may write anywhere")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    monkeypatch.chdir(tmp_path)
    config = write_yaml(tmp_path / "e.yaml", base(output={"dir": str(locked / "run")}))
    code, err = _main(["render", str(config)], capsys)
    assert code == 2 and "cannot create the run directory" in err


def test_time_limits_take_every_slurm_form():
    good = {"90": 5400, "5:30": 330, "48:00:00": 172800, "1-0": 86400, "1-23:59": 172740,
            "2-03:04:05": 183845}
    assert {value: time_seconds(value) for value in good} == good
    for bad in ("00:99:99", "1:60", "1-24", "1-1:60", "0", "0:00:00", "01:00:00\n", "\u0661",
                "1-", ":5", "UNLIMITED", "1 :00"):
        with pytest.raises(ValueError):
            time_seconds(bad)
    assert slurm_time(183845) == "2-03:04:05"


def test_hosts_by_whole_pattern():
    for good in ("127.0.0.1", "node-1.cluster", "n1", "::1", "fe80::1%eth0", "my_node"):
        assert host_problem(good) is None, good
    for bad in ("10.0.0.300", "1.2.3.4\n", "a b", "$(x)", "-x", "fe80::1%$(x)", "a" * 64, ""):
        assert host_problem(bad), bad


TEXT = st.text(st.characters(codec="utf-8", exclude_characters="/"), min_size=1, max_size=40)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, derandomize=True)
@given(name=TEXT)
def test_any_run_directory_name_is_refused_or_quoted_whole(tmp_path_factory, name):
    """A run directory either is refused (one RunError) or appears in launch.sh and
    job.sbatch only inside quoted words that read back as itself, on the lines the
    template has: no value can add a line."""
    exp = _fuzz_experiment(tmp_path_factory)
    run_dir = Path("/tmp/finetune-fuzz") / name
    try:
        check_run_dir(run_dir)
        script = launch_script(exp, run_dir, python="/usr/bin/python3")
        job = sbatch_script(exp, run_dir, nodes=2, gpus_per_node=0, time="10",
                            partition=None, signal_seconds=60, python="/usr/bin/python3")
    except RunError:
        return
    assert len(script.splitlines()) == len(_TEMPLATES["launch"].splitlines())
    assert len(job.splitlines()) == len(_TEMPLATES["job"].splitlines())
    line = next(l for l in script.splitlines() if l.startswith("exec "))
    assert shlex.split(line[len("exec "):].replace('"$rank"', "0")) == \
        launch_argv(exp, run_dir, 0, "/usr/bin/python3")


_TEMPLATES: dict = {}


def _fuzz_experiment(factory):
    if "exp" not in _TEMPLATES:
        directory = factory.mktemp("fuzz")
        exp = load_experiment(write_yaml(directory / "e.yaml", base(
            distributed={"strategy": "ddp", "num_machines": 2, "device": "cpu"})))
        _TEMPLATES.update(exp=exp, launch=launch_script(exp, Path("/r"), "/p"),
                          job=sbatch_script(exp, Path("/r"), nodes=2, gpus_per_node=0,
                                            time="10", partition=None, signal_seconds=60,
                                            python="/p"))
    return _TEMPLATES["exp"]


FLAG = st.one_of(st.text(max_size=12),
                 st.from_regex(r"[0-9]{1,3}(-[0-9]{1,2})?(:[0-9]{1,3}){0,2}", fullmatch=True))


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True)
@given(time=FLAG, partition=st.one_of(st.none(), st.text(max_size=10)), nodes=FLAG,
       signal=FLAG, ip=st.text(max_size=12))
def test_any_slurm_and_launch_flags_exit_0_or_2(tmp_path_factory, time, partition, nodes,
                                                signal, ip):
    """cli.main in this process: 0 (and a job.sbatch with the template's lines) or 2 with
    `error:` lines; nothing else escapes."""
    import contextlib
    import io

    if "cfg" not in _TEMPLATES:
        directory = tmp_path_factory.mktemp("flags")
        _TEMPLATES["cfg"] = write_yaml(directory / "e.yaml", base(
            output={"dir": str(directory / "run")}, distributed={"device": "cpu"}))
    config = _TEMPLATES["cfg"]
    run = Path(yaml.safe_load(config.read_text())["output"]["dir"])
    argvs = [["slurm", str(config), "--nodes", nodes, "--time", time, "--signal-seconds", signal,
              *(["--partition", partition] if partition is not None else [])],
             ["launch", str(config), "--main-process-ip", ip, "--dry-run"]]
    for argv in argvs:
        (run / "job.sbatch").unlink(missing_ok=True)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = cli.main(argv)
            except SystemExit as exc:
                code = exc.code
        assert code in (0, 2), (argv, err.getvalue())
        assert "Traceback" not in err.getvalue()
        if code == 2:
            assert "error:" in err.getvalue()
        elif argv[0] == "slurm":  # the values changed #SBATCH lines, and only those
            lines = (run / "job.sbatch").read_text().splitlines()
            safe = sbatch_script(load_experiment(config), run, nodes=1, gpus_per_node=0,
                                 time="10", partition=partition and "p", signal_seconds=5,
                                 python=sys.executable).splitlines()
            assert len(lines) == len(safe)
            assert [l for l in lines if not l.startswith(("#SBATCH ", "srun "))] == \
                [l for l in safe if not l.startswith(("#SBATCH ", "srun "))]



def test_render_out_that_is_not_utf8_or_holds_credentials(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = write_yaml(tmp_path / "e.yaml", base())
    for out, message in ((os.fsdecode(b"r_\xff"), "is not UTF-8 text"),
                         ("https://u:pa55@host/x", "holds credentials in a URL")):
        code, err = _main(["render", str(config), "--out", out], capsys)
        assert code == 2 and message in err and err.count("error:") == 1, err
        assert "pa55" not in err
    assert not [p for p in tmp_path.iterdir() if p.name != "e.yaml"]


def test_overrides_after_the_flags(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = write_yaml(tmp_path / "e.yaml", base())
    code, _ = _main(["launch", str(config), "--dry-run", "training.max_steps=5", "name=late"],
                    capsys)
    assert code == 0
    assert "max_steps: 5" in (tmp_path / "runs" / "late" / "experiment.yaml").read_text()
    code, err = _main(["launch", str(config), "--dry-run", "--no-such-flag"], capsys)
    assert code == 2 and "unrecognized arguments: --no-such-flag" in err
