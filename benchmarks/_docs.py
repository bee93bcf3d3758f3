"""``--write-docs``: a benchmark's printed table goes into ``docs/benchmarks.md``, dated
and with its command, so a figure there is changed by running its benchmark, not by
hand.

    python benchmarks/planning.py --meshes 2x2 --write-docs

Everything the run prints on stdout (its worlds' processes too: they inherit the file
descriptor) is captured, still shown, and written between the markers
``<!-- benchmark:NAME -->`` and ``<!-- /benchmark:NAME -->`` of the page (replaced where
they are, else appended under "Written by the benchmarks").
"""
from __future__ import annotations

import contextlib
import datetime
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

PAGE = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
HEADING = "## Written by the benchmarks (`--write-docs`)"
FLAG = "--write-docs"


@contextlib.contextmanager
def docs_section(name: str, page: Path = PAGE) -> Iterator[None]:
    """Inside: the benchmark's run. With ``--write-docs`` among the arguments (taken out
    of ``sys.argv`` so the script's own parser never sees it), its stdout is captured
    and written to ``page`` as the section ``name``; without it, nothing changes."""
    if FLAG not in sys.argv[1:]:
        yield
        return
    sys.argv = [a for a in sys.argv if a != FLAG]
    if os.environ.get("RANK", "0") != "0":   # under a launcher: rank 0 writes
        yield
        return
    command = "python " + shlex.join([os.path.relpath(sys.argv[0], page.parents[1])] + sys.argv[1:])
    with tempfile.TemporaryFile(mode="w+b") as captured:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(captured.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            sys.stdout.write(text)
            sys.stdout.flush()
    write_section(page, name, command, text)
    print(f"written to {page} (section {name})")


def section_text(name: str, command: str, output: str, when: datetime.date, commit: str) -> str:
    """The section as the page holds it."""
    lines = [line for line in output.splitlines() if "ProcessGroup.hpp" not in line]
    return (f"<!-- benchmark:{name} -->\n"
            f"### `{command}` ({when.isoformat()}, commit {commit})\n\n"
            "```text\n" + "\n".join(lines).strip("\n") + "\n```\n"
            f"<!-- /benchmark:{name} -->\n")


def write_section(page: Path, name: str, command: str, output: str) -> None:
    """Put the section ``name`` into ``page``: where its markers are, else at the end
    under ``HEADING``."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=page.parent, check=False).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    section = section_text(name, command, output, datetime.date.today(), commit)
    text = page.read_text() if page.exists() else "# Benchmarks\n"
    begin, end = f"<!-- benchmark:{name} -->", f"<!-- /benchmark:{name} -->\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        if HEADING not in text:
            text = text.rstrip("\n") + f"\n\n{HEADING}\n\nEach section below is the output of its command, "\
                   "written by the benchmark itself.\n"
        text = text.rstrip("\n") + "\n\n" + section
    page.write_text(text)
