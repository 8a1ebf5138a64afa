#!/usr/bin/env python
"""Print the config reference (every key, its default and its docstring) as the README's Markdown table.

    python launch/config_reference.py                  # print it
    python launch/config_reference.py --update-readme  # rewrite the table in README.md
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.config import reference_markdown  # noqa: E402


def update_readme(path: Path) -> None:
    """Replace the table between the config-reference markers in README.md."""
    text = path.read_text()
    start, end = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{reference_markdown()}\n{end}{tail}")


if __name__ == "__main__":
    if "--update-readme" in sys.argv:
        update_readme(Path(__file__).resolve().parents[1] / "README.md")
    else:
        print(reference_markdown())
