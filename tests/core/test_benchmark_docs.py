"""``--write-docs`` (benchmarks/_docs.py): a benchmark's printed table goes into its
dated section of docs/benchmarks.md, replaced in place on the next run."""
import datetime
import subprocess
import sys
from pathlib import Path

from mp import benchmark_module

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_docs = benchmark_module("_docs")


def test_a_section_is_appended_then_replaced_in_place(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nBy hand.\n")
    _docs.write_section(page, "planning", "python benchmarks/planning.py", "mesh 2x2  1.21\n")
    _docs.write_section(page, "tp", "python benchmarks/tp.py", "ours 1.0x\n")
    first = page.read_text()
    assert first.startswith("# Benchmarks\n\nBy hand.\n") and first.count(_docs.HEADING) == 1
    assert "mesh 2x2  1.21" in first and datetime.date.today().isoformat() in first
    _docs.write_section(page, "planning", "python benchmarks/planning.py", "mesh 2x2  0.90\n")
    second = page.read_text()
    assert "0.90" in second and "1.21" not in second and second.count("<!-- benchmark:planning -->") == 1
    assert second.index("benchmark:planning") < second.index("benchmark:tp")   # kept in place


def test_a_script_run_with_the_flag_writes_what_it_printed(tmp_path):
    script = tmp_path / "tiny.py"
    page = tmp_path / "page.md"
    script.write_text(
        "import sys, os\n"
        f"sys.path.insert(0, {str(BENCHMARKS)!r})\n"
        "from pathlib import Path\n"
        "from _docs import docs_section\n"
        "with docs_section('tiny', Path(sys.argv[-1])):\n"
        "    assert '--write-docs' not in sys.argv\n"
        "    print('row 1', flush=True)\n"
        "    os.system('echo row 2 from a child process')\n")
    out = subprocess.run([sys.executable, str(script), "--write-docs", str(page)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "row 1" in out.stdout and "row 2" in out.stdout
    text = page.read_text()
    assert "row 1\nrow 2 from a child process" in text and "<!-- /benchmark:tiny -->" in text
