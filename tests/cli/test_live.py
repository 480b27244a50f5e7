"""What `compiledllm run` shows while it decodes (compiledllm/live.py): each request's text, streamed a block at a
time on a terminal and printed whole off one, and a bar of generated tokens."""
from __future__ import annotations

import io

import pytest
from rich.console import Console

from compiledllm.live import RunDisplay
from compiledllm.recipe import load_recipe
from compiledllm.runner import execute


@pytest.fixture(scope="module")
def run_blocks():
    """The quickstart recipe (48 new tokens) with every block event and result recorded."""
    rec = load_recipe("recipes/quickstart.yaml", ["generation.max_new_tokens=48"])
    events = []
    results, _ = execute(rec, on_block=lambda i, t: events.append(("block", i, list(t))),
                         on_result=lambda r: events.append(("result", r.index, r)))
    return results, events


def test_run_reports_each_block_as_it_is_retired(run_blocks):
    results, events = run_blocks
    for r in results:
        blocks = [t for kind, i, t in events if kind == "block" and i == r.index]
        assert len(blocks) >= 2 and sum(blocks, []) == r.output_ids  # block by block, adding up to the output
        last_block = max(k for k, e in enumerate(events) if e[:2] == ("block", r.index))
        assert events.index(("result", r.index, r)) > last_block  # the result after its blocks


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_the_display_shows_every_result_text(run_blocks, terminal):
    results, events = run_blocks
    from compiledllm import load_model

    tok = load_model("tiny-llada2").tokenizer
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=terminal, width=120, color_system=None)
    with RunDisplay(console, tok, len(results), 48) as display:
        for kind, i, x in events:
            display.on_block(i, x) if kind == "block" else display.on_result(x)
        assert display.bar.tasks[0].completed == sum(len(r.output_ids) for r in results)
    out = buf.getvalue()
    for r in results:
        assert f"prompt {r.index}" in out
        for line in r.text.strip().splitlines()[:3]:
            assert line.strip()[:40] in out
    assert ("decoding)" in out) == terminal  # the growing text of unfinished requests only on a terminal
