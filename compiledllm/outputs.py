"""Output files that survive failed, interrupted and concurrent runs (README "What is never overwritten").

* `check_output` refuses, before any work, an output that is a directory, an input of the same run (the recipe,
  its prompts file, the model directory), or whose summary path is a directory.
* `ResultSink` writes results to a temporary file beside the target as each request ends and renames it (sorted into
  prompt order, with its summary) into place only when the run ends, so a failed run leaves the previous results
  and summary as they were. An
  interrupted run keeps what finished as `<stem>.partial<suffix>` (with its summary) and says so. An exclusive lock
  on `.<target>.lock` (flock: released by the kernel when the process dies) makes a second run on the same output
  a one-line error instead of two runs interleaving. The run removes the lock file when it releases it (a killed
  run leaves it; the next run takes it over). Deleting a lock file could let two runs lock different files (one the
  removed file, opened just before its removal, the other a new one), so a run that has taken the lock checks that
  the file it locked is still the one at the path, and otherwise opens the new one and tries again.
* `write_atomic` writes a whole file (an eval report, a profile) the same way.
"""
from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from compiledllm.errors import UserError


def summary_path(output: Path) -> Path:
    return output.with_suffix(".summary.json")


def partial_path(output: Path) -> Path:
    return output.with_name(f"{output.stem}.partial{output.suffix}")


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def check_output(output: Path, inputs: list[Path], what: str = "output") -> None:
    """One-line errors for an output that cannot be written without losing something."""
    for path in (output, summary_path(output)):
        if path.is_dir():
            raise UserError(f"{what}: {path} is a directory; name a file")
    for inp in inputs:
        if _same(output, inp) or _same(summary_path(output), inp):
            raise UserError(f"{what}: {output} is also an input of this run ({inp}); name another file")
        if inp.is_dir() and output.exists() and inp.resolve() in output.resolve().parents:
            raise UserError(f"{what}: {output} is a file of the model directory {inp}; name another file")
    if output.parent.exists() and not output.parent.is_dir():
        raise UserError(f"{what}: {output.parent} is not a directory")


def _write_text(path: Path, text: str, what: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"{what}: cannot write {path} ({e.strerror})") from None


def write_atomic(path: Path, text: str, what: str = "output") -> None:
    """The whole file, via a temporary file renamed into place (never a half-written file under `path`)."""
    if path.is_dir():
        raise UserError(f"{what}: {path} is a directory; name a file")
    _write_text(path, text, what)


class ResultSink:
    """JSON lines into a temporary file, committed (with the summary) by rename; see the module docstring."""

    def __init__(self, output: Path):
        self.output = output
        self.count = 0
        self._lock_path = output.with_name(f".{output.name}.lock")
        self._lock = _lock(self._lock_path, output)
        self._tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
        self._file = open(self._tmp, "w")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # an interrupted run keeps every line that finished
        self.count += 1

    def commit(self, summary: dict) -> Path:
        """Results (in prompt order) and summary into place; returns the results path."""
        return self._finish(self.output, summary)

    def keep_partial(self, summary: dict) -> Path:
        """After an interruption: what finished, under <stem>.partial<suffix> (the previous results untouched)."""
        return self._finish(partial_path(self.output), summary)

    def _finish(self, path: Path, summary: dict) -> Path:
        """Lines were written as requests ended (completion order, so nothing finished is lost); the file put in
        place holds them in prompt order (`index`)."""
        self._file.close()
        lines = self._tmp.read_text().splitlines()
        self._tmp.write_text("".join(line + "\n" for line in sorted(lines, key=lambda s: json.loads(s)["index"])))
        _write_text(summary_path(path), json.dumps(summary, indent=2) + "\n", "output")
        os.replace(self._tmp, path)
        self._release()
        return path

    def discard(self) -> None:
        """After a failure: nothing of this run is left; the previous results stay as they were."""
        self._file.close()
        self._tmp.unlink(missing_ok=True)
        self._release()

    def _release(self) -> None:
        """Remove the lock file, then unlock: a run waiting on the removed file sees that it is gone (_lock)."""
        try:
            if _same_file(self._lock, self._lock_path):
                self._lock_path.unlink()
        except OSError:
            pass  # a lock file that cannot be removed only stays behind, as a killed run's does
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()


def _same_file(f, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(f.fileno())
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


def _lock(path: Path, output: Path):
    """The open, exclusively locked lock file at `path`; a one-line error while another run holds it."""
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(path, "a")
        except OSError as e:
            raise UserError(f"output: cannot write {output} ({e.strerror})") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            raise UserError(f"output: {output} is being written by another run (it holds {path.name}); "
                            "wait for it or name another output") from None
        if _same_file(f, path):
            return f
        f.close()  # the run that held it removed it on release (after this open): lock the file there now
