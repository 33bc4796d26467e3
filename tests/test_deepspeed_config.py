"""--deepspeed-config (megaq/config/deepspeed_config.py): a DeepSpeed ds_config is read as
megaq's flags. The ds_config of DeepSpeed's ZeRO++ tutorial maps to megaq's ZeRO++ flags
and trains; every key megaq cannot honour is listed in one error line; a bad file is one
error line; the batch sizes follow DeepSpeed's rule; a command-line flag that disagrees
with the file is refused."""

import json
import math
import os

import pytest

from megaq import pretrain
from megaq.config import megatron_flags
from megaq.config.arguments import ArgumentsError, parse_config, print_notes_once, run_problems
from megaq.config.deepspeed_config import MAX_CONFIG_BYTES, map_config
from megaq.testing.ranks import run_cli_on_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
TUTORIAL = os.path.join(HERE, "fixtures", "deepspeed", "ds_zeropp_config.json")

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--train-iters", "3", "--mock-data", "--vocab-size", "64",
        "--eval-iters", "0", "--log-interval", "1"]


def write(tmp_path, cfg, name="ds.json") -> str:
    path = tmp_path / name
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(path)


def test_zeropp_tutorial_config_maps_to_megaq_flags():
    """The tutorial's file at its own cluster, 4 nodes of 16 GPUs: ZeRO-3 with qwZ, hpZ over
    16 GPUs and qgZ, a 10M-element reduce bucket (4 bytes each in fp32, 2 in bf16); the
    keys that change nothing are noted in the mapping block."""
    argv = BASE + ["--micro-batch-size", "1", "--lr", "1e-3", "--deepspeed",
                   "--deepspeed_config", TUTORIAL]
    config, flags, problems, notes = run_problems(argv, world_size=64, ranks_per_node=16)
    assert problems == []
    mapping = flags.deepspeed.mapping
    assert mapping.tokens() == ["--zero-stage", "3", "--zero-reduce-bucket-size", "10000000",
                                "--zero-quantized-weights", "--zero-hpz-partition-size", "16",
                                "--zero-quantized-gradients"]
    z = config.zero
    assert (z.stage, z.quantized_weights, z.fp8_weights, z.hpz_partition_size,
            z.quantized_gradients) == (3, True, False, 16, True)
    assert z.reduce_bucket_size == 10_000_000 * 4
    bf16 = run_problems(argv + ["--bf16"], world_size=64, ranks_per_node=16)[0]
    assert bf16.zero.reduce_bucket_size == 10_000_000 * 2
    printed = []
    megatron_flags._printed.clear()
    print_notes_once(flags, notes, print_fn=printed.append)
    block = printed[0].splitlines()
    assert block[0].startswith("------------------------ deepspeed config ")
    assert "  zero_optimization.zero_hpz_partition_size ... --zero-hpz-partition-size 16" in block
    noted = next(x for x in block if x.startswith("  noted, no effect in megaq: "))
    assert all(k in noted for k in ("reduce_scatter", "contiguous_gradients", "overlap_comm"))
    assert any("gradient_clipping, megaq's --clip-grad 1.0 applies" in x for x in block)
    # the defaults without a file are unchanged
    plain = parse_config(BASE + ["--micro-batch-size", "1", "--lr", "1e-3"], world_size=1).zero
    assert (plain.reduce_bucket_size, plain.prefetch, plain.param_persistence_threshold,
            plain.grad_sync) == (500_000_000, 1, 0, "per_microbatch")


def _train_losses(tmp_path, name, argv) -> tuple[list[float], dict]:
    """3 iterations of `argv` on 4 gloo ranks posing as 2 nodes x 2: (losses, the run)."""
    metrics = tmp_path / f"{name}.jsonl"
    r = run_cli_on_ranks(pretrain.cli, BASE + argv + ["--gpus-per-node", "2", "--metrics-file",
                                                      str(metrics)], 4, timeout=240)
    assert r["codes"] == [0, 0, 0, 0], r["stderr"][-3000:]
    train = [x for x in map(json.loads, metrics.read_text().splitlines())
             if x.get("type") == "train"]
    assert train[-1]["consumed_samples"] == 3 * 8  # train_batch_size 8 = 1 x 2 x DP 4
    return [x["lm_loss"] for x in train], r


def test_zeropp_tutorial_config_trains_on_two_posed_nodes(tmp_path):
    """The tutorial's file trains on 4 gloo ranks posing as 2 nodes x 2, exactly as the
    megaq flags it maps to: the same losses, bit for bit. Changed from the tutorial: its
    hpZ group, 16 GPUs per node there, is the 2 of each posed node; added: the batch,
    clipping and optimizer keys a whole ds_config carries (the tutorial's launch line
    passes them as flags)."""
    cfg = json.load(open(TUTORIAL))
    cfg["zero_optimization"]["zero_hpz_partition_size"] = 2
    cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2,
               train_batch_size=8, gradient_clipping=1.0, steps_per_print=1,
               optimizer={"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95],
                                                      "eps": 1e-8, "weight_decay": 0.1}})
    losses, r = _train_losses(tmp_path, "file", ["--deepspeed", "--deepspeed_config",
                                                 write(tmp_path, cfg)])
    assert r["stdout"].count("------------------------ deepspeed config ") == 1  # rank 0
    assert "on 2 node(s) of 2; ZeRO stage 3 + qwZ + hpZ(2) + qgZ(int4)" in r["stdout"]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses), losses
    assert abs(losses[0] - math.log(64)) < 0.5  # an untrained model on the 64-id vocabulary
    flags = ["--zero-stage", "3", "--zero-reduce-bucket-size", "10000000",
             "--zero-quantized-weights", "--zero-hpz-partition-size", "2",
             "--zero-quantized-gradients", "--micro-batch-size", "1", "--global-batch-size", "8",
             "--clip-grad", "1.0", "--optimizer", "adam", "--lr", "3e-3", "--adam-beta1", "0.9",
             "--adam-beta2", "0.95", "--adam-eps", "1e-8", "--weight-decay", "0.1"]
    assert _train_losses(tmp_path, "flags", flags)[0] == losses


def test_unsupported_keys_are_one_error_line_naming_all(tmp_path, capfd):
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                 "offload_param": {"device": "nvme"}, "mics_shard_size": 8},
           "fp16": {"enabled": True}, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}},
           "scheduler": {"type": "OneCycle", "params": {}}, "gradient_clipping": "auto",
           "sparse_attention": {"mode": "fixed"}, "my_typo_key": 1}
    path = write(tmp_path, cfg)
    code = pretrain.cli(BASE + ["--lr", "1e-3", "--deepspeed-config", path])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    line = err[0]
    assert line.startswith(f"error: --deepspeed-config {path}: megaq cannot honour 9 key(s): ")
    for key in ("zero_optimization.offload_optimizer \"cpu\"", "zero_optimization.offload_param",
                "zero_optimization.mics_shard_size", "fp16.enabled", "optimizer.type \"Lamb\"",
                "scheduler.type \"OneCycle\"", "gradient_clipping \"auto\"", "sparse_attention",
                "my_typo_key"):
        assert key in line, key


def test_dry_run_prints_the_mapping_and_refusals(tmp_path, capfd):
    ok = write(tmp_path, {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                          "zero_optimization": {"stage": 3, "overlap_comm": True}})
    assert pretrain.cli(BASE + ["--lr", "1e-3", "--deepspeed_config", ok, "--dry-run"]) == 0
    out = capfd.readouterr().out
    assert "  bf16.enabled " in out and " --bf16" in out and "overlap_comm" in out
    bad = write(tmp_path, {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
                "bad.json")
    code = pretrain.cli(BASE + ["--lr", "1e-3", "--micro-batch-size", "1", "--deepspeed_config",
                                bad, "--dry-run", "--tensor-model-parallel-size", "3"])
    out, err = capfd.readouterr()
    err = err.strip().splitlines()
    assert code == 2 and err[0].startswith("error: --deepspeed-config ") and len(err) >= 2, err
    assert "  zero_optimization.stage ..................... --zero-stage 3" in out  # the block too


@pytest.mark.parametrize("content,message", [
    ('{"train_batch_size": 8,,}', "not valid JSON (Expecting property name enclosed in double "
                                  "quotes at line 1 column 24)"),
    ('{"train_batch_size": NaN}', "NaN is not a JSON number"),
    ('{"steps_per_print": 1, "steps_per_print": 2}', "key 'steps_per_print' is given twice"),
    ('[1, 2]', "the top level is a JSON list, not an object of DeepSpeed keys"),
    (b'\xff\xfe{}', "not UTF-8 text"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
])
def test_a_bad_file_is_one_error_line(tmp_path, content, message):
    path = tmp_path / "ds.json"
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    with pytest.raises(ArgumentsError) as e:
        parse_config(BASE + ["--lr", "1e-3", "--deepspeed-config", str(path)], world_size=1)
    assert str(e.value).startswith(f"--deepspeed-config {path}: ") and message in str(e.value)
    assert "\n" not in str(e.value)


def test_wrong_types_oversize_and_non_files_are_one_line(tmp_path, capfd):
    path = write(tmp_path, {"train_micro_batch_size_per_gpu": "two", "gradient_clipping": True,
                            "zero_optimization": {"stage": 3.5, "reduce_bucket_size": [1]},
                            "bf16": {"enabled": "yes"}})
    with pytest.raises(ArgumentsError, match=r"megaq cannot honour 5 key\(s\): "
                       r"train_micro_batch_size_per_gpu \"two\" \(must be a whole number\); "
                       r"gradient_clipping true \(must be a number\); zero_optimization.stage "
                       r"3.5 \(must be a whole number\)"):
        parse_config(BASE + ["--lr", "1e-3", "--micro-batch-size", "1", "--deepspeed-config",
                             path], world_size=1)
    big = write(tmp_path, " " * (MAX_CONFIG_BYTES + 1) + "{}", "big.json")
    with pytest.raises(ArgumentsError, match=rf"{MAX_CONFIG_BYTES + 3} bytes, more than a "
                                             rf"ds_config's {MAX_CONFIG_BYTES} limit"):
        parse_config(BASE + ["--lr", "1e-3", "--deepspeed-config", big], world_size=1)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # no writer: opening it must not block
    for target, message in ((tmp_path, "Is a directory"), (fifo, "not a regular file"),
                            (tmp_path / "missing.json", "No such file or directory")):
        code = pretrain.cli(BASE + ["--lr", "1e-3", "--deepspeed-config", str(target)])
        err = capfd.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], err


def test_batch_sizes_follow_deepspeeds_rule(tmp_path):
    def batch(cfg, world=2, extra=()):
        path = write(tmp_path, cfg)
        config, _, problems, _ = run_problems(BASE + ["--lr", "1e-3", "--deepspeed-config", path,
                                                      *extra], world_size=world)
        return problems or (config.training.micro_batch_size,
                            config.training.num_micro_batches, config.training.global_batch_size)

    assert batch({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                  "gradient_accumulation_steps": 2}) == (2, 2, 8)
    assert batch({"train_batch_size": 8, "gradient_accumulation_steps": 2}) == (2, 2, 8)
    assert batch({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}) == (2, 3, 12)
    assert batch({"train_batch_size": 8}) == (4, 1, 8)  # DeepSpeed: accumulation 1
    # the micro-batch from the command line counts as the file's would
    assert batch({"gradient_accumulation_steps": 2}, extra=["--micro-batch-size", "3"]) == (3, 2, 12)
    wrong = batch({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2,
                   "gradient_accumulation_steps": 2})
    assert wrong == ["--deepspeed-config: batch sizes disagree: train_batch_size 12 != "
                     "train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 2 x "
                     "data-parallel size 2 (DeepSpeed's rule); fix the file or the layout"]
    assert batch({"train_batch_size": 7, "gradient_accumulation_steps": 2})[0].startswith(
        "--deepspeed-config: the micro-batch size is not set")


def test_command_line_flags_must_agree_with_the_file(tmp_path):
    path = write(tmp_path, {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5,
                            "zero_optimization": {"stage": 3, "zero_quantized_gradients": True}})
    same = parse_config(BASE + ["--lr", "1e-3", "--deepspeed-config", path, "--zero-stage", "3",
                                "--micro-batch-size", "2", "--zero-quantized-gradients"],
                        world_size=1)
    assert (same.zero.stage, same.training.micro_batch_size, same.optimizer.clip_grad) == (3, 2, 0.5)
    with pytest.raises(ArgumentsError, match=r"and the command line disagree: "
                       r"train_micro_batch_size_per_gpu 2 vs --micro-batch-size 4; "
                       r"gradient_clipping 0.5 vs --clip-grad 1.0; drop the flag or change "
                       r"the file"):
        parse_config(BASE + ["--lr", "1e-3", "--deepspeed-config", path, "--micro-batch-size",
                             "4", "--clip-grad", "1.0"], world_size=1)


def test_optimizer_and_schedulers_map_where_the_curve_is_the_same(tmp_path):
    opt = {"type": "Adam", "params": {"lr": 2e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                                      "weight_decay": 0.05}}
    for sched, expect in (
            ({"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                                  "warmup_num_steps": 2, "total_num_steps": 3,
                                                  "warmup_type": "linear"}},
             ("linear", 3e-4, 0.0, 2, 3)),
            ({"type": "WarmupLR", "params": {"warmup_max_lr": 3e-4, "warmup_num_steps": 2,
                                             "warmup_type": "linear"}},
             ("constant", 3e-4, 0.0, 2, 3)),
            ({"type": "WarmupCosineLR", "params": {"total_num_steps": 3, "warmup_num_steps": 1,
                                                   "cos_min_ratio": 0.1, "warmup_type": "linear"}},
             ("cosine", 2e-4, 2e-5, 1, 3))):
        path = write(tmp_path, {"train_micro_batch_size_per_gpu": 1, "optimizer": opt,
                                "scheduler": sched})
        o = parse_config(BASE + ["--deepspeed-config", path], world_size=1).optimizer
        assert (o.optimizer, o.adam_beta1, o.adam_beta2, o.adam_eps, o.weight_decay) == (
            "adam", 0.8, 0.95, 1e-6, 0.05)
        got = (o.lr_decay_style, o.lr, o.min_lr, o.lr_warmup_iters, o.lr_decay_iters)
        assert got[0] == expect[0] and got[3:] == expect[3:]
        assert math.isclose(got[1], expect[1]) and math.isclose(got[2], expect[2], abs_tol=1e-12)
    # DeepSpeed's default log warm-up and a warm-up from a non-zero lr are not megaq's curve
    path = write(tmp_path, {"train_micro_batch_size_per_gpu": 1, "optimizer": opt,
                            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5}}})
    with pytest.raises(ArgumentsError, match=r"2 key\(s\): scheduler.params.warmup_type \"log "
                       r"\(the default\)\" .*; scheduler.params.warmup_min_lr 1e-05"):
        parse_config(BASE + ["--deepspeed-config", path], world_size=1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_maps_to_zero_stage(stage, tmp_path):
    """Stages 0-3 map to --zero-stage 0-3; the ZeRO++ keys only at stage 3, as DeepSpeed
    applies them (below it they are noted: the file's run has them off)."""
    zero = {"stage": stage, "zero_quantized_gradients": True, "zero_quantized_weights": True}
    mapping = map_config({"zero_optimization": zero})
    zeropp = ["--zero-quantized-gradients", "--zero-quantized-weights"] if stage == 3 else []
    assert mapping.tokens() == ["--zero-stage", str(stage), *zeropp]
    assert len(mapping.noted) == (0 if stage == 3 else 2)
    path = write(tmp_path, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero})
    z = parse_config(BASE + ["--lr", "1e-3", "--deepspeed-config", path], world_size=2).zero
    assert (z.stage, z.quantized_gradients, z.quantized_weights) == (stage,) + (stage == 3,) * 2


def test_megatron_deepspeed_flags(tmp_path):
    """Megatron-DeepSpeed's spellings: --checkpoint-activations is full recompute of every
    layer (--checkpoint-num-layers per group), --zero-reduce-bucket-size megaq's own;
    offloading and TP-partitioned activations are refused, all in one launch."""
    argv = BASE + ["--lr", "1e-3", "--micro-batch-size", "1"]
    c = parse_config(argv + ["--checkpoint-activations", "--checkpoint-num-layers", "2",
                             "--zero-contigious-gradients", "--zero-reduce-scatter",
                             "--zero-reduce-bucket-size", "1000", "--deepspeed",
                             "--partition-activations", "--local_rank=0"], world_size=1)
    assert (c.model.recompute_granularity, c.model.recompute_method,
            c.model.recompute_num_layers) == ("full", "uniform", 2)
    assert c.zero.reduce_bucket_size == 4000
    assert parse_config(argv + ["--checkpoint-activations"],
                        world_size=1).model.recompute_num_layers == 1
    assert parse_config(argv + ["--checkpoint-num-layers", "1"],  # alone: nothing
                        world_size=1).model.recompute_granularity is None
    _, _, problems, _ = run_problems(argv + ["--cpu-optimizer", "--partition-activations",
                                             "--tensor-model-parallel-size", "2"], world_size=2)
    assert [p.split(":")[0] for p in problems] == ["--partition-activations", "--cpu-optimizer"]


def test_training_doc_lists_the_keys():
    from megaq.config.deepspeed_config import keys_table_markdown
    text = open(os.path.join(HERE, "..", "docs", "TRAINING.md")).read()
    assert keys_table_markdown() in text


def test_the_schedulers_peak_lr_wins_and_a_min_lr_flag_must_agree(tmp_path):
    """DeepSpeed's scheduler sets the lr: WarmupDecayLR's warmup_max_lr is the peak whatever
    the optimizer's lr (noted); WarmupCosineLR's floor is cos_min_ratio x lr, and a --min-lr
    on the command line that differs is refused, not overwritten."""
    sched = {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 5e-4, "warmup_num_steps": 1,
                                                 "total_num_steps": 3, "warmup_type": "linear"}}
    for order in ((("scheduler", sched), ("optimizer", {"type": "AdamW", "params": {"lr": 1e-3}})),
                  (("optimizer", {"type": "AdamW", "params": {"lr": 1e-3}}), ("scheduler", sched))):
        path = write(tmp_path, {"train_micro_batch_size_per_gpu": 1, **dict(order)})
        assert parse_config(BASE + ["--deepspeed-config", path], world_size=1).optimizer.lr == 5e-4
    cosine = write(tmp_path, {"train_micro_batch_size_per_gpu": 1,
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                              "scheduler": {"type": "WarmupCosineLR", "params": {
                                  "total_num_steps": 3, "warmup_num_steps": 1,
                                  "warmup_type": "linear", "cos_min_ratio": 0.5}}})
    argv = BASE + ["--deepspeed-config", cosine]
    assert parse_config(argv + ["--min-lr", "5e-4"], world_size=1).optimizer.min_lr == 5e-4
    with pytest.raises(ArgumentsError, match=r"cos_min_ratio 0.5 means --min-lr 0.0005, and the "
                                             r"command line gives --min-lr 0.0001"):
        parse_config(argv + ["--min-lr", "1e-4"], world_size=1)


def test_an_abbreviated_file_flag_is_read_or_refused(tmp_path):
    path = write(tmp_path, {"train_micro_batch_size_per_gpu": 3})
    assert parse_config(BASE + ["--lr", "1e-3", "--deepspeed-conf", path],
                        world_size=1).training.micro_batch_size == 3
    with pytest.raises(ArgumentsError, match="spell the flag out in full"):
        parse_config(BASE + ["--lr", "1e-3", "--micro-batch-size", "1", "--deepspeed_", path],
                     world_size=1)


def test_megatron_deepspeeds_template_config_maps_without_refusal(tmp_path):
    """The shape of Megatron-DeepSpeed's GPT ds_config template, filled in for bf16: every
    key is mapped or noted (the disabled fp16 and curriculum sections included)."""
    cfg = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10,
           "zero_optimization": {"stage": 3}, "gradient_clipping": 1.0,
           "prescale_gradients": False,
           "fp16": {"enabled": False, "loss_scale": 0, "loss_scale_window": 500,
                    "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 11},
           "bf16": {"enabled": True},
           "curriculum_learning": {"enabled": False, "curriculum_type": "seqlen"},
           "wall_clock_breakdown": False}
    path = write(tmp_path, cfg)
    base = BASE[:BASE.index("--log-interval")]  # the file's steps_per_print sets it
    config, flags, problems, _ = run_problems(base + ["--lr", "1e-3", "--deepspeed",
                                                      "--deepspeed_config", path], world_size=4)
    assert problems == []
    t = config.training
    assert (t.global_batch_size, t.micro_batch_size, t.num_micro_batches, t.bf16) == (16, 2, 2, True)
    assert (config.logging.log_interval, config.optimizer.clip_grad, config.zero.stage) == (10, 1.0, 3)
    assert [n.split(" (")[0] for n in flags.deepspeed.mapping.noted] == [
        "prescale_gradients", "curriculum_learning", "wall_clock_breakdown"]


def test_the_engine_knobs_are_flags():
    """The ZeRO engine's knobs are --zero-* flags (DeepSpeed's units), defaults unchanged;
    a bad value is one line naming the flag."""
    argv = BASE + ["--lr", "1e-3", "--micro-batch-size", "1"]
    z = parse_config(argv + ["--zero-prefetch", "0", "--zero-param-persistence-threshold", "100",
                             "--zero-grad-sync", "last_microbatch", "--zero-quantized-weights",
                             "--zero-quantized-weights-bits", "4", "--zero-reduce-bucket-size",
                             "1000", "--bf16"], world_size=2).zero
    assert (z.prefetch, z.param_persistence_threshold, z.grad_sync, z.weight_bits,
            z.reduce_bucket_size) == (0, 100, "last_microbatch", 4, 2000)
    for extra, message in ((["--zero-prefetch", "-1"], r"--zero-prefetch\) must be >= 0"),
                           (["--zero-reduce-bucket-size", "0"], r"--zero-reduce-bucket-size, in "
                                                               r"elements\) must be >= 1"),
                           (["--zero-param-persistence-threshold", "-5"], r"must be >= 0 "
                                                                          r"elements"),
                           (["--zero-quantized-weights-bits", "4"], r"add --zero-quantized-"
                                                                    r"weights \(its int8 mode\)")):
        with pytest.raises(ArgumentsError, match=message):
            parse_config(argv + extra, world_size=2)


def test_the_planner_reads_the_file_too(tmp_path, capsys):
    """tools/plan.py plans the file's run: the batch split by DeepSpeed's rule at the
    planned DP size, qgZ on; a refused key is its one error line."""
    from megaq.plan_cli import plan_main
    path = write(tmp_path, {"train_batch_size": 64, "gradient_accumulation_steps": 2,
                            "bf16": {"enabled": True},
                            "zero_optimization": {"stage": 3, "zero_quantized_gradients": True}})
    model = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
             "--seq-length", "256", "--lr", "1e-4", "--num-nodes", "2", "--gpus-per-node", "8"]
    assert plan_main(model + ["--deepspeed-config", path]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 2 x 2 per step, global batch 64" in out and "stage 3 + qgZ" in out
    bad = write(tmp_path, {"train_batch_size": 64, "fp16": {"enabled": True}}, "bad.json")
    assert plan_main(model + ["--deepspeed-config", bad]) == 2
    assert "megaq cannot honour 1 key(s): fp16.enabled true" in capsys.readouterr().err
