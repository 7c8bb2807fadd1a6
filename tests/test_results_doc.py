"""docs/BENCHMARKS.md keeps current results first: every benchmark files its section through one writer."""

from __future__ import annotations

from bench_util import load_benchmark


def _filed(path, before: str | None, section: str) -> str:
    if before is not None:
        path.write_text(before)
    load_benchmark("results_doc").add_section(path, section)
    return path.read_text()


def test_a_new_section_goes_first_under_current_results(tmp_path):
    text = _filed(tmp_path / "B.md", "# Benchmarks\n\n# Current results\n\n## Older (1)\n\nold\n\n# History\n\n## Oldest (0)\n",
                  "\n## Newer (2)\n\nnew\n")
    assert text.index("## Newer") < text.index("## Older") < text.index("# History") < text.index("## Oldest")


def test_a_file_without_the_current_results_heading_gets_one_above_its_history(tmp_path):
    text = _filed(tmp_path / "B.md", "# Benchmarks\n\n## Old (0)\n\nz\n", "## New (1)\n\nn\n")
    assert text.startswith("# Benchmarks\n")
    assert text.index("# Current results") < text.index("## New") < text.index("# History") < text.index("## Old")


def test_a_missing_file_is_created_with_the_section(tmp_path):
    text = _filed(tmp_path / "docs" / "BENCHMARKS.md", None, "## First (0)\n\nf\n")
    assert text.startswith("# Benchmarks") and "## First (0)" in text
