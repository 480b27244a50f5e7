"""The standard every user mistake meets on the CLI: exit code 2, one line starting "error:" that names what is
wrong, no traceback."""
from __future__ import annotations


def assert_user_error(result, *needles: str) -> None:
    """`result`: a typer CliRunner result; `needles`: what the line must name (file, key, value)."""
    out = result.output.strip()
    assert result.exit_code == 2, out
    assert "Traceback" not in out and (result.exception is None or isinstance(result.exception, SystemExit)), out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), out
    for n in needles:
        assert n in out, (n, out)
