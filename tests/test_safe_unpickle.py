"""Nothing megaq reads can run code (megaq/checkpoint/safe_unpickle.py).

Every reader and every entry point gets a planted file whose pickle would create a
marker file (os.system("touch MARKER"), as a downloaded checkpoint could hold), its
manifest entry re-hashed as an attacker would: DCP's .metadata, megaq's model_optim.pt,
a transformers pytorch_model.bin, Megatron-LM's model_optim_rng.pt; through
pretrain_gpt.py --load (both formats), tools/generate.py --load and every route of
tools/convert_checkpoint.py. Each must exit 2 with one `error:` line naming the file
and the forbidden class, and no marker may appear. Also: the loader reads real files of
every format (Megatron's enums without Megatron installed), the DCP index is read once
per conversion, integrity is checked before the flags, and --overwrite replaces only
what megaq wrote.
"""

import argparse
import ast
import json
import os
import pickle
import shutil
import signal
import sys

import numpy as np
import pytest
import torch

from data_fixtures import tool
from megaq import export_files, pretrain
from megaq.checkpoint import dcp_format, integrity, paths, safe_unpickle
from megaq.checkpoint.errors import CheckpointError
from megaq.testing.ranks import run_cli_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRIALS = tool("cluster/fault_trials")  # RunsCommand, plant_in_dcp_index, rehash: one home

# GPT-2 style (learned positions, LayerNorm, GELU, biases): exportable to transformers
TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--micro-batch-size", "1", "--lr", "1e-3", "--mock-data",
        "--vocab-size", "64", "--eval-iters", "0", "--log-interval", "1",
        "--lr-decay-iters", "4"]


def error_lines(text):
    return [x for x in text.splitlines() if "error:" in x]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{format: checkpoint root at iteration 1}, one rank each (copied per test)."""
    out = {}
    for fmt in ("torch_dist", "torch"):
        root = str(tmp_path_factory.mktemp(fmt))
        r = run_cli_on_ranks(pretrain.cli, TINY + ["--train-iters", "1", "--save", root,
                                                   "--ckpt-format", fmt], 1)
        assert r["codes"] == [0], r["stderr"]
        out[fmt] = root
    return out


def copy(saved, fmt, tmp_path) -> tuple[str, str]:
    """(a copy of the `fmt` checkpoint root, its iteration directory)."""
    root = str(tmp_path / f"ck_{fmt}")
    shutil.copytree(saved[fmt], root)
    return root, paths.iteration_dir(root, 1)


def plant_in_torch_file(ckpt_dir: str, rel: str, marker: str) -> str:
    """Put a command into a torch.save file of a checkpoint (beside its contents) and
    re-hash it. Returns the file's path."""
    path = os.path.join(ckpt_dir, rel)
    sd = torch.load(path, weights_only=True)
    sd["planted"] = TRIALS.RunsCommand(f"touch {marker}")
    torch.save(sd, path)
    TRIALS.rehash(ckpt_dir, rel)
    return path


def plant(fmt: str, it: str, marker: str) -> str:
    """The file a format's load reads first, planted."""
    if fmt == "torch_dist":
        return TRIALS.plant_in_dcp_index(it, marker)
    return plant_in_torch_file(it, "mp_rank_00_000/model_optim.pt", marker)


def refused_line(err: str, path: str) -> bool:
    lines = err.strip().splitlines()
    return (len(lines) == 1 and lines[0].startswith(f"error: {path} refers to posix.system")
            and "could run code" in lines[0])


# ------------------------------------------------------------------------ the loader
def allow_list_as_shipped(monkeypatch):
    """torch's process-wide weights_only allow-list (torch.serialization.add_safe_globals)
    as torch ships it, empty, for the rest of the test. megaq never adds to it
    (safe_unpickle allows its formats' classes for the call only), but megatron-core adds
    its own classes when it is first imported, as other tests here do."""
    monkeypatch.setattr(torch._weights_only_unpickler, "_marked_safe_globals_set", set())


def test_the_loader_reads_each_format_and_refuses_anything_else(saved, tmp_path, monkeypatch):
    allow_list_as_shipped(monkeypatch)
    _, it = copy(saved, "torch_dist", tmp_path)
    index = os.path.join(it, ".metadata")
    with open(index, "rb") as f:
        plain = pickle.load(f)  # megaq's own, just written: the reference
    assert safe_unpickle.load(index, safe_unpickle.DCP_INDEX) == plain

    # the planted index is hostile: plain pickle runs its command (the test can fail) ...
    marker = tmp_path / "ran"
    TRIALS.plant_in_dcp_index(it, str(marker))
    with open(index, "rb") as f:
        assert pickle.load(f).state_dict_metadata == plain.state_dict_metadata
    assert marker.exists()
    marker.unlink()
    # ... the loader refuses it, naming the file and the class, and runs nothing
    with pytest.raises(safe_unpickle.UnpicklingRefused) as e:
        safe_unpickle.load(index, safe_unpickle.DCP_INDEX)
    assert str(e.value).startswith(f"{index} refers to posix.system, which a DCP index")
    # a torch.save file, in every format's allow-list
    evil = str(tmp_path / "evil.pt")
    torch.save({"w": torch.ones(2), "x": TRIALS.RunsCommand(f"touch {marker}")}, evil)
    for fmt in (safe_unpickle.TENSORS, safe_unpickle.MEGATRON, safe_unpickle.DEEPSPEED):
        with pytest.raises(safe_unpickle.UnpicklingRefused, match=f"^{evil} refers to posix.system"):
            safe_unpickle.load(evil, fmt)
    assert not marker.exists()

    # what Megatron-LM pickles beside its tensors
    import pathlib
    import random
    args = argparse.Namespace(num_layers=2, params_dtype=torch.bfloat16, exit_signal=signal.SIGTERM,
                              data_path=[pathlib.Path("/data/x")])
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state()}
    torch.save({"args": args, "rng_state": [rng], "model": {"w": torch.ones(3)}}, evil)
    got = safe_unpickle.load(evil, safe_unpickle.MEGATRON)
    assert vars(got["args"]) == vars(args)
    assert np.array_equal(got["rng_state"][0]["np_rng_state"][1], rng["np_rng_state"][1])
    # megaq's own files hold none of that
    with pytest.raises(safe_unpickle.UnpicklingRefused, match="refers to argparse.Namespace"):
        safe_unpickle.load(evil, safe_unpickle.TENSORS)


def test_an_index_naming_a_file_outside_its_directory_is_refused(saved, tmp_path):
    """The allowed classes in the wrong places: a storage entry naming ../x would make
    DCP read a file outside the checkpoint (with --no-verify-checkpoint: no manifest to
    stop it)."""
    _, it = copy(saved, "torch_dist", tmp_path)
    index = os.path.join(it, ".metadata")
    with open(index, "rb") as f:
        md = pickle.load(f)
    first = next(iter(md.storage_data))
    md.storage_data[first].relative_path = "../../elsewhere.distcp"
    with open(index, "wb") as f:
        pickle.dump(md, f)
    TRIALS.rehash(it, ".metadata")
    with pytest.raises(CheckpointError, match=r"is not a DCP index \(a storage entry names "
                                              r"'../../elsewhere.distcp', not a file of its"):
        dcp_format.VerifiedReader(integrity.Verifier(it)).read_metadata()


def test_megatron_classes_are_read_without_megatron(tmp_path, monkeypatch):
    """A Megatron-LM file's enums become stand-ins that keep the class name and value,
    with `import megatron` failing and without the classes megatron-core registers with
    torch on import."""
    pytest.importorskip("megatron.core")
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend
    path = str(tmp_path / "m.pt")
    torch.save({"args": argparse.Namespace(model_type=ModelType.encoder_or_decoder,
                                           attention_backend=AttnBackend.auto)}, path)
    monkeypatch.setitem(sys.modules, "megatron", None)
    allow_list_as_shipped(monkeypatch)  # after megatron-core's import added its classes
    a = safe_unpickle.load(path, safe_unpickle.MEGATRON)["args"]
    assert isinstance(a.model_type, safe_unpickle.MegatronObject)
    assert (a.model_type.qualified_name, a.model_type.value) == ("megatron.core.enums.ModelType", 1)
    assert a.attention_backend.qualified_name == "megatron.core.transformer.enums.AttnBackend"
    assert a.attention_backend.value == AttnBackend.auto.value
    assert torch.serialization.get_safe_globals() == []  # the call widened nothing for good


def _unpickling_calls(path):
    """(line, call) of every torch.load / pickle.load(s) / pickle.Unpickler / numpy
    allow_pickle=True in a source file."""
    out = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = (f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                else f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
        pickles = any(k.arg == "allow_pickle" and getattr(k.value, "value", False) is True
                      for k in node.keywords)
        if name in ("torch.load", "pickle.load", "pickle.loads", "pickle.Unpickler", "Unpickler",
                    "_pickle.load", "cPickle.load") or pickles:
            out.append((node.lineno, name or "allow_pickle=True"))
    return out


def test_nothing_else_unpickles():
    """Every unpickling in megaq, its tools and pretrain_gpt.py is megaq.checkpoint.safe_unpickle's,
    except megaq.testing.ranks.run_on_ranks's (a forked child's return value over a pipe: not a
    file, not untrusted; the reason is at the call)."""
    allowed = {os.path.join("megaq", "checkpoint", "safe_unpickle.py"): 1,
               os.path.join("megaq", "testing", "ranks.py"): 1,
               # the fault trials plant a hostile index: they read megaq's own first
               os.path.join("tools", "cluster", "fault_trials.py"): 1}
    found = {}
    for top in ("megaq", "tools", "kernels", "pretrain_gpt.py"):
        base = os.path.join(REPO, top)
        files = [base] if top.endswith(".py") else [
            os.path.join(d, n) for d, _, ns in os.walk(base) for n in ns if n.endswith(".py")]
        for path in files:
            calls = _unpickling_calls(path)
            if calls:
                found[os.path.relpath(path, REPO)] = calls
    counts = {rel: len(calls) for rel, calls in found.items()}
    assert counts == allowed, found


# ----------------------------------------------------------------------- entry points
@pytest.mark.parametrize("fmt,world", [("torch_dist", 2), ("torch", 1)])
def test_pretrain_load_refuses_a_planted_checkpoint(saved, tmp_path, fmt, world):
    root, it = copy(saved, fmt, tmp_path)
    marker = tmp_path / "ran"
    path = plant(fmt, it, str(marker))
    r = run_cli_on_ranks(pretrain.cli, TINY + ["--train-iters", "2", "--load", root], world)
    assert all(c != 0 for c in r["codes"]) and 2 in r["codes"], r
    lines = error_lines(r["stderr"])
    assert len(lines) == 1 and path in lines[0] and "refers to posix.system" in lines[0], r["stderr"]
    assert "Traceback" not in r["stderr"]
    assert not marker.exists()


def test_generate_refuses_planted_checkpoints(saved, tmp_path, capsys):
    generate = tool("generate")
    marker = tmp_path / "ran"
    for fmt in ("torch_dist", "torch"):
        root, it = copy(saved, fmt, tmp_path)
        path = plant(fmt, it, str(marker))
        capsys.readouterr()
        assert generate.main(["--load", root, "--prompt", "x"]) == 2
        err = capsys.readouterr().err
        assert refused_line(err, path), err
    assert not marker.exists()


def _planted_hf_dir(tmp_path, marker) -> tuple[str, str]:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 16, "num_attention_heads": 2,
        "num_hidden_layers": 1, "intermediate_size": 32, "vocab_size": 64,
        "max_position_embeddings": 16}))
    path = str(hf / "pytorch_model.bin")
    torch.save({"model.embed_tokens.weight": torch.zeros(64, 16),
                "lm_head.weight": TRIALS.RunsCommand(f"touch {marker}")}, path)
    return str(hf), path


def _planted_megatron_dir(tmp_path, marker) -> tuple[str, str]:
    from tests.test_megatron_import import save_megatron
    args = argparse.Namespace(num_layers=1, hidden_size=8, num_attention_heads=2,
                              tokenizer_model=TRIALS.RunsCommand(f"touch {marker}"))
    root = save_megatron(str(tmp_path / "mlm"), {(0, 0): [{}]}, args)
    return root, os.path.join(root, "iter_0000007", "mp_rank_00", "model_optim_rng.pt")


def _planted_deepspeed_dir(tmp_path, marker) -> tuple[str, str]:
    """DeepSpeed's own fixture (tests/fixtures/deepspeed_zero3), its universal form's
    optimizer state replaced by a file that runs a command when unpickled."""
    root = str(tmp_path / "ds")
    shutil.copytree(os.path.join(REPO, "tests", "fixtures", "deepspeed_zero3", "deepspeed"), root)
    path = os.path.join(root, "global_step3_universal", "zero", "optimizer_state.pt")
    torch.save({"optimizer_state_dict": TRIALS.RunsCommand(f"touch {marker}")}, path)
    return root, path


def test_convert_refuses_planted_files_on_every_route(saved, tmp_path, capsys):
    convert = tool("convert_checkpoint")
    marker = tmp_path / "ran"
    routes = []
    for fmt, other in (("torch_dist", "torch"), ("torch", "torch_dist")):
        root, it = copy(saved, fmt, tmp_path)
        path = plant(fmt, it, str(marker))
        routes += [(["--to", "hf", "--input", root], path),
                   (["--to", "megaq", "--ckpt-format", other, "--input", root], path)]
    hf, path = _planted_hf_dir(tmp_path, marker)
    routes.append((["--from", "hf", "--to", "megaq", "--input", hf], path))
    mlm, path = _planted_megatron_dir(tmp_path, marker)
    routes.append((["--from", "megatron", "--to", "megaq", "--input", mlm], path))
    ds, path = _planted_deepspeed_dir(tmp_path, marker)
    routes.append((["--from", "deepspeed", "--to", "megaq", "--input", ds,
                    "--num-attention-heads", "4"], path))
    for argv, path in routes:
        out = tmp_path / "out"
        capsys.readouterr()
        assert convert.main([str(a) for a in argv + ["--output", out]]) == 2, argv
        err = capsys.readouterr().err
        assert refused_line(err, path), (argv, err)
        assert not out.exists() and not marker.exists()


@pytest.mark.parametrize("case,expect", [
    ("args_dict", "holds 'args' as a dict, not the argparse.Namespace Megatron-LM saves"),
    ("args_text", "the saved flag num_layers is '4' (a str), not a int"),
    ("model_list", "its model state is a list, not a dict of named tensors"),
    ("not_a_dict", "holds a list, not the dict Megatron-LM saves"),
])
def test_megatron_files_of_the_wrong_shape_are_one_line(tmp_path, capsys, case, expect):
    """--from megatron checks the type of what it reads (a dict `args` was an
    AttributeError traceback)."""
    from tests.test_megatron_import import save_megatron
    args = argparse.Namespace(num_layers=1, hidden_size=8, num_attention_heads=2)
    root = save_megatron(str(tmp_path / "mlm"), {(0, 0): [{}]}, args)
    path = os.path.join(root, "iter_0000007", "mp_rank_00", "model_optim_rng.pt")
    sd = torch.load(path, weights_only=False)  # the test's own file
    if case == "args_dict":
        sd["args"] = vars(sd["args"])
    elif case == "args_text":
        sd["args"].num_layers = "4"
    elif case == "model_list":
        sd["model"] = [torch.ones(2)]
    else:
        sd = [sd]
    torch.save(sd, path)
    capsys.readouterr()
    rc = tool("convert_checkpoint").main(["--from", "megatron", "--to", "megaq", "--input", root,
                                          "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith(f"error: {path}"), err
    assert expect in err, err


# ------------------------------------------------------ one index read, progress shown
class _Terminal:
    """A stderr that says it is a terminal (tqdm then draws its bar), kept in memory."""

    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s

    def flush(self):
        pass

    def isatty(self):
        return True


def test_export_reads_the_index_once_and_shows_progress(saved, tmp_path, monkeypatch):
    """The export read .metadata once per tensor (28 times for a 2-layer model); it
    reads it once, and shows a progress bar per tensor on a terminal."""
    from megaq.interop.hf import export_to_hf
    root, _ = copy(saved, "torch_dist", tmp_path)
    reads = []
    real = safe_unpickle.load
    monkeypatch.setattr(safe_unpickle, "load", lambda path, fmt=safe_unpickle.TENSORS, **kw:
                        reads.append(fmt) or real(path, fmt, **kw))
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    out = export_to_hf(root, str(tmp_path / "hf"), log=lambda *_: None)
    assert reads.count(safe_unpickle.DCP_INDEX) == 1
    n = sum(1 for _ in dcp_format.VerifiedReader(integrity.Verifier(paths.iteration_dir(root, 1)))
            .read_metadata().state_dict_metadata if _.startswith("model."))
    assert n > 5 and "exporting" in terminal.text and f"/{n}" in terminal.text
    assert export_files.is_export(out["dir"])


# ------------------------------------------------------------- integrity, then flags
@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_a_damaged_file_is_named_before_any_flag_is_compared(saved, tmp_path, fmt):
    """A flipped RNG file, resumed with another LR schedule: the damage is the error
    (it was reported as an LR-schedule mismatch: the flags were compared first)."""
    root, it = copy(saved, fmt, tmp_path)
    rng = paths.rng_file(it, 0)
    data = bytearray(open(rng, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(rng, "wb").write(bytes(data))
    argv = [f if f != "4" else "5" for f in TINY]  # --lr-decay-iters 5: another schedule
    r = run_cli_on_ranks(pretrain.cli, argv + ["--train-iters", "2", "--load", root], 1)
    lines = error_lines(r["stderr"])
    assert r["codes"] == [2] and len(lines) == 1, r["stderr"]
    assert f"{rng} is damaged: sha256" in lines[0]


# ----------------------------------------------------- --overwrite: only megaq's own
def _tree(root):
    return {os.path.relpath(os.path.join(d, n), root): open(os.path.join(d, n), "rb").read()
            for d, _, ns in os.walk(root) for n in ns}


def test_overwrite_replaces_only_what_megaq_wrote(saved, tmp_path, capsys):
    convert = tool("convert_checkpoint")
    root = saved["torch_dist"]

    def run(*argv):
        capsys.readouterr()
        rc = convert.main([str(a) for a in argv] + ["--overwrite"])
        return rc, capsys.readouterr().err

    # someone's directory: refused on both kinds of output, not a byte changed
    models = tmp_path / "models"
    (models / "llama").mkdir(parents=True)
    (models / "llama" / "config.json").write_text("{}")
    (models / "notes.txt").write_text("keep")
    before = _tree(tmp_path)
    for argv, what in ((["--to", "hf"], "Hugging Face export"),
                       (["--to", "megaq", "--ckpt-format", "torch"], "megaq checkpoint")):
        rc, err = run(*argv, "--input", root, "--output", models)
        assert rc == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: --output {models} is not an earlier {what} written by "
                              f"megaq"), err
        assert _tree(tmp_path) == before
    # an earlier export is replaced by an export, not by a checkpoint (nor the reverse)
    export, old = tmp_path / "export", tmp_path / "old"
    assert run("--to", "hf", "--input", root, "--output", export)[0] == 0
    assert run("--to", "hf", "--input", root, "--output", export)[0] == 0
    assert run("--to", "megaq", "--ckpt-format", "torch", "--input", root, "--output", old)[0] == 0
    assert run("--to", "megaq", "--ckpt-format", "torch", "--input", root, "--output", old)[0] == 0
    assert export_files.is_export(str(export)) and paths.read_tracker(str(old)) == 1
    rc, err = run("--to", "megaq", "--ckpt-format", "torch", "--input", root, "--output", export)
    assert rc == 2 and "is not an earlier megaq checkpoint" in err
    rc, err = run("--to", "hf", "--input", root, "--output", old)
    assert rc == 2 and "is not an earlier Hugging Face export" in err
    # an export with one more file, or a link in it, is no longer only megaq's
    os.symlink(models / "notes.txt", export / "tokenizer.json")
    assert not export_files.is_export(str(export))
