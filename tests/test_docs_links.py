"""README.md and docs/*.md: links resolve, README stays short, tables stay readable, no run history wording.

Links are `[text](target)` (images too); web, mail and pure `#anchor` targets are not checked, and a
`#anchor` suffix is dropped before the look-up. A target is resolved against the folder of the file that
holds it. Fenced code blocks and inline code are skipped, so code that happens to read `[a](b)` is no link.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 150
TABLE_CELL_MAX_CHARS = 300

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]*)(?:\s+\"[^\"]*\")?\)")
_SKIPPED = ("http://", "https://", "mailto:")
_RUN_HISTORY = re.compile(r"\bsession [0-9]+|device session|this session", re.IGNORECASE)
_CELL_SPLIT = re.compile(r"(?<!\\)\|")


def markdown_files(root: Path = ROOT) -> list[Path]:
    """README.md and every markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of each markdown link outside code."""
    found: list[tuple[int, str]] = []
    in_fence = False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        # Inline code inside a link's text (`[`x.py`](x.py)`) stays a link: code becomes a placeholder.
        for match in _LINK.finditer(_INLINE_CODE.sub("code", line)):
            found.append((number, match.group("target").strip("<>")))
    return found


def broken_links(path: Path) -> list[str]:
    """`file:line: target` for each relative link in `path` whose target does not exist."""
    broken: list[str] = []
    for number, target in links(path.read_text(encoding="utf-8")):
        if not target or target.startswith("#") or target.lower().startswith(_SKIPPED):
            continue
        relative = target.split("#", 1)[0]
        if not (path.parent / relative).exists():
            try:
                shown = path.relative_to(ROOT)
            except ValueError:
                shown = path
            broken.append(f"{shown}:{number}: {target}")
    return broken


def test_every_relative_link_in_readme_and_docs_exists() -> None:
    files = markdown_files()
    assert (ROOT / "README.md").is_file()
    assert len(files) > 1, "no docs/*.md pages found"
    broken = [entry for path in files for entry in broken_links(path)]
    assert not broken, f"{len(broken)} broken link(s):\n" + "\n".join(broken)


def test_readme_is_a_short_front_door() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {README_MAX_LINES}: move detail into docs/"
    )


def test_checker_reports_a_planted_broken_link(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# other\n", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "inner.md").write_text("# inner\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "\n".join(
            [
                "# A page",
                "[fine](other.md) and [fine with anchor](other.md#other) and [nested](sub/inner.md)",
                "[web](https://example.com/x.md) [mail](mailto:a@b.c) [anchor](#a-page)",
                "[`code text`](missing.md#section) is broken, and so is ![image](img/gone.png)",
                "```",
                "[inside a fence](not-checked.md)",
                "```",
                "inline `[code](not-checked-either.md)` is not a link",
            ]
        )
        + "\n",
        encoding="utf-8",
    )
    broken = broken_links(page)
    assert broken == [f"{page}:4: missing.md#section", f"{page}:4: img/gone.png"], broken


def long_table_cells(text: str, limit: int = TABLE_CELL_MAX_CHARS) -> list[tuple[int, int]]:
    """(line number, length) of each markdown table cell outside code longer than `limit` characters."""
    found: list[tuple[int, int]] = []
    in_fence = False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence or not line.lstrip().startswith("|"):
            continue
        for cell in _CELL_SPLIT.split(line.strip().strip("|")):
            if len(cell.strip()) > limit:
                found.append((number, len(cell.strip())))
    return found


def run_history_lines(text: str) -> list[int]:
    """Line numbers that speak of sessions ("session 12", "this session", "device session")."""
    return [number for number, line in enumerate(text.splitlines(), start=1) if _RUN_HISTORY.search(line)]


def test_no_table_cell_is_longer_than_the_limit() -> None:
    long = [
        f"{path.relative_to(ROOT)}:{number}: {length} chars"
        for path in markdown_files()
        for number, length in long_table_cells(path.read_text(encoding="utf-8"))
    ]
    header = f"table cells over {TABLE_CELL_MAX_CHARS} characters (use prose below the table):"
    assert not long, header + "\n" + "\n".join(long)


def test_docs_hold_no_session_wording() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in markdown_files()
        for number in run_history_lines(path.read_text(encoding="utf-8"))
    ]
    assert not found, "run history belongs in git, not in the docs:\n" + "\n".join(found)


def test_checkers_catch_planted_long_cells_and_session_wording() -> None:
    text = "\n".join(
        [
            "| a | b |",
            "|---|---|",
            f"| short | {'x' * 301} |",
            f"| escaped \\| pipe | {'y' * 300} |",
            "```",
            f"| {'z' * 400} |",
            "```",
            "Measured in session 12, then in this session and a device session.",
            "A sessions table and session-based auth are fine.",
        ]
    )
    assert long_table_cells(text) == [(3, 301)]
    assert run_history_lines(text) == [8]
