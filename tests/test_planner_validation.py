"""The planner's calibration, validation and published check, on the committed data.

- the calibration file is what `tools/plan.py calibrate` fits from the committed bench
  JSON (deterministic: a hand edit, or a fit change not re-run, fails here);
- the validation and published predictions equal the committed result files (1%), and
  every row those files record as within its bound still is: a change to the model
  that moves a prediction out of its bound fails CI;
- the published speedups keep the published order wherever the published gap is
  larger than the reading uncertainty;
- the subcommands' bad input is one `error:` line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from megaq.planner import calibrate, published, validate
from megaq.planner.bench_rows import BENCH_FP8, BENCH_SIZES, bench_argv, read_train_rows
from megaq.planner.calibration import DEFAULT_PATH, load_calibration

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "docs", "results")


def _committed(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def test_bench_shapes_are_bench_train_py_s():
    spec = importlib.util.spec_from_file_location(
        "bench_train", os.path.join(REPO, "tools", "bench", "bench_train.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.SIZES == BENCH_SIZES and mod.FP8_VARIANTS == BENCH_FP8
    assert (mod.SEQ, mod.VOCAB) == (2048, 32000)
    argv = bench_argv("3B", "megaq-s3-fp8dl-fp8g-comp")
    assert argv[argv.index("--zero-stage") + 1] == "3" and "--compile-blocks" in argv
    assert argv[argv.index("--fp8-recipe") + 1] == "delayed"


def test_calibration_file_is_the_fit_of_the_committed_bench_files():
    train, kernels, emulated = calibrate.default_files()
    cal, extra = calibrate.fit(train, kernels, emulated)
    with open(DEFAULT_PATH) as f:
        committed = f.read()
    assert calibrate.calibration_json(cal, extra) == committed, (
        "megaq/planner/calibration_h200.json is not the fit of the committed files: run "
        "tools/plan.py calibrate -o megaq/planner/calibration_h200.json")
    prov = json.loads(committed)["provenance"]["fitted_on"]
    # the validation's files are held out of the fit
    assert not set(prov["bench_train"]) & set(validate.VALIDATE_TRAIN_FILES)
    fitted_sizes = {r.size for name in prov["bench_train"]
                    for r in read_train_rows(os.path.join(RESULTS, name))}
    assert "3B" not in fitted_sizes and {"1.3B", "125M"} <= fitted_sizes


def test_validation_rows_hold_their_bounds():
    doc = validate.validate()
    committed = _committed("planner_validation.json")
    assert len(doc["rows"]) == len(committed["rows"])
    for new, old in zip(doc["rows"], committed["rows"]):
        assert (new["kind"], new["label"], new["source"]) == (old["kind"], old["label"], old["source"])
        assert new["predicted"] == pytest.approx(old["predicted"], rel=0.01), new["label"]
        assert new["excluded"] == old["excluded"], new["label"]
        if old["within"] and not old["excluded"]:
            assert new["within"], (new["kind"], new["label"], new["ratio"])
    # the targets on the current tree: one H200, 1.3B and 3B, bf16 and FP8, step
    # time and peak memory, all held to their bounds
    current = [r for r in doc["rows"] if r["source"] in validate.CURRENT_TREE_FILES]
    assert {(r["kind"], r["label"]) for r in current} == {
        (k, f"{s} megaq-{v}-comp") for k in ("step", "memory") for s in ("1.3B", "3B")
        for v in ("s0", "fp8dl")}
    assert all(r["within"] and not r["excluded"] for r in current), [
        (r["label"], r["ratio"]) for r in current]
    # memory measured on an earlier tree is shown, not bounded; its step times are
    earlier = [r for r in doc["rows"] if r["source"] in validate.EARLIER_TREE_FILES]
    assert earlier and all(bool(r["excluded"]) == (r["kind"] == "memory") for r in earlier)
    # the same steps on an H100, predicted for its preset from the H200 calibration
    other = [r for r in doc["rows"] if r["source"] in validate.OTHER_GPU_FILES]
    # (with the A/B of bf16 gradients: the same variants with fp32 accumulators, -f32g; and
    # of fc1's fused FP8 backward: SwiGLU after the GEMM, -nse; and of inductor's
    # coordinate-descent tuning, -cdt, at micro-batch 16; of the casts straight into the GEMM
    # layout: the old route, -otr; and of CUDA graphs, -cg)
    assert {(r["kind"], r["label"]) for r in other} == {
        (k, f"{s} megaq-{v}-comp (H100-SXM)") for k in ("step", "memory")
        for s, v in (("1.3B", "s0"), ("3B", "s0"), ("1.3B", "fp8dl"), ("3B", "fp8dl"),
                     ("1.3B", "s0-f32g"), ("1.3B", "fp8dl-f32g"), ("3B", "fp8dl-f32g"),
                     ("1.3B", "fp8dl-nse"), ("3B", "fp8dl-nse"), ("1.3B", "s0-cdt"),
                     ("1.3B", "fp8dl-otr"), ("1.3B", "fp8dl-cg"), ("1.3B", "s0-cg"))}
    assert all(r["within"] and not r["excluded"] for r in other), other
    largest = [r for r in doc["rows"] if r["source"] in validate.VALIDATE_LARGEST_FILES]
    assert len(largest) == 10 and all(r["within"] for r in largest), largest
    assert sum(r["label"].endswith("(H100-SXM)") for r in largest) == 5
    assert [r["label"] for r in largest if r["excluded"]] == ["39x4096 megaq-fp8dl-comp (recompute)"]
    assert doc["summary"]["memory"]["rows"] == sum(
        1 for r in current + other + largest if r["kind"] == "memory" and not r["excluded"])
    # every emulated file's fastest configuration named at each rate (or one tied with it
    # within the pass spread); a file's 5 configurations are rows of the table
    assert {(w["source"], w["rate"]) for w in doc["winners"]} == {
        (validate.VALIDATE_EMULATED_FILES[0], "250mbit"), (validate.VALIDATE_EMULATED_FILES[0], "1gbit"),
        (validate.VALIDATE_EMULATED_FILES[1], "1gbit")}
    assert all(w["right"] for w in doc["winners"]), doc["winners"]
    assert all((w["predicted_winner"] == w["measured_winner"]) or w["margin_within_noise"]
               for w in doc["winners"]), doc["winners"]


def test_published_speedups_keep_their_order_and_tolerance():
    doc = published.published_check(load_calibration())
    committed = _committed("planner_published.json")
    assert len(doc["cells"]) == 20
    for new, old in zip(doc["cells"], committed["cells"]):
        assert new["id"] == old["id"]
        assert new["predicted_speedup"] == pytest.approx(old["predicted_speedup"], rel=0.01)
        if old["within"]:
            assert abs(new["predicted_speedup"] / new["published_speedup"] - 1) <= published.TOLERANCE
    sig = [p for p in doc["orderings"] if p["significant"]]
    assert sig and all(p["same_order"] for p in sig), [p for p in sig if not p["same_order"]]
    # speedup falls with bandwidth at every model and batch, as published
    for p in doc["orderings"]:
        if p["axis"] == "bandwidth" and p["significant"]:
            assert p["same_order"]


@pytest.mark.parametrize("argv, needle", [
    (["calibrate", "--bench-train", "{results}/kernels_h200.json", "-o", "{tmp}/c.json"],
     "pass it with --bench-kernels"),
    (["calibrate", "--bench-kernels", "{results}/fp8final_h200_3B.json", "-o", "{tmp}/c.json"],
     "pass it with --bench-train"),
    (["calibrate", "--bench-kernels", "{tmp}/missing.json", "-o", "{tmp}/c.json"], "missing.json"),
    (["calibrate", "--bench-train", "{results}/bench_train_h100_1.3B_current.json", "-o",
      "{tmp}/c.json"], "was measured on an H100-SXM; the calibration fits H200 runs only"),
    (["calibrate", "-o", "{tmp}/no/such/dir/c.json"], "does not exist"),
    (["scale", "--out", "{tmp}/no/such/dir/s.json"], "does not exist; create it"),
    (["validate", "--out", "{tmp}/no/such/dir/v.json"], "does not exist; create it"),
    (["validate", "--calibration", "{tmp}/missing.json"], "missing.json"),
    (["published", "--bogus"], "unrecognized arguments"),
])
def test_subcommand_errors_are_one_line(tmp_path, capsys, argv, needle):
    from megaq.planner.tasks import main
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{results}", RESULTS) for a in argv]
    assert main(argv[0], argv[1:]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert not os.path.exists(tmp_path / "c.json")


def test_a_damaged_step_profile_beside_the_emulated_file_is_one_error_line(tmp_path, capsys):
    import shutil
    from megaq.planner.tasks import main
    shutil.copy(os.path.join(RESULTS, calibrate.FIT_EMULATED_FILE), tmp_path)
    (tmp_path / calibrate.FIT_EMULATED_PROFILE).write_text('{"results": [{"config": "ZeRO-3"}]}')
    argv = ["--emulated", str(tmp_path / calibrate.FIT_EMULATED_FILE), "-o", str(tmp_path / "c.json")]
    assert main("calibrate", argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a netns_step_profile.py result" in err[0], err
    assert not os.path.exists(tmp_path / "c.json")


def test_tools_plan_py_dispatches_the_subcommands(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "plan.py"), "scale", "--bogus"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: tools/plan.py scale"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
