"""scripts/pretrain_slurm.sbatch run as slurm would run it, with fake slurm commands.

Fake `sbatch`, `srun`, `scontrol`, `squeue` and `getent` on PATH emulate a 2-node
allocation: sbatch reads the #SBATCH header (and refuses an --output directory that does
not exist, as slurm does), sets the SLURM_* variables and runs the script; srun starts the
tasks as local processes with SLURM_PROCID / SLURM_LOCALID / SLURM_NODEID and records
their pids; getent answers the head node's name with the 127.0.1.1 loopback trap first.

1. The script's exact command for 2 nodes x 8 GPUs with its default model passes
   megaq's validation (srun only records it).
2. The same script, scaled to 2 nodes x 2 CPU ranks and a tiny model through the knobs it
   offers (GPUS_PER_NODE, TP, MOCK_DATA, BACKEND, trailing flags), trains; SIGUSR1 to the
   ranks (what --signal=USR1@120 makes slurm send) saves and the job exits 0; a
   chained resubmission under the same job name, without EXPERIMENT, resumes from that
   checkpoint (the directory is keyed by the job name, not the job id).
"""

import contextlib
import json
import os
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "pretrain_slurm.sbatch")

FAKE_SBATCH = r'''
import os, re, subprocess, sys
state = os.environ["FAKE_SLURM_DIR"]
args = sys.argv[1:]
opts = {}
while args and args[0].startswith("--"):
    k, _, v = args.pop(0)[2:].partition("=")
    opts[k] = v
script, script_args = args[0], args[1:]
header = {}
for line in open(script):
    m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
    if m:
        header[m.group(1)] = m.group(2) or ""
header.update(opts)
counter = os.path.join(state, "next_job_id")
job_id = int(open(counter).read()) if os.path.exists(counter) else 1000
open(counter, "w").write(str(job_id + 1))
nodes = int(header.get("nodes", 1))
name = header.get("job-name", "sbatch")
env = dict(os.environ, SLURM_JOB_ID=str(job_id), SLURM_JOB_NAME=name, SLURM_NNODES=str(nodes),
           SLURM_CPUS_PER_TASK=header.get("cpus-per-task", "1"),
           SLURM_JOB_NUM_NODES=str(nodes), SLURM_SUBMIT_DIR=os.getcwd(),
           SLURM_JOB_NODELIST=",".join(f"node-{i}" for i in range(nodes)))
open(os.path.join(state, f"job_{job_id}.json"), "w").write(__import__("json").dumps(header))
out = header.get("output", "slurm-%j.out").replace("%x", name).replace("%j", str(job_id))
if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
    sys.exit(f"fake sbatch: job {job_id} failed: cannot open {out} (directory missing)")
print(f"Submitted batch job {job_id}", flush=True)
with open(out, "a") as f:
    sys.exit(subprocess.call(["bash", script, *script_args], env=env, stdout=f, stderr=f))
'''

FAKE_SRUN = r'''
import json, os, signal, subprocess, sys
state = os.environ["FAKE_SLURM_DIR"]
args, opts = sys.argv[1:], {}
while args and args[0].startswith("-"):
    a = args.pop(0)
    k, eq, v = a.lstrip("-").partition("=")
    if not eq and k in ("nodes", "N", "ntasks", "n", "ntasks-per-node", "w"):
        v = args.pop(0)
    opts[k] = v
if args[0] == "hostname":  # the head node's own address list (hostname -I)
    print(" ".join(["127.0.1.1"] + os.environ.get("FAKE_HOST_IPS", "").split()))
    sys.exit(0)
nodes = int(opts.get("nodes", opts.get("N", os.environ.get("SLURM_NNODES", 1))))
per_node = int(opts.get("ntasks-per-node", 1))
with open(os.path.join(state, "srun_commands.jsonl"), "a") as f:
    f.write(json.dumps({"opts": opts, "argv": args}) + "\n")
if os.environ.get("FAKE_SRUN_RECORD_ONLY"):
    sys.exit(0)
procs = []
for r in range(nodes * per_node):
    env = dict(os.environ, SLURM_PROCID=str(r), SLURM_LOCALID=str(r % per_node),
               SLURM_NODEID=str(r // per_node), SLURM_NTASKS=str(nodes * per_node),
               SLURM_NTASKS_PER_NODE=str(per_node), SLURMD_NODENAME=f"node-{r // per_node}")
    procs.append(subprocess.Popen(args, env=env))
open(os.path.join(state, "pids"), "w").write(" ".join(str(p.pid) for p in procs))
while any(p.poll() is None for p in procs):  # --kill-on-bad-exit: one fails, all go
    if opts.get("kill-on-bad-exit") == "1" and any(p.poll() not in (None, 0) for p in procs):
        for p in procs:
            if p.poll() is None:
                p.kill()
    __import__("time").sleep(0.2)
sys.exit(max(abs(p.returncode) for p in procs))
'''

FAKE_SCONTROL = r'''
import os, sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\n".join(sys.argv[3].split(",")))
'''

FAKE_SQUEUE = r'''
import json, os, sys
job = sys.argv[sys.argv.index("-j") + 1]
assert "%L" in sys.argv, sys.argv
header = json.load(open(os.path.join(os.environ["FAKE_SLURM_DIR"], f"job_{job}.json")))
print(header["time"])  # time left = the whole limit (the job just started)
'''

FAKE_GETENT = r'''
import os, sys
assert sys.argv[1] == "ahostsv4", sys.argv
print(f"127.0.1.1       STREAM {sys.argv[2]}")  # the /etc/hosts trap comes first
for ip in os.environ.get("FAKE_HOST_IPS", "").split():
    print(f"{ip}    STREAM")
'''


def local_ipv4() -> str | None:
    """A non-loopback address of this machine (the 'head node'), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: only picks the route's source
            ip = s.getsockname()[0]
        return None if ip.startswith("127.") else ip
    except OSError:
        return None


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir, state = tmp_path / "bin", tmp_path / "slurm_state"
    bin_dir.mkdir()
    state.mkdir()
    for name, body in [("sbatch", FAKE_SBATCH), ("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL),
                       ("squeue", FAKE_SQUEUE), ("getent", FAKE_GETENT)]:
        p = bin_dir / name
        p.write_text(f"#!{sys.executable}\n{body}")
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    ip = local_ipv4()
    submit = tmp_path / "submit"
    submit.mkdir()
    env = dict(os.environ, PATH=f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
               FAKE_SLURM_DIR=str(state), MEGAQ_REPO=REPO, PYTHON=sys.executable,
               HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    if ip:
        env["FAKE_HOST_IPS"] = ip
    else:  # no routable address on this machine: rendezvous on loopback instead
        env["MASTER_ADDR"] = "127.0.0.1"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env, state, submit, ip


def sbatch(env, submit, extra_env=(), args=(), wait=True, time_limit="1:00:00", job_name=None):
    name = [f"--job-name={job_name}"] if job_name else []
    cmd = ["sbatch", f"--time={time_limit}", *name, SCRIPT, *map(str, args)]
    p = subprocess.Popen(cmd, cwd=submit, env=dict(env, **dict(extra_env)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p.communicate(timeout=400)[0] if wait else p


def test_default_command_for_two_8_gpu_nodes_passes_validation(fake_slurm):
    """The exact command the script builds for 2 nodes x 8 GPUs, default model and layout
    (TP 2: hpZ must become the 4 DP ranks per node, not 8), is accepted by megaq."""
    from megaq.config.arguments import parse_config

    env, state, submit, ip = fake_slurm
    out = sbatch(env, submit, {"FAKE_SRUN_RECORD_ONLY": "1", "DATA_PATH": "/data/c_text_document",
                               "TOKENIZER_MODEL": "/data/tok.model"})
    assert "Submitted batch job 1000" in out
    header = json.load(open(state / "job_1000.json"))
    assert header["signal"] == "USR1@120" and "requeue" in header
    log = (submit / "logs" / "megaq-1000.log").read_text()  # logs/ made by the script
    # The checkpoint directory is per experiment (the job name) and outside the checkout.
    ckpt = os.path.join(env["HOME"], "megaq-runs", "megaq")
    assert os.path.isdir(ckpt) and not ckpt.startswith(REPO)
    run = [json.loads(x) for x in open(state / "srun_commands.jsonl")]
    step = run[-1]
    assert step["opts"]["ntasks-per-node"] == "8" and step["opts"]["nodes"] == "2"
    assert step["opts"]["cpus-per-task"] == "8"  # the job's value, passed on explicitly
    argv = step["argv"][2:]  # python pretrain_gpt.py <flags>
    logged = next(x for x in log.splitlines() if x.startswith("megaq: command:"))
    assert shlex.split(logged.split(":", 2)[2]) == step["argv"]
    c = parse_config(argv, world_size=16, ranks_per_node=8)
    assert (c.parallel.tp, c.zero.hpz_partition_size) == (2, 4)
    assert c.checkpointing.save == c.checkpointing.load == ckpt
    assert c.training.exit_duration_in_mins == 50  # 1 h time limit minus the 10 min margin
    assert c.training.exit_signal_handler
    assert c.parallel.distributed_backend == "nccl" and c.parallel.gpus_per_node == 8
    if ip:  # the loopback trap was skipped
        assert f"rendezvous {ip}:29500" in log and "127.0.1.1" not in log.split("rendezvous")[1][:12]


def _wait_for(pred, timeout, what):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _rows(path):
    if not os.path.exists(path):
        return []
    return [json.loads(x) for x in open(path) if x.strip() and "lm_loss" in x]


TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--seq-length", "16", "--max-position-embeddings", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "400",
        "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-iters", "0",
        "--zero-quantization-block-size", "32"]


def test_trains_saves_on_signal_and_resumes_on_resubmission(fake_slurm):
    env, state, submit, _ = fake_slurm
    knobs = {"GPUS_PER_NODE": "2", "TP": "1", "MOCK_DATA": "1", "VOCAB_SIZE": "64",
             "BACKEND": "gloo", "MASTER_PORT": str(_free_port())}  # no EXPERIMENT
    metrics = os.path.join(env["HOME"], "megaq-runs", "tiny", "metrics.jsonl")
    job = sbatch(env, submit, knobs, TINY, wait=False, job_name="tiny")
    try:
        _wait_for(lambda: len(_rows(metrics)) >= 2, 400, "two training iterations")
        for pid in open(state / "pids").read().split():  # what --signal=USR1@120 does
            os.kill(int(pid), signal.SIGUSR1)
        out = job.communicate(timeout=300)[0]
    finally:
        _kill_job(job, state)
    assert job.returncode == 0, out  # a clean signal exit is a successful job
    log = (submit / "logs" / "tiny-1000.log").read_text()
    assert "hpZ 2" in log and "exiting program at iteration" in log, log[-3000:]
    ckpt = os.path.join(env["HOME"], "megaq-runs", "tiny")
    saved = int(open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read())
    assert 2 <= saved < 400
    # A chained resubmission (a new job id), same job name and still no EXPERIMENT:
    # resumes there and trains on.
    out = sbatch(env, submit, knobs, TINY + ["--exit-interval", str(saved + 2)], job_name="tiny")
    log2 = (submit / "logs" / "tiny-1001.log").read_text()
    assert f"loaded checkpoint {ckpt}" in log2 and f"at iteration {saved}" in log2, log2[-3000:]
    assert int(open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read()) == saved + 2
    assert "Submitted batch job 1001" in out


def _kill_job(job, state):
    """After a failure: no rank, srun or sbatch of the test may outlive it."""
    if job.poll() is None:
        pids = (state / "pids").read_text().split() if (state / "pids").exists() else []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        job.kill()
        job.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
