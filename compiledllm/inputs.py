"""Input files read through one gate (issue 33 item 2): recipes, prompt files and task files are regular files only
(a FIFO, device or directory is refused by kind before it can block or never end), size-limited and UTF-8 checked;
YAML and JSON are parsed with their nesting depth, alias expansion and integer length bounded. So a hostile file
fails fast, in one line naming it (and the key), instead of hanging, exhausting memory or raising RecursionError."""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from compiledllm.errors import UserError

MAX_RECIPE_BYTES = 4 << 20   # a recipe is a few KiB: anything this large is the wrong file
MAX_LINES_BYTES = 256 << 20  # a prompts or task file (JSON lines): ~100k long prompts
MAX_DEPTH = 64               # levels of nesting; recipes and prompt lines use fewer than 10
MAX_INT_DIGITS = 100         # an integer's characters: ids, seeds and sizes have at most 20 (Python refuses 4300)
MAX_ALIAS_NODES = 100_000    # nodes YAML aliases may add to a document (a policy block reused, not a "billion laughs")
YAML12_FLOAT = re.compile(r"[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")  # 1e-3 is a float, as in YAML 1.2
_INT_TAG = "tag:yaml.org,2002:int"
_DIGITS = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))  # bytes.translate: every digit a 0, all else " "
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def _not_regular(path: Path, what: str, mode: int) -> UserError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return UserError(f"{path}: {what} is {kind}, not a regular file")


def check_file(path: Path, what: str) -> None:
    """`path` (after links) is an existing regular file: for a path that is read later (a UserError naming it)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UserError(f"{path}: {what} not found") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read {what} ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise _not_regular(path, what, mode)


def read_bytes(path: Path, what: str, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (models/config.read_limited's rules): opened without
    blocking (a plain open of a FIFO waits for a writer) and checked through the descriptor, so the file read is
    the one checked; at most limit + 1 bytes are read, whatever size the file reports."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise UserError(f"{path}: {what} not found") from None
    except OSError as e:
        check_file(path, what)  # a socket cannot be opened at all (ENXIO): name it by its kind where stat can
        raise UserError(f"{path}: cannot read {what} ({e.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # checked before fdopen, which refuses a directory with its own error
        os.close(fd)
        raise _not_regular(path, what, info.st_mode)
    with os.fdopen(fd, "rb") as f:
        try:
            data = b"" if info.st_size > limit else f.read(limit + 1)
        except OSError as e:
            raise UserError(f"{path}: cannot read {what} ({e.strerror})") from None
    if info.st_size > limit or len(data) > limit:
        raise UserError(f"{path}: {what} is larger than {limit >> 20} MiB; is it the right file?")
    return data


def read_text(path: Path, what: str, limit: int = MAX_LINES_BYTES) -> str:
    """The UTF-8 text of an input file (read_bytes); binary or non-UTF-8 content is a UserError naming the line."""
    data = read_bytes(Path(path), what, limit)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UserError(f"{path}:{line}: {what} is not UTF-8 text (byte {data[e.start]:#04x})") from None
    if "\0" in text:
        raise UserError(f"{path}: {what} is a binary file (it holds NUL bytes), not text")
    return text


def _label(index: Any) -> str | int | None:
    """A node's place in its parent, for errors: a sequence position or a mapping value's (scalar) key."""
    return index if isinstance(index, int) else index.value if isinstance(index, yaml.ScalarNode) else None


def _at(keys: list, problem: str) -> str:
    """`problem` after the dotted path of `keys` (shortened: a deep path is mostly repeats)."""
    path = ".".join(str(k) for k in keys if k is not None)
    return f"{path if len(path) <= 60 else path[:57] + '...'}: {problem}" if path else problem


class _Refused(yaml.MarkedYAMLError):
    """Well-formed YAML refused for what it holds (a bound passed, a duplicate key): said as is, not "malformed"."""


class _Loader(yaml.SafeLoader):
    """SafeLoader without YAML 1.1's guesses: a repeated key is an error, only true/false are booleans (yes, no,
    on, off stay strings, which a bool field then refuses), and 1e-3 is a float as in YAML 1.2. Bounded: nesting
    (the composer recurses per level), integer length (int() of 5000 digits raises ValueError) and the nodes that
    aliases add (a shared node is built once but validated and dumped once per use)."""

    yaml_implicit_resolvers = {first: [r for r in rs if r[0] != "tag:yaml.org,2002:bool"]
                               for first, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.keys: list = []  # the key (or index) of each node being composed, root first: errors name the key
        self.aliases = 0

    def refuse(self, problem: str, mark, keys: list) -> _Refused:
        return _Refused(None, None, _at(keys, problem), mark)

    def compose_node(self, parent, index):
        # index: a sequence position, the key node of a mapping value, None for a mapping key and the root
        self.keys.append(_label(index))
        try:
            if len(self.keys) > MAX_DEPTH:
                raise self.refuse(f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark, self.keys)
            self.aliases += self.check_event(yaml.AliasEvent)
            node = super().compose_node(parent, index)
            if node.tag == _INT_TAG and isinstance(node, yaml.ScalarNode) and len(node.value) > MAX_INT_DIGITS:
                raise self.refuse(f"an integer of {len(node.value)} digits (at most {MAX_INT_DIGITS})",
                                  node.start_mark, self.keys)
            return node
        finally:
            self.keys.pop()

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None and self.aliases:  # without aliases the composed tree is the document, already bounded
            memo: dict[int, tuple[int, int] | None] = {}
            nodes = self.expanded(node, [None], memo)[0]
            if nodes - len(memo) > MAX_ALIAS_NODES:
                raise self.refuse(f"aliases expand the document by {nodes - len(memo)} nodes (at most "
                                  f"{MAX_ALIAS_NODES})", node.start_mark, [])
        return node

    def expanded(self, node, keys: list, memo: dict) -> tuple[int, int]:
        """(nodes, levels) of `node` with every alias expanded; memoized per node, so this costs the composed
        graph's size however large the expansion, and recurses at most MAX_DEPTH levels."""
        if id(node) not in memo:
            memo[id(node)] = None  # in progress: met again below itself, it is a recursive alias
            nodes, levels = 1, 0
            children = ((kv for k, v in node.value for kv in ((None, k), (_label(k), v)))
                        if isinstance(node, yaml.MappingNode) else
                        enumerate(node.value) if isinstance(node, yaml.SequenceNode) else ())
            for key, child in children:
                keys.append(key)
                n, h = self.expanded(child, keys, memo)
                keys.pop()
                nodes, levels = nodes + n, max(levels, h)
            memo[id(node)] = (nodes, levels + 1)
        seen = memo[id(node)]
        if seen is None:
            raise self.refuse("a recursive alias (a node inside itself)", node.start_mark, keys)
        if len(keys) + seen[1] - 1 > MAX_DEPTH:
            raise self.refuse(f"nested deeper than {MAX_DEPTH} levels (aliases expanded)", node.start_mark, keys)
        return seen

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in seen:
                    raise _Refused(None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", YAML12_FLOAT, list("-+0123456789"))


def parse_yaml(text: str, where: str) -> Any:
    """YAML text -> data; a syntax error, a duplicate key or a bound passed is a UserError naming `where`, the key
    and the line."""
    loader = _Loader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        what = problem if isinstance(e, _Refused) else f"malformed YAML ({problem})"
        raise UserError(f"{where}: {what}" + (f" (line {mark.line + 1})" if mark is not None else "")) from None
    finally:
        loader.dispose()


class _LongInt:
    """An integer literal too long to convert, kept (as its length) until its key is known."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _check_json(value: Any, where: str, keys: list) -> None:
    if len(keys) >= MAX_DEPTH:
        raise UserError(f"{where}: {_at(keys, f'nested deeper than {MAX_DEPTH} levels')}")
    if isinstance(value, _LongInt):
        raise UserError(f"{where}: {_at(keys, f'an integer of {value.digits} digits (at most {MAX_INT_DIGITS})')}")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(item, (dict, list, _LongInt)):
            keys.append(key)
            _check_json(item, where, keys)
            keys.pop()


def parse_json(text: str, where: str) -> Any:
    """One JSON value (a line of a prompts or task file) with its nesting depth and integer lengths bounded; a
    problem is a UserError naming `where` (FILE:LINE) and the key."""
    long: list[int] = []

    def integer(digits: str) -> int | _LongInt:
        if len(digits) > MAX_INT_DIGITS:  # int() would raise ValueError past 4300 digits, and be slow before
            long.append(len(digits))
            return _LongInt(len(digits))
        return int(digits)

    # the hook (a Python call per integer: 3x slower) only where a run of digits is long enough (found at C speed)
    long_run = b"0" * (MAX_INT_DIGITS + 1) in text.encode("utf-8", "surrogatepass").translate(_DIGITS)
    try:
        value = json.loads(text, parse_int=integer if long_run else None)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: malformed JSON ({e.msg})") from None
    except RecursionError:  # json's C parser recurses per level: hundreds deep, this is past MAX_DEPTH
        raise UserError(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    # walked (in Python) only where a bound may be passed: the brackets counted bound the depth, at C speed
    if long or text.count("[") + text.count("{") >= MAX_DEPTH:
        _check_json(value, where, [])
    return value
