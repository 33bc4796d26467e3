"""scripts/launch_local.sh picks the backend without mixing GPUs and CPU ranks, and the
start-up banner names the device, backend, world size and layout."""

import os
import stat
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(tmp_path, ngpu, **env):
    """Run launch_local.sh with `ngpu` fake GPUs (nvidia-smi) and a torchrun that only
    prints its command line; -> (exit code, stdout, stderr)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fakes = {"torchrun": 'echo "torchrun $*"',
             "nvidia-smi": "".join(f'echo "GPU {i}: Fake H200 (UUID: GPU-{i})"; ' for i in range(ngpu))
                           or "exit 9"}
    for name, body in fakes.items():
        p = bin_dir / name
        p.write_text(f"#!/usr/bin/env bash\n{body}\n")
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    e = dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin", **env)
    for k in ("NPROC", "MEGAQ_BACKEND", "GPUS_PER_NODE"):
        if k not in env:
            e.pop(k, None)
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "launch_local.sh"), "--mock-data"],
                       env=e, capture_output=True, text=True, timeout=30)
    return r.returncode, r.stdout, r.stderr


def test_more_ranks_than_gpus_is_refused(tmp_path):
    rc, out, err = _launch(tmp_path, 2, NPROC="4")
    assert rc == 2 and not out
    assert err.strip() == ("error: NPROC=4 ranks but only 2 GPU(s): use NPROC<=2, or ask for "
                           "CPU ranks explicitly with MEGAQ_BACKEND=gloo")
    rc, _, err = _launch(tmp_path, 2, NPROC="4", MEGAQ_BACKEND="nccl")
    assert rc == 2 and "MEGAQ_BACKEND=nccl needs a GPU per rank" in err


@pytest.mark.parametrize("ngpu,env,backend,nproc", [
    (2, {}, "nccl", "2"),                                    # one rank per GPU
    (2, {"NPROC": "2"}, "nccl", "2"),
    (2, {"NPROC": "4", "MEGAQ_BACKEND": "gloo"}, "gloo", "4"),  # CPU ranks, asked for
    (0, {}, "gloo", "2"),                                    # no GPUs: CPU ranks
])
def test_backend_choice(tmp_path, ngpu, env, backend, nproc):
    rc, out, err = _launch(tmp_path, ngpu, **env)
    assert rc == 0, err
    assert f"--nproc_per_node {nproc} " in out and f"--distributed-backend {backend} " in out
    assert ("no GPUs found" in err) == (ngpu == 0)


def _banner(topo, argv):
    from megaq.pretrain import main
    main(argv, topo=topo)


def test_banner_names_device_backend_world_and_layout(tmp_path, capfd):
    from megaq.testing.ranks import run_on_ranks
    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "64",
            "--eval-iters", "0",
            "--tensor-model-parallel-size", "2", "--data-cache-path", str(tmp_path / "c")]
    run_on_ranks(_banner, 2, tp=2, args=(argv,))
    out = capfd.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith(" megaq: device"))
    assert line.startswith(" megaq: device cpu, backend gloo; world 2 = TP 2 x PP 1 x DP 1 on "
                           "1 node(s) of 2;"), line


def test_one_process_without_a_launcher_needs_no_port_and_leaves_the_environment_alone():
    """`python pretrain_gpt.py` (no torchrun): rank 0 of 1 on an in-process store, so no
    free port can be taken by another process first, and no RANK / MASTER_* variables
    are written for child processes to inherit half of."""
    code = ("import os; before = dict(os.environ)\n"
            "from megaq.parallel.launch import init_from_env\n"
            "import torch.distributed as dist\n"
            "assert init_from_env('gloo') == (0, 1) and dist.get_world_size() == 1\n"
            "assert dict(os.environ) == before\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env={**env, "PYTHONPATH": REPO})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
