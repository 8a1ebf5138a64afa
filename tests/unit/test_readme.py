"""The README and docs/: the generated config reference is current, links and named files exist,
the figures they state follow from the code."""

import re
from pathlib import Path

from pipeline.objectives import reference_markdown

README = Path(__file__).resolve().parents[2] / "README.md"
ROOT = README.parent
DOCS = [README, ROOT / "docker" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_config_reference_in_docs_is_current():
    text = (ROOT / "docs" / "configuration.md").read_text()
    block = re.search(r"<!-- config-reference:start -->\n(.*?)\n<!-- config-reference:end -->", text, re.S)
    assert block, "docs/configuration.md lacks the config-reference markers"
    assert block.group(1).strip() == reference_markdown().strip(), "run: python launch/config_reference.py --update"


LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", markdown, re.M)}


def test_relative_links_resolve():
    for doc in DOCS:
        for target, anchor in LINK.findall(doc.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path = (doc.parent / target).resolve() if target else doc
            assert path.exists(), f"{doc.relative_to(ROOT)} links {target}, which does not exist"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path.read_text()), f"{doc.relative_to(ROOT)}: no heading #{anchor} in {target}"


def test_slurm_config_default_is_the_one_the_readme_names():
    script = (ROOT / "slurm" / "pretrain.sh").read_text()
    default = re.search(r"CONFIG=\$\{CONFIG:-\$\{DEFAULT_CONFIG-([^}]+)\}\}", script).group(1)
    row = re.search(r"^\| `CONFIG` \| `([^`]+)`", (ROOT / "docs" / "cluster.md").read_text(), re.M).group(1)
    assert default == row == "configs/pretrain/demo.yaml"
    assert (ROOT / default).is_file()


def test_paper_config_hour_estimates_follow_from_their_flops():
    """Each paper config's header: steps x batch x 3 x model_flops = the FLOP it states, and that
    over (GPUs x MFU x the H100's 989e12) = the seconds it states."""
    from pipeline.model.vit import VARIANTS, model_flops
    from pipeline.objectives import load_config

    for path in sorted((ROOT / "configs").glob("*/vit_*.yaml")):
        head = "\n".join(line[2:] for line in path.read_text().splitlines() if line.startswith("# "))
        cfg = load_config(path)
        classes = 21843 if "i21k" in path.name else 1000
        flops = model_flops({**VARIANTS[cfg.model.variant], "img_size": cfg.model.img_size,
                             "representation_size": cfg.model.representation_size, "num_classes": classes})
        batch = int(re.search(r"x ([\d,]+) = [\d.]+[MB] images", head).group(1).replace(",", ""))
        total = cfg.train.steps * batch * 3 * flops
        stated = float(re.search(r"= ([\d.]+e\d+) FLOP", head).group(1))
        assert abs(stated / total - 1) < 0.03, f"{path.name}: states {stated:.3g} FLOP, computes {total:.3g}"
        mfu = int(re.search(r"at (\d+)% MFU", head).group(1)) / 100
        gpus, seconds = re.search(r"/ \((\d+) x [\d.e]+\) = ([\d,]+) s", head).groups()
        expected = total / (int(gpus) * mfu * 989e12)
        assert abs(int(seconds.replace(",", "")) / expected - 1) < 0.05, f"{path.name}: {seconds} s vs {expected:.0f} s"


def test_files_the_docs_name_exist():
    path = re.compile(r"(?<![\w/.$])((?:docs|docker|configs|slurm|launch|pipeline|benchmarks|tests)/[\w/.-]+\.(?:md|yaml|sh|py|png))")
    for doc in DOCS:
        missing = {p for p in path.findall(doc.read_text()) if not (ROOT / p).exists()}
        assert not missing, f"{doc.relative_to(ROOT)} names files that do not exist: {sorted(missing)}"


def test_gpu_times_in_config_headers_say_they_are_estimates_until_a_gpu_row_is_measured():
    """A config header that quotes hours or minutes on GPUs says it is an estimate at an assumed MFU while
    results/benchmarks.csv holds no row of the GPU benchmark (`python launch/bench.py gpu`)."""
    import csv

    with open(ROOT / "results" / "benchmarks.csv", newline="") as f:
        if any(row["bench"] == "gpu" for row in csv.DictReader(f)):
            return
    quoting = 0
    for path in sorted((ROOT / "configs").glob("*/*.yaml")):
        head = " ".join(line[2:] for line in path.read_text().splitlines() if line.startswith("# "))
        if re.search(r"\d[\d.,]* (h|min) on \d+ H100", head):
            quoting += 1
            assert "estimates at an assumed MFU" in head, f"{path.relative_to(ROOT)} quotes a GPU time as if measured"
    assert quoting >= 2  # the paper recipes do
