"""The README's config reference is generated from the dataclasses: it must not drift."""

import re
from pathlib import Path

from pipeline.config import reference_markdown

README = Path(__file__).resolve().parents[2] / "README.md"


def test_config_reference_in_readme_is_current():
    text = README.read_text()
    block = re.search(r"<!-- config-reference:start -->\n(.*?)\n<!-- config-reference:end -->", text, re.S)
    assert block, "README.md lacks the config-reference markers"
    assert block.group(1).strip() == reference_markdown().strip(), "run: python launch/config_reference.py --update-readme"
