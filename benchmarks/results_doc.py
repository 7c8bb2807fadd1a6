"""Where a benchmark's section goes in docs/BENCHMARKS.md: current results first, so a new section is filed
at the top of "# Current results" (created if missing) and everything already there moves down towards the
history. One writer for every script, so the file keeps that order whoever runs what."""

from __future__ import annotations

from pathlib import Path

CURRENT = "# Current results"
HEADER = ("# Benchmarks\n\nCurrent results come first (newest on top); the history below keeps every earlier "
          "table as it was recorded, each with its date, command and code state.\n\n" + CURRENT + "\n\n# History\n")


def add_section(path: str | Path, section: str) -> None:
    """File `section` (markdown starting with a `## ` heading) as the newest current result in `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text(encoding="utf-8") if path.exists() and path.stat().st_size else HEADER
    if CURRENT not in text:
        title, _, rest = text.partition("\n")
        text = f"{title}\n\n{CURRENT}\n\n# History\n{rest}" if title.startswith("# ") else f"{CURRENT}\n\n# History\n{text}"
    at = text.index(CURRENT) + len(CURRENT)
    path.write_text(f"{text[:at]}\n\n{section.strip(chr(10))}\n\n{text[at:].lstrip(chr(10))}", encoding="utf-8")
