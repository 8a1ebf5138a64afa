#!/usr/bin/env python
"""Print the config reference (every key, its default and its docstring) as a Markdown table.

    python launch/config_reference.py           # print it
    python launch/config_reference.py --update  # rewrite the table in docs/configuration.md
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.objectives import reference_markdown  # noqa: E402

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def update_page(path: Path = PAGE) -> None:
    """Replace the table between the config-reference markers of the page."""
    text = path.read_text()
    start, end = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{reference_markdown()}\n{end}{tail}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update", action="store_true", help=f"rewrite the table in {PAGE.relative_to(PAGE.parents[1])}")
    if parser.parse_args().update:
        update_page()
        print(f"wrote the reference table in {PAGE}")
    else:
        print(reference_markdown())
