"""The README's sample demo output has the lines, format and phase names the demo prints.

The sample is checked against the code that prints those lines, never against a copy
of itself: Megatron's iteration line comes from `megaq.runtime.logging_utils`, the summary lines
from the Python program inside scripts/demo.sh (run here on a small metrics file), and
the other lines from demo.sh's `echo`s. Numbers may differ (they are a sample); the
README may elide with `...`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from megaq.runtime.logging_utils import training_log_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMBER = re.compile(r"[-+]?\d+(\.\d+)?([eE][-+]?\d+)?")


def _readme_sample() -> list[str]:
    """The lines of the first code block after the 'What the demo does and prints' heading."""
    text = open(os.path.join(REPO, "README.md")).read()
    section = text.split("## What the demo does and prints", 1)[1]
    block = re.search(r"```\n(.*?)```", section, re.S)
    assert block, "README: no code block under 'What the demo does and prints'"
    return [line for line in block.group(1).splitlines() if line.strip()]


def _demo_script() -> str:
    return open(os.path.join(REPO, "scripts", "demo.sh")).read()


def _summary_lines(tmp_path) -> list[str]:
    """What demo.sh's summary program prints for a small run's metrics file."""
    program = re.search(r"<<'PYEOF'\n(.*?)\nPYEOF", _demo_script(), re.S)
    assert program, "scripts/demo.sh: no summary program (<<'PYEOF' ... PYEOF)"
    comm = {phase: {"inter_node": 3 * 2**10, "intra_node": 2**10}
            for phase in ("weight_gather_fwd", "weight_gather_bwd", "grad_reduce", "pp", "tp")}
    rows = [{"type": "train", "iteration": i, "lm_loss": 8.0 - i / 100, "comm": comm,
             "zero_model_bytes": 2**20} for i in (10, 20)]
    rows += [{"type": "validation", "iteration": i, "val_loss": 7.0 - i / 100} for i in (10, 20)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = subprocess.run([sys.executable, "-c", program.group(1), str(metrics)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def _echo_patterns() -> list[re.Pattern]:
    """demo.sh's echo lines, shell expansions matching anything."""
    out = []
    for text in re.findall(r'^\s*echo "(.*)"\s*$', _demo_script(), re.M):
        parts = re.split(r"\$\(\(.*?\)\)|\$\(.*?\)|\$\{.*?\}|\$\w+", text)
        out.append(re.compile(".*".join(re.escape(p) for p in parts)))
    return out


def _numbers_as_n(line: str) -> str:
    return NUMBER.sub("N", line)


def _matches_printed(readme_line: str, printed: str) -> bool:
    """Same text once numbers are N; the README's `...` stands for any run of text."""
    pieces = [re.escape(_numbers_as_n(p)) for p in readme_line.split("...")]
    return re.fullmatch(".*?".join(pieces), _numbers_as_n(printed)) is not None


def test_readme_demo_sample_matches_what_the_demo_prints(tmp_path):
    sample = _readme_sample()
    printed = _summary_lines(tmp_path) + [training_log_line(
        iteration=100, train_iters=100, consumed_samples=1600, elapsed_ms=812.3,
        tflops_per_gpu=0.1, tokens_per_s_per_gpu=100.0, lr=3e-4, global_batch_size=16, lm_loss=5.2, loss_scale=1.0,
        grad_norm=0.5, skipped=0, nan=0)]
    echoes = _echo_patterns()
    # the lines the README promises a reader: the loss drop and the bytes per ZeRO phase
    assert any(line.startswith("[demo] lm loss ") for line in sample), sample
    assert any(line.startswith("[demo] cross-node KiB per node per iteration:") for line in sample)
    for line in sample:
        if any(_matches_printed(line, p) for p in printed):
            continue
        assert any(pat.fullmatch(line) for pat in echoes), (
            f"README demo sample line matches nothing the demo prints:\n  {line}\n"
            "the demo prints (numbers aside):\n  " + "\n  ".join(printed))


def test_demo_summary_reports_the_weight_delta_phases(tmp_path):
    """DEMO_WEIGHTS=deltas: the summary names the delta and reference gathers with their bytes."""
    program = re.search(r"<<'PYEOF'\n(.*?)\nPYEOF", _demo_script(), re.S).group(1)
    comm = {"weight_gather_fwd": {"inter_node": 0}, "grad_reduce": {"inter_node": 908 * 2**10},
            "weight_delta_gather": {"inter_node": 454 * 2**10}, "weight_ref_gather": {"inter_node": 0}}
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"type": "train", "iteration": 1, "lm_loss": 7.0, "comm": comm,
                                   "zero_model_bytes": 2**20}) + "\n")
    r = subprocess.run([sys.executable, "-c", program, str(metrics)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "weight_gather_fwd 0 (weight deltas: next line)" in r.stdout, r.stdout
    assert ("weight_delta_gather 454 (4-bit differences), weight_ref_gather 0 (in-node" in r.stdout), r.stdout


def test_matcher_tells_a_stale_phase_name_apart():
    """The check fails on the README drift it exists for: a renamed or missing phase."""
    printed = ("[demo] cross-node KiB per node per iteration: weight_gather_fwd 1359 (qwZ), "
               "weight_gather_bwd 0 (hpZ keeps it in-node), grad_reduce 908 (qgZ), pp 0; M = 5 KiB")
    assert _matches_printed(printed.replace("1359", "679").split("; M")[0] + "; ...", printed)
    assert not _matches_printed(printed.replace("grad_reduce", "grad_rs"), printed)
    assert not _matches_printed(printed.replace(", pp 0", ""), printed)


def _cited_results(path: str) -> set[str]:
    """The docs/results/ files a doc names (`results/name.json`, or `results/name.{png,json}`)."""
    text = open(path).read()
    cited = set()
    for stem, exts in re.findall(r"results/([\w.-]+?)\.\{([\w,]+)\}", text):  # name.{png,json}
        cited.update(f"{stem}.{e}" for e in exts.split(","))
    cited.update(re.findall(r"results/([\w.-]+?\.(?:json|png|txt))", text))
    return cited


def test_docs_results_holds_exactly_what_the_docs_cite():
    """Every docs/results/ file a doc names exists; the folder's index lists every file there
    once, and its status says whether docs/PERFORMANCE.md cites the file (current) or not."""
    docs_dir = os.path.join(REPO, "docs")
    results_dir = os.path.join(docs_dir, "results")
    docs = [os.path.join(REPO, "README.md")] + [
        os.path.join(docs_dir, n) for n in os.listdir(docs_dir) if n.endswith(".md")]
    cited = set().union(*(_cited_results(path) for path in docs))
    present = set(os.listdir(results_dir)) - {"README.md"}
    assert not cited - present, f"cited but missing from docs/results/: {sorted(cited - present)}"

    # the index: one table row per file, `| `name` | what | command | machine | date | status |`
    rows = re.findall(r"^\| `([\w.-]+)` \|.*\| ([^|]+?) \|$",
                      open(os.path.join(results_dir, "README.md")).read(), re.M)
    listed = [name for name, _ in rows]
    assert len(listed) == len(set(listed)), "docs/results/README.md lists a file twice"
    assert set(listed) == present, (
        f"docs/results/README.md lists missing files {sorted(set(listed) - present)} "
        f"and misses {sorted(present - set(listed))}")
    performance = _cited_results(os.path.join(docs_dir, "PERFORMANCE.md"))
    marked_current = {name for name, status in rows if status.startswith("current")}
    assert marked_current == performance, (
        f"index says current but PERFORMANCE.md does not cite: {sorted(marked_current - performance)}; "
        f"PERFORMANCE.md cites but index does not say current: {sorted(performance - marked_current)}")
    elsewhere = {name for name, status in rows if not status.startswith(("current", "history"))}
    assert elsewhere <= cited, f"index names a citing doc that does not cite: {sorted(elsewhere - cited)}"
