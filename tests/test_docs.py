"""The --dry-run plans quoted in README.md, docs/ and the recipe READMEs are what their commands print now."""
import pytest

from tests.conftest import REPO
from tools.refresh_plans import markdown_files, refreshed, refreshed_plan, stored_plans


@pytest.mark.slow
def test_quoted_plans_are_what_their_commands_print(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    stale = [str(path.relative_to(REPO)) for path in markdown_files()
             if refreshed(path.read_text()) != path.read_text()]
    stale += [str(path.relative_to(REPO)) for path in stored_plans()
              if refreshed_plan(path.read_text()) != path.read_text()]
    assert not stale, f"quoted plans differ from their commands' output in {stale}: run python tools/refresh_plans.py"



def test_the_layout_table_is_the_codes():
    """docs/parallelism.md's table of what runs in each layout is training/parallel/support.py's, rendered."""
    from training.parallel.support import render
    assert render() in (REPO / "docs/parallelism.md").read_text(), \
        "docs/parallelism.md's layout table differs from training/parallel/support.py's: paste its render()"
