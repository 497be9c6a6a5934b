"""Prepared data is cached on disk and shared: the main process of a machine prepares it
once, the other ranks wait for the cache entry on the file system (no process group
exists yet, so no collective can time out), and a later run with the same data,
tokenizer and settings loads it. The waiting ranks here are real processes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import finetune
from conftest import REPO, TINY_MODEL
from finetune.data.prepare import META, cache_key, cache_root, entry_problem, prepared_data
from finetune.methods import preparation
from finetune.model.tokenizer import load_tokenizer
from finetune.config import load_experiment
from finetune.errors import RunError

ROWS = [{"messages": [{"role": "user", "content": f"q {i}"},
                      {"role": "assistant", "content": "a " * (1 + i % 5)}]} for i in range(40)]
WAITER = """
import sys
import time
from pathlib import Path
launched = time.time()
from finetune.data.prepare import prepared_data
from finetune.methods import preparation
from finetune.model.tokenizer import load_tokenizer
from finetune.config import load_experiment
experiment = load_experiment(sys.argv[1])
splits = prepared_data(experiment, load_tokenizer(experiment), preparation(experiment),
                       Path(sys.argv[2]), launched, {"LOCAL_RANK": "1", "RANK": "1"})
print("rows", len(splits.train), "eval rows", len(splits.eval_rows), flush=True)
"""


@pytest.fixture
def waiters():
    """Waiting processes, killed at the end whatever the test's outcome."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture
def config(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    path = tmp_path / "exp.yaml"
    path.write_text(f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}}}\n"
                    f"data: {{train: {data}, eval_fraction: 0.25}}\n"
                    "training: {max_length: 16, assistant_only_loss: true}\n")
    return path


def _entries(experiment, run_dir):
    root = cache_root(experiment, run_dir)
    return sorted(p.name for p in root.iterdir() if (p / META).exists())


def _waiter(config, run_dir):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", WAITER, str(config), str(run_dir)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_entry_reused_and_keyed_by_what_it_depends_on(config, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    experiment = load_experiment(config)
    tokenizer = load_tokenizer(experiment)
    first = prepared_data(experiment, tokenizer, preparation(experiment), run_dir, time.time(), {})
    assert "data prepared and cached" in capsys.readouterr().out
    assert len(first.train) == 30 and len(first.eval) == 10 and len(first.eval_rows) == 10
    assert max(len(ids) for ids in first.train["input_ids"]) == 16
    # Only assistant tokens are trained (assistant_only_loss).
    row = first.train[0]
    assert -100 in row["labels"] and any(t != -100 for t in row["labels"])

    # A crash's staging directory of another key stays; of this key, a day old, goes.
    root = cache_root(experiment, run_dir)
    abandoned, other = root / f".{_entries(experiment, run_dir)[0]}.x1", root / ".other.x2"
    for path in (abandoned, other):
        path.mkdir()
        os.utime(path, (time.time() - 2 * 86400,) * 2)
    shutil.rmtree(root / _entries(experiment, run_dir)[0])
    # prepares again
    prepared_data(experiment, tokenizer, preparation(experiment), run_dir, time.time(), {})
    assert not abandoned.exists() and other.exists()

    again = prepared_data(experiment, tokenizer, preparation(experiment), run_dir, time.time(), {})
    assert "data loaded from the cache" in capsys.readouterr().out
    assert again.train["input_ids"] == first.train["input_ids"]
    assert again.eval_rows["messages"] == first.eval_rows["messages"]
    assert len(_entries(experiment, run_dir)) == 1

    # Another max_length is another entry; the data file rewritten with the same bytes
    # is not (the key holds its content), one edited is.
    longer = load_experiment(config, ["training.max_length=32"])
    prepared_data(longer, tokenizer, preparation(longer), run_dir, time.time(), {})
    data = tmp_path / "train.jsonl"
    time.sleep(0.01)
    data.write_text(data.read_text())
    prepared_data(experiment, tokenizer, preparation(experiment), run_dir, time.time(), {})
    assert len(_entries(experiment, run_dir)) == 2
    data.write_text(data.read_text().replace("q 1", "q 9"))
    prepared_data(experiment, tokenizer, preparation(experiment), run_dir, time.time(), {})
    assert len(_entries(experiment, run_dir)) == 3

    off = load_experiment(config, ["data.cache=false"])
    assert len(prepared_data(off, tokenizer, preparation(off), run_dir, time.time(),
                             {}).train) == 30
    assert len(_entries(experiment, run_dir)) == 3


@pytest.mark.slow
def test_other_ranks_wait_for_the_main_process_then_share_its_entry(config, tmp_path,
                                                                     waiters):
    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    waiter = _waiter(config, run_dir)
    waiters.append(waiter)
    time.sleep(8)  # its imports, then it waits: nothing is prepared yet
    assert waiter.poll() is None
    experiment = load_experiment(config)
    assert not cache_root(experiment, run_dir).exists() or not _entries(experiment, run_dir)

    prepared_data(experiment, load_tokenizer(experiment), preparation(experiment), run_dir,
                  time.time(), {})
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0, err[-2000:]
    assert "rows 30 eval rows 10" in out and "prepared" not in out
    assert len(_entries(experiment, run_dir)) == 1


@pytest.mark.slow
def test_a_waiting_rank_stops_when_the_main_process_fails(config, tmp_path, waiters):
    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    waiter = _waiter(config, run_dir)
    waiters.append(waiter)
    time.sleep(1)  # still importing: a failure after its start counts all the same
    assert waiter.poll() is None
    (run_dir / "failed-0.json").write_text(json.dumps({"rank": 0, "errors": ["bad row"]}))
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode != 0
    assert "the data could not be prepared" in err and "failed-0.json" in err


def _edit_meta(change):
    def edit(entry):
        meta = json.loads((entry / META).read_text())
        change(meta)
        (entry / META).write_text(json.dumps(meta))
    return edit


def _replace_with_file(entry):
    shutil.rmtree(entry)
    entry.write_text("x")


def _unloadable(entry):
    """Bytes that load_from_disk cannot read, listed in meta.json with their true size and
    hash: only loading the entry finds the damage."""
    state = entry / "train" / "state.json"
    state.write_text("{not json")
    _edit_meta(lambda m: m["files"]["train/state.json"].update(
        size=state.stat().st_size, sha256=hashlib.sha256(state.read_bytes()).hexdigest()))(entry)


def _without_eval_part(entry):
    shutil.rmtree(entry / "eval")
    _edit_meta(lambda m: m.update(files={k: v for k, v in m["files"].items()
                                         if not k.startswith("eval/")}))(entry)


NOT_OURS = f"{META} is not one this version of finetune wrote"


@pytest.mark.parametrize("damage,why", [
    (lambda e: next(e.glob("train/*.arrow")).unlink(),
     "train/data-00000-of-00001.arrow is missing"),
    (lambda e: (e / "train" / "state.json").write_bytes(
        (e / "train" / "state.json").read_bytes()[:40]), "train/state.json has 40 bytes"),
    (lambda e: (e / META).write_text("{"), f"{META} is unreadable"),
    (lambda e: (e / META).unlink(), f"no {META}"),
    # C1-C4 of the data audit: each was a traceback, or a "delete it" error.
    (_edit_meta(lambda m: m.update(parts=["eval", "eval_rows"])), f"{NOT_OURS} (parts"),
    (_edit_meta(lambda m: m.update(parts=[])), f"{NOT_OURS} (parts []"),
    (_edit_meta(lambda m: m.pop("format")), f"{NOT_OURS} (format None"),
    (_edit_meta(lambda m: m.update(format=["sft"])), f"{NOT_OURS} (format ['sft']"),
    (_without_eval_part, f"{NOT_OURS} (part eval has no files"),
    (_edit_meta(lambda m: m["files"].update({"a\0b": {"size": 1}})), "a\\x00b is missing"),
    (lambda e: (e / META).write_text("[" * 100_000 + "]" * 100_000),
     f"{META} is unreadable (RecursionError"),
    (_replace_with_file, "not a directory"),
    (lambda e: (e / "train" / "extra.arrow").write_text("x"),
     f"train/extra.arrow is not listed in {META}"),
    (_unloadable, "cannot be loaded ("),
])
def test_a_damaged_entry_is_prepared_again_with_a_line(config, tmp_path, capsys, damage, why):
    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    experiment = load_experiment(config)
    tokenizer = load_tokenizer(experiment)
    first = prepared_data(experiment, tokenizer, preparation(experiment), run_dir, time.time(), {})
    entry = cache_root(experiment, run_dir) / _entries(experiment, run_dir)[0]
    damage(entry)
    capsys.readouterr()
    again = prepared_data(experiment, tokenizer, preparation(experiment), run_dir, time.time(), {})
    out = capsys.readouterr().out
    assert f"the data cache entry {entry} is damaged ({why}" in out, out
    assert "preparing it again" in out and "data prepared and cached" in out
    assert again.train["input_ids"] == first.train["input_ids"]
    prepared_data(experiment, tokenizer, preparation(experiment), run_dir, time.time(), {})
    assert "data loaded from the cache" in capsys.readouterr().out
    leftovers = [p.name for p in entry.parent.iterdir() if p.name != entry.name]
    assert leftovers == []


def test_a_trainer_mapping_a_cached_part_does_not_damage_the_entry(config, tmp_path, capsys):
    # TRL's trainers filter and map the datasets they are given; datasets writes the result
    # beside the loaded part (train/cache-<fingerprint>.arrow). The next run loads the entry.
    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    experiment = load_experiment(config)
    tokenizer = load_tokenizer(experiment)
    prepared_data(experiment, tokenizer, preparation(experiment), run_dir, time.time(), {})
    loaded = prepared_data(experiment, tokenizer, preparation(experiment), run_dir,
                           time.time(), {})
    loaded.train.filter(lambda row: len(row["input_ids"]) > 1)
    entry = cache_root(experiment, run_dir) / _entries(experiment, run_dir)[0]
    assert list(entry.glob("train/cache-*.arrow")), "datasets wrote no cache file here"
    capsys.readouterr()
    prepared_data(experiment, tokenizer, preparation(experiment), run_dir, time.time(), {})
    out = capsys.readouterr().out
    assert "data loaded from the cache" in out and "damaged" not in out, out
    (entry / "train" / "cache-x.json").write_text("{}")  # only datasets' own are passed over
    assert entry_problem(entry) == f"train/cache-x.json is not listed in {META}"


KILLED_WRITER = """
import os
import signal
import sys
from pathlib import Path
from datasets import Dataset
from finetune.data.load import Splits
from finetune.data.prepare import _save

class KilledWhileSaving:  # the second part's save is where the writer dies
    def save_to_disk(self, path):
        os.kill(os.getpid(), signal.SIGKILL)

rows = Dataset.from_dict({"input_ids": [list(range(512))] * 2000})
_save(Splits(train=rows, eval=KilledWhileSaving(), format="text"), Path(sys.argv[1]))
"""


@pytest.mark.slow
def test_a_writer_killed_mid_write_leaves_nothing_after_the_next_run(config, tmp_path, capsys,
                                                                     waiters):
    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    experiment = load_experiment(config)
    tokenizer = load_tokenizer(experiment)
    root = cache_root(experiment, run_dir)
    entry = root / cache_key(experiment, tokenizer)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(entry)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    [left] = list(root.iterdir())
    size = sum(f.stat().st_size for f in left.rglob("*") if f.is_file())
    assert left.name.startswith(f".{entry.name}.") and "@" in left.name and size > 2**20
    # A live writer's staging directory (another run preparing the same data) stays.
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    waiters.append(live)
    working = root / f".{entry.name}.{live.pid}@{socket.gethostname()}.abc123"
    working.mkdir()
    prepared_data(experiment, tokenizer, preparation(experiment), run_dir, time.time(), {})
    out = capsys.readouterr().out
    assert f"removed {left}, left by a data preparation that did not finish" in out
    assert not left.exists() and working.exists()
    assert sorted(p.name for p in root.iterdir()) == sorted([entry.name, working.name])


@pytest.mark.slow
def test_an_unreadable_entry_file_is_damage_not_a_traceback(config, tmp_path):
    """A file this user cannot read (another user's cache, a wrong umask) is damage: the
    entry is prepared again. As root, a read is refused only to another user."""
    cache = Path(tempfile.mkdtemp(prefix="finetune-cache-"))  # not under root's 0700 tmp
    try:
        cache.chmod(0o777)
        experiment = load_experiment(config, [f"data.cache_dir={cache}"])
        prepared_data(experiment, load_tokenizer(experiment), preparation(experiment),
                      tmp_path, time.time(), {})
        [entry] = [p for p in cache.iterdir() if (p / META).exists()]
        for path in [entry, *entry.rglob("*")]:  # readable to all (mkdtemp made it 0700)...
            path.chmod(0o755 if path.is_dir() else 0o644)
        (entry / "train" / "state.json").chmod(0)  # ...but this one file
        if os.geteuid() != 0:
            problem = entry_problem(entry)
        else:
            if shutil.which("setpriv") is None:
                pytest.skip("root without setpriv: no user to whom the file is unreadable")
            code = str(Path(finetune.__file__).parent.parent)  # the finetune under test
            check = (f"import sys; sys.path.insert(0, {code!r}); from pathlib import Path; "
                     "from finetune.data.prepare import entry_problem; "
                     f"print(entry_problem(Path({str(entry)!r})))")
            problem = subprocess.run(
                ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                 sys.executable, "-c", check], capture_output=True, text=True, timeout=120,
                cwd="/").stdout.strip()
        assert problem.startswith("cannot be read (PermissionError"), problem
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def test_an_edit_that_keeps_size_and_mtime_is_another_entry(config, tmp_path, capsys):
    """cp -p, rsync -t and touch -r keep size and mtime: the key holds the content."""
    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    experiment = load_experiment(config)
    tokenizer = load_tokenizer(experiment)
    first = prepared_data(experiment, tokenizer, preparation(experiment), run_dir, time.time(), {})
    data = tmp_path / "train.jsonl"
    stat = data.stat()
    data.write_text(data.read_text().replace('"q 3"', '"a 3"'))
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert data.stat().st_size == stat.st_size and data.stat().st_mtime_ns == stat.st_mtime_ns
    capsys.readouterr()
    again = prepared_data(experiment, tokenizer, preparation(experiment), run_dir, time.time(), {})
    assert "data prepared and cached" in capsys.readouterr().out
    assert len(_entries(experiment, run_dir)) == 2
    tokens = lambda splits: sorted([*splits.train["input_ids"], *splits.eval["input_ids"]])
    assert tokens(again) != tokens(first)  # trained on the file as it is now


def test_a_cache_that_cannot_be_written_is_one_error(config, tmp_path):
    """A cache_dir that is a file (as a read-only or full file system would) stops with
    the entry and the two settings that help, not a traceback."""
    (tmp_path / "afile").write_text("x")
    experiment = load_experiment(config, [f"data.cache_dir={tmp_path / 'afile'}"])
    with pytest.raises(RunError, match=r"cannot write the data cache entry .*afile.*"
                                       r"data\.cache: false"):
        prepared_data(experiment, load_tokenizer(experiment), preparation(experiment),
                      tmp_path / "runs" / "a", 0.0)


def test_a_picture_changed_in_place_makes_the_entry_out_of_date(tmp_path, capsys):
    """The key hashes the data file, not the pictures its rows name: each picture is
    stamped in the entry, and one changed or broken since is seen at the next run."""
    from conftest import QUICKSTART
    from finetune.errors import DataError
    from finetune.model.tokenizer import load_processor

    pictures = QUICKSTART / "data" / "vlm_train"
    for name in ("0000.png", "0001.png"):
        shutil.copy(pictures / name, tmp_path / name)
    rows = [{"messages": [{"role": "user", "content": [{"type": "image"},
                                                      {"type": "text", "text": "Color?"}]},
                          {"role": "assistant", "content": "red"}],
             "images": [f"000{i % 2}.png"]} for i in range(4)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "exp.yaml").write_text(
        f"method: sft\nmodel: {{name_or_path: {QUICKSTART / 'tiny-vlm'}, init: random}}\n"
        f"data: {{train: {tmp_path / 'rows.jsonl'}}}\n")
    experiment = load_experiment(tmp_path / "exp.yaml")
    processor, run_dir = load_processor(experiment), tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    prepare = lambda: prepared_data(experiment, processor, preparation(experiment), run_dir,
                                    time.time(), {})
    prepare()
    prepare()
    assert "data loaded from the cache" in capsys.readouterr().out
    shutil.copy(pictures / "0002.png", tmp_path / "0001.png")  # another picture, same name
    assert len(prepare().train) == 4
    out = capsys.readouterr().out
    assert f"is out of date (picture {tmp_path / '0001.png'} changed since it was cached); " \
           "preparing it again" in out, out
    prepare()
    assert "data loaded from the cache" in capsys.readouterr().out
    (tmp_path / "0000.png").write_text("no longer a picture\n")
    with pytest.raises(DataError, match=r"images\[0\] '0000.png': not an image"):
        prepare()
