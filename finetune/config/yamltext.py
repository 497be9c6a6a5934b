"""Reading YAML text that may be hostile: bounded in size, nesting and alias expansion,
text keys only, and every failure a ConfigError naming the file (or override) and line.

yaml.safe_load alone is not enough: an alias bomb (a few lines whose aliases expand to
billions of nodes) is built in linear time as shared objects, but everything that walks
the result afterwards (merging, path resolution, validation) walks the expanded tree.
So the composed node graph is measured first, aliases counted as often as they are
used, and refused past MAX_NODES or MAX_DEPTH before anything is constructed.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from finetune.errors import ConfigError

# An experiment file is a few kB; an inline chat template a few more. The pure-Python
# scanner takes seconds for multi-MB scalars, so larger files are refused unread.
MAX_BYTES = 1024 * 1024
MAX_DEPTH = 64  # nesting of mappings and lists
MAX_NODES = 20_000  # scalars, mappings and lists, each alias counted where it is used


class Budget:
    """Values left to one experiment: its file, its bases and its overrides together."""

    def __init__(self, values: int = MAX_NODES):
        self.left = values

    def spend(self, values: int, where: str) -> None:
        self.left -= values
        if self.left < 0:
            raise ConfigError([f"{where}: the experiment (its files, their bases and the "
                               f"overrides together) holds more than {MAX_NODES:,} values"])


class Loader(yaml.SafeLoader):
    """SafeLoader that also reads 1e-4 as a float (YAML 1.1 needs a dot: 1.0e-4), and
    stops composing past `limit` nodes (the scanner is slow: ~10 us a token)."""

    composed = 0
    limit = MAX_NODES
    where = "<text>"

    def compose_node(self, parent, index):
        self.composed += 1
        if self.composed > self.limit:
            line = self.peek_event().start_mark.line + 1
            raise ConfigError([f"{self.where}:{line}: more than {self.limit:,} values"
                               + ("" if self.limit == MAX_NODES else
                                  f" left of the experiment's {MAX_NODES:,}")])
        return super().compose_node(parent, index)


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)

_STR = "tag:yaml.org,2002:str"


def _checked(construct):
    """A constructor that names the line of a value its tag cannot make (!!int "1e400",
    !!timestamp "x": ValueError, OverflowError or, from PyYAML, AttributeError), without
    repeating the value, which may be a secret."""

    def build(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
        try:
            return construct(loader, node)
        except (ValueError, OverflowError, AttributeError):
            raise yaml.constructor.ConstructorError(
                None, None, f"the value cannot be read as {node.tag.rpartition(':')[2]}",
                node.start_mark) from None

    return build


for _tag in ("int", "float", "bool", "timestamp", "binary", "null"):
    _full = f"tag:yaml.org,2002:{_tag}"
    Loader.add_constructor(_full, _checked(yaml.SafeLoader.yaml_constructors[_full]))


def decode(raw: bytes, where: str) -> str:
    if len(raw) > MAX_BYTES:
        raise ConfigError([f"{where}: more than {MAX_BYTES:,} bytes, the most an experiment "
                           "file may have"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError([f"{where}:{line}: not UTF-8 text (byte {exc.start}); save the "
                           "file as UTF-8"]) from None
    if "\0" in text:
        line = text[:text.index("\0")].count("\n") + 1
        raise ConfigError([f"{where}:{line}: contains a NUL byte; not a text file"])
    return text


def _measure(root: yaml.Node, where: str) -> int:
    """Refuse cycles (a recursive alias), deep nesting, too many expanded nodes and
    keys that are not text. Sizes are memoised per node, so this is linear in the
    document even when its expansion is exponential."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def refuse(node: yaml.Node, problem: str) -> ConfigError:
        return ConfigError([f"{where}:{node.start_mark.line + 1}: {problem}"])

    def size(node: yaml.Node, depth: int) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise refuse(node, "a recursive alias (a node that contains itself)")
        if depth > MAX_DEPTH:
            raise refuse(node, f"nested more than {MAX_DEPTH} levels deep")
        total = 1
        if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
            open_.add(key)
            for item in node.value:
                for child in (item if isinstance(node, yaml.MappingNode) else (item,)):
                    total += size(child, depth + 1)
                if isinstance(node, yaml.MappingNode) and \
                        not (isinstance(item[0], yaml.ScalarNode) and item[0].tag == _STR):
                    raise refuse(item[0], "a key must be text (quote it: \"1\": ...)")
                if total > MAX_NODES:
                    raise refuse(node, f"expands to more than {MAX_NODES:,} values "
                                       "(aliases counted where used)")
            open_.discard(key)
        sizes[key] = total
        return total

    return size(root, 0)


def compose(text: str, where: str, budget: Budget | None = None) -> tuple[yaml.Node | None, Any]:
    """The node graph (for line numbers) and the data of one YAML document; its values
    (aliases expanded) are taken from `budget`."""
    loader = None
    try:
        loader = Loader(text)  # checks the characters: a ReaderError for control codes
        loader.where = where
        if budget is not None:
            loader.limit = max(min(MAX_NODES, budget.left), 0)
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise ConfigError([f"{where}: nested too deeply to read"]) from None
        if node is None:
            return None, None
        values = _measure(node, where)
        if budget is not None:
            budget.spend(values, where)
        return node, loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        kind = "YAML value error" if isinstance(exc, yaml.constructor.ConstructorError) \
            else "YAML syntax error"
        raise ConfigError([f"{where}{line}: {kind}: {problem}"]) from None
    finally:
        if loader is not None:
            loader.dispose()
