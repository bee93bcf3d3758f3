"""The GPU check's one table (``gpu_check.sh`` runs it on its work folder): the
device, each stage's exit status and time, every GPU test's result, the README
commands' test counts, the simulated step against the measured one (``simulate.py``'s
table), and the nanoGPT step at world 1 (``overhead.py --json``).

    python benchmarks/gpu_table.py /tmp/gpu_check_work
"""
from __future__ import annotations

import datetime
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _tests(xml: Path) -> list:
    """(test id, outcome, first line of the message) per test case of a junit file."""
    if not xml.exists():
        return []
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "FAILED", "error": "ERROR"}.get(kind, kind)
                message = (found.get("message") or "").splitlines()[0][:110] if \
                    found.get("message") else ""
                break
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        rows.append((name, outcome, message))
    return rows


def _counts(rows: list) -> str:
    counts: dict = {}
    for _, outcome, _ in rows:
        counts[outcome] = counts.get(outcome, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no results"


def main(work: str) -> None:
    work = Path(work)
    device = (work / "device.txt").read_text().strip() if (work / "device.txt").exists() else "?"
    print(f"# GPU check, {datetime.date.today()}: {device}\n")
    print("| stage | exit | seconds |\n|---|---:|---:|")
    for line in (work / "stages.txt").read_text().splitlines() if (work / "stages.txt").exists() else []:
        name, rc, seconds = line.split()
        shown = "timed out" if rc in ("124", "137") else rc
        print(f"| {name} | {shown} | {seconds} |")
    cuda = _tests(work / "cuda.xml")
    print(f"\n## GPU tests (`pytest -m cuda tests/cuda`): {_counts(cuda)}\n")
    print("| test | result | message |\n|---|---|---|")
    for name, outcome, message in cuda:
        print(f"| {name} | {outcome} | {message} |")
    suite = _tests(work / "suite.xml")
    print(f"\n## README test command (`python -m pytest -q`): {_counts(suite)}")
    for name, outcome, message in suite:
        if outcome in ("FAILED", "ERROR"):
            print(f"- {outcome} {name}: {message}")
    simulated = work / "simulate.log"
    if simulated.exists():
        lines = [line for line in simulated.read_text().splitlines()
                 if not line.startswith(("[", "W1", "== ")) and line.strip()]
        print("\n## gt.debug.simulate_step at world 1 against the measured step "
              "(`simulate.py --measure --device cuda`)\n")
        print("```text\n" + "\n".join(lines) + "\n```")
    gpt = work / "gpt.json"
    if gpt.exists():
        rows = json.loads(gpt.read_text())
        step = {r["way"]: r["step_ms"] for r in rows}
        print("\n## nanoGPT at world 1 (`overhead.py --device cuda`), median step, ms\n")
        print("| way | step | forward | backward | optimizer | vs plain | vs DTensor |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            if r["why"] or r["step_ms"] is None:
                print(f"| {r['way']} | n/a: {r['why']} | | | | | |")
                continue
            tail = " compiled" if r["way"].endswith(" compiled") else ""
            ratios = [f"{r['step_ms'] / step[w + tail]:.2f}x" if step.get(w + tail) else ""
                      for w in ("plain", "dtensor")]
            print(f"| {r['way']} ({r['optim']}) | {r['step_ms']:.1f} | {r['forward_ms']:.1f} | "
                  f"{r['backward_ms']:.1f} | {r['optimizer_ms']:.1f} | {ratios[0]} | "
                  f"{ratios[1]} |")

if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gpu_check")
