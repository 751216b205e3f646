"""README.md and docs/*.md: every relative markdown link points at a file that exists, and README stays short.

Links are `[text](target)` (images too); web, mail and pure `#anchor` targets are not checked, and a
`#anchor` suffix is dropped before the look-up. A target is resolved against the folder of the file that
holds it. Fenced code blocks and inline code are skipped, so code that happens to read `[a](b)` is no link.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 150

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]*)(?:\s+\"[^\"]*\")?\)")
_SKIPPED = ("http://", "https://", "mailto:")


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
