"""Hostile and careless experiment files and overrides (issue 13): every one is exit 0 or
exit 2 with `error:` lines naming file, line and YAML path, within a budget the error
names (nodes, files, values: never a clock), never a traceback; no secret is echoed. (Values training would refuse: test_rules.py.)"""

from __future__ import annotations

import pytest

from conftest import MINIMAL_SFT as BASE, DATA, TINY_MODEL, run_cli
from config_errors import refused


BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n"
    for i in range(8))

FILES = {
    # name: (file text, what the error says)
    "non_string_key_in_training": (BASE + "training:\n  1: 2\n", ":8: "),
    "complex_key": (BASE + "training:\n  ? [a]\n  : 1\n", "a key must be text"),
    "deep_nesting": (BASE + "x: " + "[" * 5000 + "]" * 5000 + "\n", "nested"),
    "nesting_past_the_limit": (BASE + "x: " + "[" * 100 + "]" * 100 + "\n", "nested more"),
    "recursive_alias": (BASE + "training: &t\n  x: *t\n", "recursive alias"),
    "recursive_list_alias": (BASE + "x: &a [*a]\n", "recursive alias"),
    "alias_bomb": (BASE + BOMB, "expands to more than"),
    "many_values": (BASE + "x: [" + "1, " * 30_000 + "]\n", ":7: more than 20,000 values"),
    "multi_mb_scalar": (BASE + "name: " + "x" * 5_000_000 + "\n", "the most an experiment"),
    "method_list": (BASE.replace("method: sft", "method: [sft]"), "method"),
    "int_tag_overflow": (BASE + 'training:\n  seed: !!int "1e400"\n', ":8:9: YAML value error"),
    "bad_timestamp": (BASE + 'training:\n  seed: !!timestamp "x"\n', "cannot be read as timestamp"),
    "python_tag": (BASE + "training:\n  seed: !!python/name:os.system\n", ":8:"),
    "extends_unknown_user": ("extends: ~nosuchuser/x.yaml\n" + BASE, "no such experiment"),
    "extends_nul": ('extends: "a\\0b.yaml"\n' + BASE, "NUL"),
    "extends_long_component": (f"extends: {'x' * 300}.yaml\n" + BASE, "longer than 255"),
    "extends_not_a_string": ("extends: {a: 1}\n" + BASE, "extends"),
    "model_path_nul": (BASE.replace(str(TINY_MODEL), '"./a\\0b"'), "model.name_or_path"),
    "data_path_long": (BASE.replace(f"{DATA}/sft_train.jsonl", "./" + "y" * 300),
                       "data.train[0].path"),
    "model_unknown_user": (BASE.replace(str(TINY_MODEL), "~nosuchuser/m"), "no such user"),
    "huge_int_for_a_float": (BASE + f"training:\n  learning_rate: 1{'0' * 400}\n",
                             "training.learning_rate: a number of 401 digits is too large"),
    "huge_int_steps": (BASE + f"training:\n  max_steps: 1{'0' * 30}\n",
                       "training.max_steps: must fit in 64 bits"),
    "huge_length": (BASE + "training:\n  max_length: 99999999999\n",
                    "training.max_length: must be at most 2,147,483,647"),
    "infinite_section_float": (BASE + "peft: {type: lora, alpha: .inf}\n", "peft.alpha"),
    "too_many_machines": (BASE + "distributed: {num_machines: 4294967296}\n",
                          "distributed.num_machines"),
    "long_revision": (BASE + f"model: {{revision: {'a' * 300}}}\n", "model.revision: not a"),
    "nvme_path_newline": (BASE + 'distributed: {strategy: deepspeed, deepspeed: {'
                          'offload_optimizer: nvme, nvme_path: "/a\\nb"}}\n',
                          "nvme_path: contains the control character"),
}


@pytest.mark.parametrize("name", FILES)
def test_hostile_files(capsys, write, name):
    text, expected = FILES[name]
    path = write("exp.yaml", text)
    message = refused(capsys, path)
    assert expected in message and str(path) in message


def test_not_utf8_names_the_line(capsys, tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_bytes(BASE.encode() + b"name: caf\xe9\n")
    assert f"{path}:7: not UTF-8" in refused(capsys, path)


def test_nul_byte_in_file(capsys, tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_bytes(BASE.encode() + b"name: a\x00b\n")
    assert "NUL byte" in refused(capsys, path)


def test_extends_symlink_loops(capsys, write, tmp_path):
    """A link to itself, links to each other (ELOOP: pathlib says missing), and a file
    extended through a link to itself: each named as written, the links shown."""
    self_link, a, b = (tmp_path / name for name in ("self.yaml", "a.yaml", "b.yaml"))
    self_link.symlink_to(self_link)
    exp = write("exp.yaml", "extends: self.yaml\n" + BASE)
    assert refused(capsys, exp) == \
        f"error: {exp}: extends: {self_link}: a symlink loop: {self_link} -> {self_link}"
    a.symlink_to(b)
    b.symlink_to(a)
    assert refused(capsys, a) == f"error: {a}: a symlink loop: {a} -> {b} -> {a}"
    a.unlink()
    a.write_text("extends: b.yaml\n" + BASE)
    assert refused(capsys, a) == f"error: {a}: extends: loop: {a} -> {b} -> {a}"


OVERRIDES = {
    "yaml_error": ("training.learning_rate={", "override"),
    "undefined_alias": ("training.learning_rate=*alias", "override"),
    "python_tag": ("training.learning_rate=!!python/name:os.system", "override"),
    "unicode_digit_key": ("data.train.²=x", "data.train"),
    "arabic_digit_key": ("data.train.٣.path=x", "data.train"),
    "int_key_in_training": ("training.1=2", "training[1]: a key must be text"),
    "deep_value": ("training.seed=" + "[" * 3000, "override"),
    "long_value_is_shortened": ("training.seed=" + "1" * 5000, "(5,014 characters)"),
}


@pytest.mark.parametrize("name", OVERRIDES)
def test_hostile_overrides(capsys, write, name):
    override, expected = OVERRIDES[name]
    assert expected in refused(capsys, write("exp.yaml", BASE), override)


SECRET = "pa55w0rdXYZ"


@pytest.mark.parametrize("text, overrides", [
    (BASE.replace(f"{DATA}/sft_train.jsonl", f"https://user:{SECRET}@example.com/d.jsonl"), ()),
    (BASE.replace(str(TINY_MODEL), f"https://u:{SECRET}@example.com/m"), ()),
    (BASE, (f"model.name_or_path=https://u:{SECRET}@host/x y",)),
    (BASE + f"training:\n  hub_token: [{SECRET}]\n", ()),
    (BASE + f"training:\n  hub_token: {{t: {SECRET}}}\n", ()),
    (BASE, (f"training.hub_token=[{SECRET}",)),
    (BASE, (f"training.hub_token=!!int {SECRET}",)),
    (BASE + f'training:\n  hub_token: !!int "{SECRET}"\n', ()),
    (BASE, (f"training.hub_token:{SECRET}",)),  # = mistyped
    (BASE, (f"distributed.deepspeed.nvme_path=https://u:{SECRET}@host/x",)),
    (BASE, (f"training.hub_model_id=https://u:{SECRET}@host/x",)),
    (BASE, (f"output.dir=https://u:{SECRET}@host/x",)),
    (BASE, (f"data.weight_column=ftp://u:{SECRET}@host",)),
])
def test_secrets_are_not_echoed(capsys, write, text, overrides):
    message = refused(capsys, write("exp.yaml", text), *overrides)
    assert SECRET not in message


@pytest.mark.slow
def test_subprocess_alias_bomb_and_yaml_override(write):
    path = write("exp.yaml", BASE + BOMB)
    result = run_cli("validate", str(path), cwd=path.parent, timeout=60)  # a hang, not a clock
    assert result.returncode == 2 and "expands to more than" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_cli("validate", str(write("ok.yaml", BASE)), "training.learning_rate={",
                     cwd=path.parent, timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("error: override")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("text", [
    BASE + 'name: "abc\\n"\n',
    BASE.replace(f"{DATA}/sft_train.jsonl", '"org/data\\n"'),
    BASE.replace(str(TINY_MODEL), '"org/model\\n"'),
])
def test_trailing_newline_does_not_pass_a_pattern(capsys, write, text):
    refused(capsys, write("exp.yaml", text))


def test_keys_and_values_with_newlines_stay_one_line(capsys, write):
    path = write("exp.yaml", BASE + '"a\\nb": 1\ntraining:\n  "x\\ny": 2\n')
    message = refused(capsys, path, "training.c\nd=1", "model.name_or_path=e\nf")
    assert "'a\\nb': unknown key" in message and "training.'x\\ny'" in message


def test_long_keys_and_values_are_named_by_their_start_and_length(capsys, write):
    long = "k" * 10_000
    path = write("exp.yaml", BASE + f"? {long}\n: 1\nevaluaton: {{}}\ntraining:\n"
                 f"  ? {long}\n  : 1\n  optim: {long}\n  max_steps: {long}\n")
    message = refused(capsys, path, f"model.{long}=1", f"model.attn_implementation={long}")
    assert "k" * 200 not in message and message.count("(10,00") == 6, message
    assert "evaluaton: unknown key, did you mean evaluation?" in message


def _chain(tmp_path, levels: int, fan: int) -> None:
    """b0.yaml extends b1.yaml `fan` times, and so on: read naively, fan**levels files."""
    for level in range(levels):
        (tmp_path / f"b{level}.yaml").write_text(
            f"extends: [{', '.join([f'b{level + 1}.yaml'] * fan)}]\n")
    (tmp_path / f"b{levels}.yaml").write_text("{}\n")


def test_extends_fan_out_is_bounded(capsys, tmp_path):
    _chain(tmp_path, 5, 10)
    path = tmp_path / "exp.yaml"
    path.write_text("extends: b0.yaml\n" + BASE)
    assert "more than 64 experiment files read" in refused(capsys, path)


@pytest.mark.slow
def test_overrides_share_the_experiment_value_budget(capsys, write):
    many = "[" + ",".join(["1"] * 19_000) + "]"
    message = refused(capsys, write("exp.yaml", BASE), *[f"x.a{i}={many}" for i in range(15)])
    # The second override is refused: the first spent what the experiment may hold.
    assert "override 'x.a1=" in message and "left of the experiment's 20,000" in message
