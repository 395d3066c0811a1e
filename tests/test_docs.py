"""The --dry-run plans quoted in README.md, docs/ and the recipe READMEs are what their commands print now."""
from tests.conftest import REPO
from tools.refresh_plans import markdown_files, refreshed, refreshed_plan, stored_plans


def test_quoted_plans_are_what_their_commands_print(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    stale = [str(path.relative_to(REPO)) for path in markdown_files() if refreshed(path.read_text()) != path.read_text()]
    stale += [str(path.relative_to(REPO)) for path in stored_plans() if refreshed_plan(path.read_text()) != path.read_text()]
    assert not stale, f"quoted plans differ from their commands' output in {stale}: run python tools/refresh_plans.py"


def test_the_measured_default_run_raised_no_stability_event():
    """The README's sample run (tiny_llama as it ships, written by the command the README shows) is the stability
    guard's false-alarm check: its defaults must let a healthy run through untouched."""
    import json
    run = REPO / "benchmarks/results/tiny_llama_cpu/run"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines and not [line for line in lines if "event" in line]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 200 and {key: summary["stability"][key] for key in ("skip", "spike", "rewind", "stop")} \
        == {"skip": 0, "spike": 0, "rewind": 0, "stop": 0}
