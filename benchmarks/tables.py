"""The benchmarks' one way to give a result table: printed whole, and kept as table.md in the results folder."""
from pathlib import Path


def write_table(lines: list[str], output: Path | None) -> None:
    """The table printed whole, and written to output/table.md where a folder is given."""
    table = "\n".join(lines)
    print("\n" + table)
    if output:
        output.mkdir(parents=True, exist_ok=True)
        (output / "table.md").write_text(table + "\n")
