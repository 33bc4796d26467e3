"""The install matrix: `megaq.kernels` imports, and `pretrain_gpt.py --help` and every
user CLI's `--help` (tools/*.py, and installed, the `megaq-*` commands of
[project.scripts]) work, however megaq is installed and wherever it is run from.

A copy of the checkout (megaq/ with its megaq/kernels link to the top-level kernels/,
kernels/, tools/, the top-level scripts and build files) stands for "the repository".
Each case gets a scratch virtual environment that sees this interpreter's
site-packages as a plain path entry (torch, numpy, ... import), so the .pth files
there, among them an editable install of megaq, never take effect:

- checkout: nothing installed; scripts run from the checkout, `import megaq` with the
  checkout on PYTHONPATH (as Megatron users run it);
- wheel: `pip wheel` of the copy, installed non-editable; the checkout's megaq/ shadows
  the installed one when run from the repository root (its kernels/ must follow);
  the `megaq-*` commands load (and one runs) from another directory;
- editable: `pip install -e` of the copy; its `megaq-*` commands too;
- sdist: the source distribution of the copy, installed by pip (which builds a wheel
  from it); the import check, and that the `megaq-*` commands are installed (they run
  in the wheel case).

The import check runs from the repository root and from another directory in every
case, and so does every CLI with nothing installed. With megaq installed (wheel,
editable) the CLIs run from another directory only: a script started by its path gets
its own folder, not the working directory, on sys.path (and tools/_checkout.py puts the
root first), so the working directory changes no import; it matters only to relative
file paths, which a run from outside the checkout is the one to catch. Budget ~35 s on
2 cores (mostly `import torch` in the CLIs that need it).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from concurrent.futures import ThreadPoolExecutor

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the import check prints: where megaq and megaq.kernels were found (and the file
# behind the kernels, through the checkout's link), that a kernels submodule resolves
# through the package's __path__, and whether a top-level `kernels` is importable.
PROBE = ("import importlib.util, json, os, megaq, megaq.kernels, megaq.kernels.format; "
         "print(json.dumps({'megaq': megaq.__file__, 'kernels': megaq.kernels.__file__, "
         "'kernels_real': os.path.realpath(megaq.kernels.__file__), "
         "'top_level_kernels': importlib.util.find_spec('kernels') is not None}))")


def _why_no_build() -> str | None:
    """Why this interpreter cannot build a wheel offline, or None.

    Asked in a child process: probing pip in this one (even `find_spec("pip")`) makes
    setuptools' distutils shim stand down for the rest of the session, and a later
    `import setuptools` (torch.utils.cpp_extension, megatron-core) then fails.
    """
    probe = ("import setuptools\n"  # before pip: see above
             "try:\n    import setuptools.command.bdist_wheel\n"
             "except ImportError:\n    import wheel.bdist_wheel\n"
             "import pip\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return (f"{last} (pip, and setuptools >= 70.1 or wheel, are needed; "
                "scripts/setup_env.sh installs them)")
    return None


def _run(cmd: list[str], cwd: str, env: dict | None = None, timeout: float = 300):
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _copy_checkout(dst: str) -> None:
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for folder in ("megaq", "kernels", "tools"):  # links stay links (megaq/kernels), as in a clone
        shutil.copytree(os.path.join(REPO, folder), os.path.join(dst, folder), ignore=skip, symlinks=True)
    assert os.path.islink(os.path.join(dst, "megaq", "kernels")), "megaq/kernels must be the link to kernels/"
    top = {"pyproject.toml", "README.md"} | {n for n in os.listdir(REPO) if n.endswith(".py")}
    for name in sorted(top):
        shutil.copy2(os.path.join(REPO, name), dst)


def _scratch_env(path: str) -> str:
    """A venv whose python sees this interpreter's site-packages as plain path entries."""
    r = _run([sys.executable, "-m", "venv", "--without-pip", path], cwd=REPO)
    assert r.returncode == 0, r.stderr
    python = os.path.join(path, "bin", "python")
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                   cwd=path).stdout.strip()
    shared = [p for p in site.getsitepackages() if os.path.isdir(p)]
    with open(os.path.join(purelib, "_shared_site.pth"), "w") as f:
        f.write("\n".join(shared) + "\n")
    return python


def _pip_install(env_dir: str, *what: str) -> None:
    # --prefix into the scratch venv; --ignore-installed so pip never touches the copy
    # of megaq that this interpreter's own environment may hold
    r = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
              "--ignore-installed", "--prefix", env_dir, *what], cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> dict:
    why = _why_no_build()
    if why:
        pytest.skip(f"cannot build a wheel offline: {why}")
    root = tmp_path_factory.mktemp("install")
    repo = str(root / "repo")
    os.makedirs(repo)
    _copy_checkout(repo)
    elsewhere = str(root / "elsewhere")
    os.makedirs(elsewhere)
    dist = str(root / "dist")
    r = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
              "-w", dist, repo], cwd=elsewhere)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    wheels = glob.glob(os.path.join(dist, "megaq-*.whl"))
    assert len(wheels) == 1, os.listdir(dist)
    r = _run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({dist!r})"],
             cwd=repo)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    sdists = glob.glob(os.path.join(dist, "megaq-*.tar.gz"))
    assert len(sdists) == 1, os.listdir(dist)
    # both carry the kernels as files of megaq/kernels/, and no top-level `kernels`
    with zipfile.ZipFile(wheels[0]) as z:
        wheel_files = z.namelist()
    with tarfile.open(sdists[0]) as t:
        sdist_files = [m.name.split("/", 1)[1] for m in t.getmembers() if m.isfile()]
    for files in (wheel_files, sdist_files):
        assert "megaq/kernels/quant_triton.py" in files and not any(f.startswith("kernels/") for f in files)
    return {"root": str(root), "repo": repo, "elsewhere": elsewhere, "wheel": wheels[0], "sdist": sdists[0]}


def _commands(repo: str) -> list[str]:
    """The console scripts pyproject.toml declares (megaq-pretrain, megaq-preprocess, ...)."""
    # read as text: tomllib is Python 3.11+, and the project supports 3.10
    text = open(os.path.join(repo, "pyproject.toml"), encoding="utf-8").read()
    section = text.split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    scripts = [line.split("=")[0].strip() for line in section.splitlines()
               if "=" in line and not line.lstrip().startswith("#")]
    assert {"megaq-pretrain", "megaq-preprocess", "megaq-convert", "megaq-generate",
            "megaq-train-tokenizer", "megaq-plot", "megaq-build-corpus"} <= set(scripts)
    return sorted(scripts)


def _clis(repo: str) -> list[str]:
    clis = ["pretrain_gpt.py"] + sorted(os.path.relpath(p, repo)
                                        for p in glob.glob(os.path.join(repo, "tools", "*.py"))
                                        if not os.path.basename(p).startswith("_"))
    # the user CLIs the README and docs/DATA.md name must be among them
    for name in ("preprocess_data", "train_tokenizer", "generate", "plot_metrics", "build_corpus"):
        assert os.path.join("tools", f"{name}.py") in clis
    return clis


@pytest.mark.parametrize("install", ["checkout", "wheel", "editable", "sdist"])
def test_install_matrix(install, checkout):
    repo, elsewhere = checkout["repo"], checkout["elsewhere"]
    env_dir = os.path.join(checkout["root"], f"env_{install}")
    python = _scratch_env(env_dir)
    if install in ("wheel", "sdist"):
        _pip_install(env_dir, checkout[install])
    elif install == "editable":
        _pip_install(env_dir, "-e", repo)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.setdefault("TRITON_INTERPRET", "1")
    installed_megaq = os.path.join(env_dir, "lib")  # the wheel's site-packages lie under it
    if install == "checkout":  # the case only means something if no megaq is installed
        r = _run([python, "-c", "import megaq"], cwd=elsewhere, env=env)
        assert r.returncode != 0 and "No module named 'megaq'" in r.stderr, (
            "the scratch environment sees an installed megaq: " + r.stdout + r.stderr)

    jobs = []  # (what, cmd, cwd, env, expected megaq root or None)
    for cwd in (repo, elsewhere):
        where = "repository root" if cwd == repo else "another directory"
        # installed: the CLIs from another directory only (see the module docstring)
        run_clis = install == "checkout" or (install != "sdist" and cwd == elsewhere)
        for cli in _clis(repo) if run_clis else ():
            script = cli if cwd == repo else os.path.join(repo, cli)
            jobs.append((f"{cli} --help from the {where}", [python, script, "--help"], cwd, env,
                         None))
        probe_env = env
        if install == "checkout" and cwd == elsewhere:  # nothing installed: the checkout on the path
            probe_env = dict(env, PYTHONPATH=repo)
        # from the root the checkout's megaq/ shadows any installed copy; elsewhere the
        # wheel's own copy answers; an editable install points into the checkout
        expect = installed_megaq if (install in ("wheel", "sdist") and cwd == elsewhere) else repo
        jobs.append((f"import megaq.kernels from the {where}", [python, "-c", PROBE], cwd,
                     probe_env, expect))
    bindir = os.path.join(env_dir, "bin")
    commands = _commands(repo) if install != "checkout" else []
    for command in commands:
        assert os.path.isfile(os.path.join(bindir, command)), f"{install}: {command} is not in {bindir}"
    if commands and install != "sdist":
        # every command's function loads (one process: one `import torch`), and one script
        # runs; by the scratch env's python: pip ran under this interpreter (--prefix), so
        # the scripts' #! names it, and it does not see the scratch env
        load = ("from importlib.metadata import entry_points; "
                f"got = [ep.load() for ep in entry_points(group='console_scripts') if ep.name in {commands!r}]; "
                f"assert len(got) == {len(commands)}, got; "
                "print('usage: every megaq-* command loads')")  # the check below wants 'usage:'
        jobs.append(("the megaq-* commands load", [python, "-c", load], elsewhere, env, None))
        jobs.append(("megaq-plot --help from another directory",
                     [python, os.path.join(bindir, "megaq-plot"), "--help"], elsewhere, env, None))

    def run(job):
        what, cmd, cwd, job_env, expect = job
        return job, _run(cmd, cwd=cwd, env=job_env)

    failures = []
    with ThreadPoolExecutor(max_workers=3) as pool:
        for (what, cmd, cwd, _, expect), r in pool.map(run, jobs):
            if r.returncode != 0:
                failures.append(f"{install}: {what}: exit {r.returncode}\n{r.stderr[-1500:]}")
            elif expect is None:
                if "usage:" not in r.stdout:
                    failures.append(f"{install}: {what}: no usage text\n{r.stdout[-500:]}")
            else:
                got = json.loads(r.stdout)
                megaq_file, kernels_file = got["megaq"], got["kernels"]
                # megaq.kernels is the kernels beside the megaq that was imported: in a
                # checkout megaq/kernels, the link to its top-level kernels/; installed, the
                # wheel's megaq/kernels/ folder
                if not megaq_file.startswith(expect + os.sep):
                    failures.append(f"{install}: {what}: megaq from {megaq_file}, expected under {expect}")
                beside = os.path.join(os.path.dirname(megaq_file), "kernels")
                if os.path.dirname(kernels_file) != beside:
                    failures.append(f"{install}: {what}: megaq.kernels from {kernels_file}, "
                                    f"expected {beside} (megaq from {megaq_file})")
                real = os.path.join(repo, "kernels") if expect == repo else beside
                if os.path.dirname(got["kernels_real"]) != real:
                    failures.append(f"{install}: {what}: megaq.kernels' files in {got['kernels_real']}, "
                                    f"expected {real}")
                # an install exposes no top-level `kernels` (the name is another project's);
                # a checkout on the path does: its root holds the folder
                if cwd == elsewhere and install != "checkout" and got["top_level_kernels"]:
                    failures.append(f"{install}: {what}: a top-level `kernels` is importable")
    assert not failures, "\n\n".join(failures)
