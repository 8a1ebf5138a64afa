"""Every command in launch/ answers --help with its usage and exit 0, and so does each `bench.py`
sub-command: the first thing a newcomer types (`launch/bench.py --help` once died on a '%' in a
sub-command's help text). In process: runpy runs the script as __main__ with argv set."""

import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "launch").glob("*.py"))


def _help(argv: list[str], capsys) -> str:
    old = sys.argv
    sys.argv = argv
    try:
        with pytest.raises(SystemExit) as e:
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        sys.argv = old
    out = capsys.readouterr().out
    assert e.value.code in (0, None), f"{' '.join(argv)}: exit {e.value.code}"
    assert "usage" in out.lower(), f"{' '.join(argv)} printed no usage:\n{out[:500]}"
    return out


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_exits_0_with_usage(script, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    _help([str(ROOT / "launch" / script), "--help"], capsys)


def test_every_bench_subcommand_help(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT / "launch"))
    import bench
    for name in [*bench.BENCHES, "all", "render"]:
        _help([str(ROOT / "launch" / "bench.py"), name, "--help"], capsys)
