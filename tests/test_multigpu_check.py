"""Smoke test of scripts/multigpu_check.sh in its CPU mode: 2 gloo ranks posing as
2 nodes, a tiny model, ZeRO-3 / qwZ / qwZ+hpZ / ZeRO++ for 2 iterations each in one
torchrun launch. Checks the record and the table a user reads, and that the byte
figures say what ZeRO++ promises (quantized gathers and gradients move fewer bytes
across the node boundary than ZeRO-3's). Budget ~30 s on 2 shared cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import multigpu_check as M  # tools/cluster (pyproject.toml: pytest's pythonpath)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_layouts_and_variants():
    m = M.MODELS["tiny"]  # 2 KV groups, 2 layers
    assert M.layouts(2, m) == [(1, 2, 1), (2, 1, 1), (1, 1, 2)]
    assert all(tp * pp * dp == 4 for tp, pp, dp in M.layouts(4, m))
    v = M.bench_variants(4)
    assert list(v) == ["ZeRO-3", "qwZ", "qwZ+hpZ", "ZeRO++"]
    assert v["ZeRO++"] == v["qwZ+hpZ"] + ["--zero-quantized-gradients"]
    v = M.bench_variants(4, (4096,))
    assert list(v)[-1] == "ZeRO++ chunk 4096"
    assert v["ZeRO++ chunk 4096"] == v["ZeRO++"] + ["--zero-quantized-gradients-chunk", "4096"]


def test_transport_lines_flag_wrong_channels(tmp_path):
    # 4 GPUs as 2 halves of 2: 0,1 | 2,3. One NCCL version names GPUs by device index,
    # another by bus id (mapped through the Init COMPLETE line).
    (tmp_path / "nccl.h.1.log").write_text(
        "h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[2] [send] via NET/Socket/0\n"  # ok
        "h:1:2 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[2] via P2P/CUMEM/read\n"       # wrong
        "h:1:2 [2] NCCL INFO Channel 00/0 : 0[2] -> 1[3] via P2P/CUMEM/read\n"       # ok
        "h:1:2 [2] NCCL INFO Channel 00/0 : 0[2] -> 1[3] via NET/Socket/0\n")         # wrong
    (tmp_path / "nccl.h.2.log").write_text(
        "h:2:2 [1] NCCL INFO comm 0x1 rank 1 nranks 4 cudaDev 1 nvmlDev 1 busId 2a000 "
        "commId 0x5 - Init COMPLETE\n"
        "h:2:2 [3] NCCL INFO comm 0x2 rank 3 nranks 4 cudaDev 3 nvmlDev 3 busId 9b000 "
        "commId 0x5 - Init COMPLETE\n"
        "h:2:2 [1] NCCL INFO Channel 02/0 : 1[2a000] -> 3[9b000] via NET/Socket/1\n")  # ok
    tl = M.transport_lines(str(tmp_path), per_node=2)
    assert tl["channels_checked"] == 5
    assert len(tl["wrong"]) == 2
    assert "0[0] -> 1[2] via P2P" in tl["wrong"][0] and "0[2] -> 1[3] via NET" in tl["wrong"][1]
    assert any("NET/Socket" in x for x in tl["lines"])


def test_cpu_mode_two_steps(tmp_path):
    out = tmp_path / "multigpu.json"
    env = dict(os.environ, PYTHON=sys.executable)
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        env.pop(k, None)  # the script must set them itself
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "multigpu_check.sh"),
                        "--device", "cpu", "--gpus", "2", "--model", "tiny", "--stages", "bench",
                        "--warmup", "1", "--steps", "1", "--log-dir", str(tmp_path / "logs"),
                        "--out", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # the table comes last: header, rule, one row per variant
    tail = r.stdout.strip().splitlines()[-6:]
    assert tail[0].startswith("| variant | step ms")
    assert [row.split("|")[1].strip() for row in tail[2:]] == ["ZeRO-3", "qwZ", "qwZ+hpZ", "ZeRO++"]

    rec = json.loads(out.read_text())
    assert rec["errors"] == {}
    assert rec["env"]["NCCL_NVLS_ENABLE"] == "0" and rec["env"]["NVSHMEM_DISABLE_NVLS"] == "1"
    rows = {row["variant"]: row for row in rec["bench"]}
    for row in rows.values():
        assert len(row["step_ms_all"]) == 2 and row["step_ms"] > 0
        assert row["nodes"] == 2 and row["world_size"] == 2
    assert rows["ZeRO-3"]["speedup_vs_zero3"] == 1.0
    inter = {k: {p: v["phases"][p]["inter_node"] for p in M.PHASES} for k, v in rows.items()}
    # 2 nodes of one rank: every ZeRO-3 gather / reduce-scatter crosses the boundary
    assert all(b > 0 for b in inter["ZeRO-3"].values())
    # qwZ: int8 forward gather, at most ~1/4 of fp32 (+ block scales); gradients untouched
    assert inter["qwZ"]["weight_gather_fwd"] < 0.3 * inter["ZeRO-3"]["weight_gather_fwd"]
    assert inter["qwZ"]["grad_reduce"] == inter["ZeRO-3"]["grad_reduce"]
    # qgZ: int4 gradients, well under ZeRO-3's fp32 reduce-scatter
    assert inter["ZeRO++"]["grad_reduce"] < 0.3 * inter["ZeRO-3"]["grad_reduce"]
    assert rec["link_probe"] and rec["link_probe"][0]["busbw_GBps"] > 0
    # --comm-time (default): one more iteration per variant with --log-comm-time gives
    # milliseconds for each phase that moves bytes, shown in a table above the bytes one
    for row in rows.values():
        assert all(row["comm_time_ms"][p] > 0 for p in M.PHASES) and row["comm_timed_step_ms"] > 0
    assert "| variant | step ms, collectives synchronous |" in r.stdout


def test_cpu_mode_resume_stage(tmp_path):
    """The resume stage on 2 gloo ranks: runs stopped at iteration 2 and resumed from
    their checkpoints (same layout with ZeRO++ and error feedback; ZeRO-3 resharded
    onto TP x PP) continue as the runs that never stopped."""
    out = tmp_path / "resume.json"
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "multigpu_check.sh"),
                        "--device", "cpu", "--gpus", "2", "--model", "tiny", "--stages", "resume",
                        "--log-dir", str(tmp_path / "logs"), "--out", str(out)],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHON=sys.executable))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["errors"] == {}
    assert set(rec["resume"]) == {"zeropp_resumed", "zero3_resumed_tp1_pp2"}
    for v in rec["resume"].values():
        assert v["ok"] and v["iterations"] == [3, 4]
    # same layout on CPU: the resumed iterations repeat the uninterrupted ones exactly
    assert rec["resume"]["zeropp_resumed"]["losses"] == rec["resume"]["zeropp_resumed"]["ref_losses"]
