"""Output files that survive failed, interrupted and concurrent runs (README "What is never overwritten").

* `check_outputs` refuses, before any work, every file a command would write that is a directory, an input of the
  same command (the recipe, its prompts or task files, a file of the model directory), another of its outputs
  (`bench --out X --plot X`), in a directory that cannot be written, or whose name (or the temporary file's beside
  it) is longer than the filesystem allows.
* `write_files` writes whole files (an eval report and its chart, a bench report and its plot) to temporaries beside
  them and renames them into place together: a failure (a full disk included) leaves the previous files and no
  temporary.
* `ResultSink` writes results to a temporary file beside the target as each request ends and renames it (sorted into
  prompt order, with its summary) into place only when the run ends, so a failed run leaves the previous results
  and summary as they were. An interrupted run keeps what finished as `<stem>.partial<suffix>` (with its summary).
* `OutputLock`: an exclusive lock on `.<target>.lock` (flock: released by the kernel when the process dies) makes a
  second command on the same output (run, eval, bench) a one-line error instead of two writers interleaving. The
  lock file is removed on release (a killed command leaves it; the next one takes it over). Deleting a lock file
  could let two commands lock different files (one the removed file, opened just before its removal, the other a
  new one), so a command that has taken the lock checks that the file it locked is still the one at the path, and
  otherwise opens the new one and tries again.
Temporaries and lock files are registered with signals.py, so that a second stop signal's immediate exit removes them.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from compiledllm import signals
from compiledllm.errors import UserError

Content = str | Callable[[Path], None]  # text, or a function that writes the file at the path it is given


def summary_path(output: Path) -> Path:
    return output.with_suffix(".summary.json")


def partial_path(output: Path) -> Path:
    return output.with_name(f"{output.stem}.partial{output.suffix}")


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def temporary(path: Path) -> Path:
    """Where a file (or folder: an export) is written before it is renamed to `path`: `.<name>.<pid>.tmp` beside
    it, as every output here."""
    return _tmp(Path(os.path.abspath(path)))


def _lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


def _key(path: Path) -> Path:
    try:
        return path.resolve()
    except OSError:
        return Path(os.path.abspath(path))


def _same(a: Path, b: Path) -> bool:
    return _key(a) == _key(b)


def _why(e: OSError) -> str:
    return e.strerror or str(e)


def check_outputs(outputs: list[tuple[str, Path]], inputs: list[Path]) -> None:
    """One-line errors, before any work, for outputs (what, path) that cannot all be written without losing
    something (module docstring)."""
    seen: dict[Path, str] = {}
    for what, path in outputs:
        _check_place(path, what)  # first: a name too long for the filesystem fails every other look at it
        if path.is_dir():
            raise UserError(f"{what}: {path} is a directory; name a file")
        for inp in inputs:
            if _same(path, inp):
                raise UserError(f"{what}: {path} is also an input of this run ({inp}); name another file")
            if inp.is_dir() and path.exists() and _key(inp) in _key(path).parents:
                raise UserError(f"{what}: {path} is a file of the model directory {inp}; name another file")
        if _key(path) in seen:
            raise UserError(f"{what}: {path} is also this command's {seen[_key(path)]}; name another file")
        seen[_key(path)] = what


def _exists(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError:  # missing, or a name too long to look up (found below)
        return False
    return True


def _check_place(path: Path, what: str) -> None:
    """The parent is (or can become) a writable directory, and every new name (the temporary file's, the longest,
    for the file) fits the filesystem."""
    full = Path(os.path.abspath(path))
    base, new = full.parent, [full.name]
    while not _exists(base):
        new.insert(0, base.name)
        base = base.parent
    if not base.is_dir():
        raise UserError(f"{what}: {base} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UserError(f"{what}: cannot write {path} ({base} is not writable)")
    limit, longest = _pathconf(base, "PC_NAME_MAX", 255), _pathconf(base, "PC_PATH_MAX", 4096)
    extra = len(_tmp(full).name) - len(full.name)
    for i, part in enumerate(new):
        room, size = limit - (extra if i == len(new) - 1 else 0), len(os.fsencode(part))
        if size > room:
            short = part if len(part) <= 40 else f"{part[:20]}...{part[-12:]}"
            raise UserError(f"{what}: {path}: the name {short!r} is {size} bytes, longer than the {room} this "
                            "filesystem allows here")
    if len(os.fsencode(str(_tmp(full)))) >= longest:
        raise UserError(f"{what}: {path}: the path is longer than the {longest - extra - 1} bytes this filesystem "
                        "allows")


def check_folder(path: Path, what: str) -> None:
    """For a command that writes a folder (export, profile): before any work, one line where it cannot be made or
    written, or where its name (or its temporary's, `temporary`) is longer than the filesystem allows."""
    _check_place(path, what)


def _pathconf(path: Path, name: str, default: int) -> int:
    try:
        return os.pathconf(path, name)
    except (OSError, ValueError):
        return default


def check_output(output: Path, inputs: list[Path], what: str = "output") -> None:
    """check_outputs for one output and its summary file."""
    check_outputs([(what, output), (f"{what} summary", summary_path(output))], inputs)


def run_outputs(output: Path) -> list[tuple[str, Path]]:
    """Every file `run` may write for `output` (results, summary, and both kept by an interruption)."""
    partial = partial_path(output)
    return [("output", output), ("output summary", summary_path(output)), ("partial output", partial),
            ("partial output summary", summary_path(partial))]


def _open(path: Path):
    return open(path, "w", encoding="utf-8")


def _write(tmp: Path, content: Content) -> None:
    if callable(content):
        content(tmp)
        return
    with _open(tmp) as f:
        f.write(content)


def write_files(files: list[tuple[str, Path, Content]]) -> None:
    """Each (what, path, content) to a temporary beside `path`, then all renamed into place; on any failure the
    previous files stay and no temporary is left (a one-line error for an OSError, naming `what` and the file)."""
    if not files:
        return
    tmps = [_tmp(path) for _, path, _ in files]

    def remove() -> None:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)

    what, path = files[0][:2]
    with signals.on_exit_now(remove):
        try:
            for (what, path, content), tmp in zip(files, tmps):
                path.parent.mkdir(parents=True, exist_ok=True)
                _write(tmp, content)
            with signals.atomic():
                for (what, path, _), tmp in zip(files, tmps):
                    os.replace(tmp, path)
        except OSError as e:
            raise UserError(f"{what}: cannot write {path} ({_why(e)})") from None
        finally:
            remove()


def write_atomic(path: Path, text: str, what: str = "output") -> None:
    """The whole file, via a temporary file renamed into place (never a half-written file under `path`)."""
    if path.is_dir():
        raise UserError(f"{what}: {path} is a directory; name a file")
    write_files([(what, path, text)])


class OutputLock:
    """The exclusive lock on `.<name>.lock` beside `output` (module docstring); a one-line error while another
    command holds it."""

    def __init__(self, output: Path, what: str = "output"):
        self.path = _lock_path(output)
        self._file = _lock(self.path, output, what)
        signals.register(self.remove)

    def remove(self) -> None:
        """The lock file, if it is still the one this lock holds (a killed command's is taken over)."""
        try:
            if _same_file(self._file, self.path):
                self.path.unlink()
        except OSError:
            pass  # a lock file that cannot be removed only stays behind, as a killed command's does

    def release(self) -> None:
        """Remove the lock file, then unlock: a command waiting on the removed file sees that it is gone (_lock)."""
        signals.forget(self.remove)
        self.remove()
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def locked(outputs: list[tuple[str, Path]]) -> Iterator[None]:
    """Every output (what, path) locked until the block ends."""
    with contextlib.ExitStack() as stack:
        for what, path in outputs:
            stack.enter_context(OutputLock(path, what))
        yield


class ResultSink:
    """JSON lines into a temporary file, committed (with the summary) by rename; see the module docstring."""

    def __init__(self, output: Path):
        self.output = output
        self.count = 0
        self._lock = OutputLock(output)
        self._tmp = _tmp(output)
        try:
            self._file = _open(self._tmp)
        except OSError as e:
            self._lock.release()
            raise UserError(f"output: cannot write {output} ({_why(e)})") from None
        signals.register(self._remove)

    def write(self, record: dict) -> None:
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()  # an interrupted run keeps every line that finished
        except OSError as e:
            raise UserError(f"output: cannot write {self.output} ({_why(e)})") from None
        self.count += 1

    def commit(self, summary: dict) -> Path:
        """Results (in prompt order) and summary into place; returns the results path."""
        return self._finish(self.output, summary)

    def keep_partial(self, summary: dict) -> Path:
        """After an interruption: what finished, under <stem>.partial<suffix> (the previous results untouched)."""
        return self._finish(partial_path(self.output), summary)

    def _finish(self, path: Path, summary: dict) -> Path:
        """Lines were written as requests ended (completion order, so nothing finished is lost); the file put in
        place holds them in prompt order (`index`). Any failure discards this run's files."""
        try:
            self._file.close()
            with open(self._tmp, encoding="utf-8") as f:
                lines = sorted(f.read().splitlines(), key=lambda s: json.loads(s)["index"])
            write_files([("output", path, "".join(line + "\n" for line in lines)),
                         ("output", summary_path(path), json.dumps(summary, indent=2) + "\n")])
        except OSError as e:
            raise UserError(f"output: cannot write {path} ({_why(e)})") from None
        finally:
            self.discard()
        return path

    def discard(self) -> None:
        """After a failure: nothing of this run is left; the previous results stay as they were."""
        with contextlib.suppress(OSError):
            self._file.close()
        self._remove()
        signals.forget(self._remove)
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _remove(self) -> None:
        self._tmp.unlink(missing_ok=True)


def _same_file(f, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(f.fileno())
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


def _lock(path: Path, output: Path, what: str):
    """The open, exclusively locked lock file at `path`."""
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(path, "a")
        except OSError as e:
            raise UserError(f"{what}: cannot write {output} ({_why(e)})") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            f.close()
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise UserError(f"{what}: cannot lock {path} ({_why(e)})") from None
            raise UserError(f"{what}: {output} is being written by another run (it holds {path.name}); "
                            "wait for it or name another output") from None
        if _same_file(f, path):
            return f
        f.close()  # the command that held it removed it on release (after this open): lock the file there now
