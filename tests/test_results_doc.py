"""docs/BENCHMARKS.md keeps current results first: every benchmark files its section through one writer."""

from __future__ import annotations

from bench_util import load_benchmark


def test_a_new_section_goes_first_under_current_results(tmp_path):
    doc = load_benchmark("results_doc")
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\n# Current results\n\n## Older (1)\n\nold\n\n# History\n\n## Oldest (0)\n")
    doc.add_section(path, "\n## Newer (2)\n\nnew\n")
    text = path.read_text()
    assert text.index("## Newer") < text.index("## Older") < text.index("# History") < text.index("## Oldest")


def test_a_file_without_the_current_results_heading_gets_one_above_its_history(tmp_path):
    doc = load_benchmark("results_doc")
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\n## Old (0)\n\nz\n")
    doc.add_section(path, "## New (1)\n\nn\n")
    text = path.read_text()
    assert text.startswith("# Benchmarks\n")
    assert text.index("# Current results") < text.index("## New") < text.index("# History") < text.index("## Old")


def test_a_missing_file_is_created_with_the_section(tmp_path):
    doc = load_benchmark("results_doc")
    path = tmp_path / "docs" / "BENCHMARKS.md"
    doc.add_section(path, "## First (0)\n\nf\n")
    assert "## First (0)" in path.read_text() and path.read_text().startswith("# Benchmarks")
