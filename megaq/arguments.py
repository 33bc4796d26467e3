"""Megatron-LM compatible command-line flags -> one validated namespace.

Flag names follow Megatron-LM's pretrain_gpt.py (users bring their scripts), plus
megaq's own: ZeRO / ZeRO++ switches (DeepSpeed's names), --gpus-per-node (the node
map, so one machine can pose as several nodes), --metrics-file, --demo-corpus.

Every refusal is an :class:`ArgumentsError` whose message is one line naming the flag
and the fix; the command-line entry prints it as ``error: ...`` and exits with 2.
Validation that needs the world size (batch divisibility, layouts) takes it as an
argument, so the same function serves torchrun, slurm and in-process test ranks.
"""

from __future__ import annotations

import argparse
import os

from megaq.parallel.topology import Layout, LayoutError, check_model_fits_tp


class ArgumentsError(ValueError):
    """A bad flag or flag combination; the message says which flag and the fix."""


class _Parser(argparse.ArgumentParser):
    # argparse prints usage + error and exits; we want one line and, in-process, an
    # exception the caller (or a test) can catch.
    def error(self, message):
        raise ArgumentsError(f"{message} (see --help)")


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default when it has a meaningful one (not None / False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.default is not None
                and action.default is not False and action.default is not argparse.SUPPRESS
                and "default" not in text):
            text += " (default: %(default)s)"
        return text


ARCHITECTURE_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
    "group_query_attention", "num_query_groups", "kv_channels", "max_position_embeddings",
    "position_embedding_type", "rotary_base", "normalization", "norm_epsilon", "swiglu",
    "untie_embeddings_and_output_weights", "disable_bias_linear", "vocab_size",
    "padded_vocab_size",
)
"""Args that define parameter shapes or meaning; a checkpoint refuses to load if any differ."""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pretrain_gpt.py", formatter_class=_HelpFormatter,
                description="Pretrain a GPT / Llama-style model with TP, PP and ZeRO-3 / ZeRO++ "
                            "data parallelism (Megatron-LM compatible flags).")

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True, help="transformer layers")
    g.add_argument("--hidden-size", type=int, required=True, help="model width")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP width (default 4 x hidden, or Megatron's 2/3 of that rounded to 64 "
                        "with --swiglu)")
    g.add_argument("--num-attention-heads", type=int, required=True,
                   help="attention (query) heads")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention (needs --num-query-groups)")
    g.add_argument("--num-query-groups", type=int, default=None, help="KV heads for GQA")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="head dim (default hidden / heads)")
    g.add_argument("--seq-length", type=int, required=True, help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="positions of the learned embedding table (default --seq-length)")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"],
                   default="learned_absolute",
                   help="learned absolute positions (GPT-2) or rotary (Llama)")
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm",
                   help="norm layer type")
    g.add_argument("--norm-epsilon", type=float, default=1e-5,
                   help="epsilon of the norm layers")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (Llama style)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output layer instead of reusing the word embedding")
    g.add_argument("--disable-bias-linear", action="store_true",
                   help="no biases in linear layers (Llama style)")
    g.add_argument("--attention-dropout", type=float, default=0.1,
                   help="dropout on attention probabilities")
    g.add_argument("--hidden-dropout", type=float, default=0.1,
                   help="dropout on the residual branches")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="std of the normal weight initialisation")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocab to a multiple of this x TP")
    g.add_argument("--recompute-activations", action="store_true",
                   help="recompute each layer's activations in backward (not counted in TFLOP/s)")
    g.add_argument("--compile-blocks", action="store_true",
                   help="torch.compile each transformer block's forward (the ZeRO hooks stay "
                        "eager); pays off on GPU, costs compile time on CPU")
    g.add_argument("--attention-repeat-kv", action="store_true",
                   help="GQA by repeating k/v heads instead of SDPA's enable_gqa")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="TP: ranks splitting each layer")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="PP: pipeline stages")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved 1F1B: layers per model chunk")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split LayerNorm/dropout activations over TP (ignored when TP = 1)")
    g.add_argument("--gpus-per-node", type=int, default=None,
                   help="ranks per node for the node map (default: from torchrun/slurm); a "
                        "smaller value makes one machine pose as several nodes")
    g.add_argument("--use-tp-pp-dp-mapping", action="store_true",
                   help="rank order TP fastest, then PP, then DP (Megatron's flag); the "
                        "default order puts DP before PP, which keeps a pipeline stage's DP "
                        "groups on as few nodes as possible")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with CUDA, else gloo")

    g = p.add_argument_group("ZeRO / ZeRO++ (data parallelism)")
    g.add_argument("--zero-stage", type=int, choices=[0, 3], default=3,
                   help="3: ZeRO-3 sharded params/grads/optimizer; 0: replicated, all-reduce")
    g.add_argument("--zero-quantized-weights", action="store_true",
                   help="qwZ: int8 blockwise forward weight all-gather")
    g.add_argument("--zero-hpz-partition-size", type=int, default=1,
                   help="hpZ: secondary weight shard over this many in-node DP ranks (1 = off)")
    g.add_argument("--zero-quantized-gradients", action="store_true",
                   help="qgZ: quantized two-hop all-to-all gradient reduce-scatter")
    g.add_argument("--zero-quantized-gradients-bits", type=int, choices=[4, 8], default=4,
                   help="qgZ bits per value of the cross-node hop (and of the in-node hop "
                        "unless --zero-quantized-gradients-intra-bits is given)")
    g.add_argument("--zero-quantized-gradients-intra-bits", type=int, choices=[4, 8], default=None,
                   help="qgZ bits of the in-node hop only (in-node bytes, never cross-node; "
                        "docs/ZEROPP.md 'Fidelity' has the trade-off); default: "
                        "--zero-quantized-gradients-bits")
    g.add_argument("--zero-quantization-block-size", type=int, default=None,
                   help="elements per quantization block (default: the engine's)")
    g.add_argument("--zero-quantized-gradients-quantize-own-rows", action="store_true",
                   help="qgZ: also quantize the all-to-all row each rank keeps for itself "
                        "(DeepSpeed's way; the default keeps it exact, which costs no bytes)")
    g.add_argument("--zero-gradient-error-feedback", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="qgZ: carry the quantization residual into the next step (default: on "
                        "with --zero-quantized-gradients; costs fp32 residual memory, see "
                        "docs/ZEROPP.md 'Fidelity')")
    g.add_argument("--zero-quantized-gradients-chunk", type=int, default=None,
                   help="qgZ: elements of each rank's gradient shard per chunk; the two "
                        "all-to-all hops of consecutive chunks overlap (default 4194304; "
                        "larger chunks mean fewer, bigger collectives)")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True,
                   help="samples per micro-batch per DP rank")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per step (default micro-batch x DP); must be a multiple of "
                        "micro-batch x DP (the quotient is the gradient accumulation count)")
    g.add_argument("--train-iters", type=int, required=True,
                   help="optimizer steps to train for (in total, across resumes)")
    g.add_argument("--seed", type=int, default=1234,
                   help="seed of weights, dropout and data order")
    g.add_argument("--bf16", action="store_true", help="bf16 weights/activations (fp32 master)")
    g.add_argument("--fp16", action="store_true", help="not supported (no loss scaling): use --bf16")
    g.add_argument("--max-consecutive-skipped-iters", type=int, default=10,
                   help="stop when this many iterations in a row had a non-finite loss or grad")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="save (with --save) and exit when the iteration is a multiple of this")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save and exit after this many minutes of training (job time limits)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM / SIGUSR1 (any rank): finish the iteration, save, exit")

    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--lr", type=float, required=True, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0,
                   help="learning rate at the end of the decay")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear",
                   help="decay after warm-up")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0,
                   help="linear warm-up steps from 0 to --lr")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)")
    g.add_argument("--weight-decay", type=float, default=0.01,
                   help="AdamW weight decay (not on biases and norms)")
    g.add_argument("--adam-beta1", type=float, default=0.9,
                   help="AdamW beta1")
    g.add_argument("--adam-beta2", type=float, default=0.999,
                   help="AdamW beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8,
                   help="AdamW epsilon")
    g.add_argument("--clip-grad", type=float, default=1.0, help="global grad-norm clip (0 = off)")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="prefix, or weight prefix weight prefix ... (blending)")
    g.add_argument("--split", default="969,30,1", help="train,valid,test proportions")
    g.add_argument("--data-cache-path", default=None, help="where dataset index caches go")
    g.add_argument("--mock-data", action="store_true", help="synthetic tokens, no files")
    g.add_argument("--demo-corpus", nargs="?", const="", default=None, metavar="DIR",
                   help="use the built-in corpus (Python stdlib text) and its tokenizer, "
                        "building them in DIR (default $MEGAQ_DATA_CACHE or <repo>/data_cache) "
                        "if missing")
    g.add_argument("--tokenizer-type", default="SentencePieceTokenizer",
                   choices=["SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                            "NullTokenizer"],
                   help="tokenizer of --data-path (NullTokenizer: ids as they are, needs --vocab-size)")
    g.add_argument("--tokenizer-model", default=None, help="SentencePiece .model file")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="vocab of the NullTokenizer / --mock-data (default 1024)")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="checkpoint directory to write")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between saves")
    g.add_argument("--load", default=None,
                   help="checkpoint directory to resume from (starts fresh if it holds none)")
    g.add_argument("--no-load-rng", action="store_true", help="do not restore RNG streams")
    g.add_argument("--no-load-optim", action="store_true",
                   help="load weights only (fresh AdamW moments)")

    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100,
                   help="iterations per log line / metrics line")
    g.add_argument("--eval-interval", type=int, default=1000,
                   help="iterations between evaluations on the validation split")
    g.add_argument("--eval-iters", type=int, default=100,
                   help="validation batches per evaluation (0 = no evaluation)")
    g.add_argument("--tensorboard-dir", default=None,
                   help="write TensorBoard scalars here (needs tensorboard installed)")
    g.add_argument("--metrics-file", default=None,
                   help="append one JSON object per logged iteration (and per evaluation)")
    g.add_argument("--log-comm-time", action="store_true",
                   help="time every collective and log milliseconds per phase (weight_gather_fwd, "
                        "grad_reduce, ...) per iteration; collectives then run synchronously with a "
                        "device sync around each, so steps are slower (no overlap): use it to see "
                        "where communication time goes, not to measure step time")
    return p


def _fail(msg: str):
    raise ArgumentsError(msg)


def default_world_size() -> int:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_order(args) -> str:
    """The topology's rank order named by --use-tp-pp-dp-mapping."""
    return "tp-pp-dp" if args.use_tp_pp_dp_mapping else "tp-dp-pp"


def parse_args(argv: list[str] | None = None, world_size: int | None = None,
               ranks_per_node: int | None = None) -> argparse.Namespace:
    """Parse and validate. `world_size` defaults to torch.distributed's / $WORLD_SIZE."""
    args = build_parser().parse_args(argv)
    world_size = world_size or default_world_size()
    validate_args(args, world_size, ranks_per_node)
    return args


def validate_args(args: argparse.Namespace, world_size: int,
                  ranks_per_node: int | None = None) -> argparse.Namespace:
    """Fill derived values (dp, global batch, ...) and refuse impossible combinations."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.fp16 and args.bf16:
        _fail("--fp16 and --bf16 are both set; pass only one (--bf16 is the supported one)")
    if args.fp16:
        _fail("--fp16 is not supported (megaq has no loss scaling); use --bf16 or fp32 (neither)")
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size"):
        if getattr(args, flag) < 1:
            _fail(f"--{flag.replace('_', '-')} must be >= 1 (got {getattr(args, flag)})")
    if args.train_iters < 0:
        _fail(f"--train-iters must be >= 0 (got {args.train_iters})")

    # ---- layout --------------------------------------------------------------------
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        _fail(f"--gpus-per-node must be >= 1 (got {args.gpus_per_node})")
    rpn = args.gpus_per_node or ranks_per_node
    try:
        layout = Layout(world_size=world_size, tp=tp, pp=pp, ranks_per_node=rpn,
                        hpz_size=args.zero_hpz_partition_size, order=rank_order(args))
        check_model_fits_tp(tp, args.num_attention_heads,
                            args.num_query_groups if args.group_query_attention else None)
    except LayoutError as e:
        _fail(str(e))
    args.world_size = world_size
    args.data_parallel_size = layout.dp
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # as Megatron: nothing to split over

    # ---- model shape ---------------------------------------------------------------
    if args.hidden_size % args.num_attention_heads and args.kv_channels is None:
        _fail(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
              f"{args.num_attention_heads}; change one or set --kv-channels")
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.group_query_attention:
        if not args.num_query_groups:
            _fail("--group-query-attention needs --num-query-groups N (N dividing the heads)")
        if args.num_attention_heads % args.num_query_groups:
            _fail(f"--num-query-groups {args.num_query_groups} does not divide "
                  f"--num-attention-heads {args.num_attention_heads}; use a divisor")
    else:
        args.num_query_groups = args.num_attention_heads
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
        if args.swiglu:  # Megatron's default keeps the parameter count of a 4h GeLU MLP
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64 or 64
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if (args.position_embedding_type == "learned_absolute"
            and args.seq_length > args.max_position_embeddings):
        _fail(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
              f"{args.max_position_embeddings}; raise the latter or use --position-embedding-type rope")
    if args.num_layers % pp:
        _fail(f"--num-layers {args.num_layers} is not divisible by "
              f"--pipeline-model-parallel-size {pp}; use a PP size dividing the layers")
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers // pp
        v = args.num_layers_per_virtual_pipeline_stage
        if pp < 2:
            _fail("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        if v < 1 or per_stage % v:
            _fail(f"--num-layers-per-virtual-pipeline-stage {v} must divide the {per_stage} "
                  f"layers per pipeline stage")
        args.virtual_pipeline_model_parallel_size = per_stage // v

    # ---- batch ---------------------------------------------------------------------
    mb_dp = args.micro_batch_size * layout.dp
    if args.global_batch_size is None:
        args.global_batch_size = mb_dp
    if args.global_batch_size < 1 or args.global_batch_size % mb_dp:
        _fail(f"--global-batch-size {args.global_batch_size} is not a multiple of "
              f"--micro-batch-size x data-parallel size = {args.micro_batch_size} x {layout.dp} "
              f"= {mb_dp}; use e.g. --global-batch-size {max(mb_dp, args.global_batch_size // mb_dp * mb_dp)}")
    args.num_micro_batches = args.global_batch_size // mb_dp
    if (args.virtual_pipeline_model_parallel_size and args.num_micro_batches % pp):
        _fail(f"interleaved pipelining needs the micro-batches per step ({args.num_micro_batches}) "
              f"to be a multiple of --pipeline-model-parallel-size {pp}; raise --global-batch-size")

    # ---- ZeRO / ZeRO++ -------------------------------------------------------------
    zpp = (args.zero_quantized_weights or args.zero_quantized_gradients
           or args.zero_hpz_partition_size > 1)
    if zpp and args.zero_stage != 3:
        _fail("ZeRO++ switches (--zero-quantized-weights, --zero-hpz-partition-size > 1, "
              "--zero-quantized-gradients) need --zero-stage 3")
    if args.zero_gradient_error_feedback is None:  # default: on whenever qgZ is
        args.zero_gradient_error_feedback = bool(args.zero_quantized_gradients)
    elif args.zero_gradient_error_feedback and not args.zero_quantized_gradients:
        _fail("--zero-gradient-error-feedback needs --zero-quantized-gradients")
    chunk = args.zero_quantized_gradients_chunk
    if chunk is not None and chunk < 1:
        _fail(f"--zero-quantized-gradients-chunk {chunk} must be >= 1 element (e.g. 4194304)")

    # ---- optimizer / schedule ------------------------------------------------------
    if args.lr < 0 or args.min_lr < 0:
        _fail("--lr and --min-lr must be >= 0")
    if args.min_lr > args.lr:
        _fail(f"--min-lr {args.min_lr} is above --lr {args.lr}; use a --min-lr <= --lr")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters:
            _fail("--lr-warmup-iters and --lr-warmup-fraction are both set; pass only one")
        if not 0 <= args.lr_warmup_fraction <= 1:
            _fail("--lr-warmup-fraction must be in [0, 1]")
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.lr_warmup_iters < 0:
        _fail("--lr-warmup-iters must be >= 0")
    if args.lr_decay_style != "constant" and args.lr_warmup_iters > args.lr_decay_iters:
        _fail(f"--lr-warmup-iters {args.lr_warmup_iters} exceeds --lr-decay-iters "
              f"{args.lr_decay_iters}; shorten the warm-up or lengthen the decay")
    if args.clip_grad < 0:
        _fail("--clip-grad must be >= 0 (0 turns clipping off)")

    # ---- data ----------------------------------------------------------------------
    sources = sum(bool(x) for x in (args.data_path, args.mock_data, args.demo_corpus is not None))
    if sources == 0:
        _fail("no training data: pass --data-path PREFIX (with --tokenizer-model), "
              "--demo-corpus, or --mock-data")
    if sources > 1:
        _fail("pass only one of --data-path, --demo-corpus and --mock-data")
    if (args.data_path and args.tokenizer_type != "NullTokenizer"
            and not args.tokenizer_model):
        _fail(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model PATH "
              f"(the SentencePiece .model used to preprocess --data-path)")
    if args.data_path and args.tokenizer_type == "NullTokenizer" and not args.vocab_size:
        _fail("--tokenizer-type NullTokenizer needs --vocab-size N (the ids in --data-path "
              "are below N)")
    if args.data_path and len(args.data_path) > 1 and len(args.data_path) % 2:
        _fail("--data-path with several datasets takes pairs: weight prefix weight prefix ...")
    try:
        split = [float(x) for x in args.split.replace("/", ",").split(",")]
    except ValueError:
        _fail(f"--split {args.split!r} does not parse; write e.g. --split 949,50,1")
    if any(x < 0 for x in split) or sum(split) <= 0:
        _fail(f"--split {args.split!r} must be non-negative and sum to > 0, e.g. 949,50,1")

    # ---- checkpoints / logging -----------------------------------------------------
    if args.save_interval is not None and args.save_interval < 1:
        _fail("--save-interval must be >= 1")
    if args.save_interval and not args.save:
        _fail("--save-interval needs --save DIR (where to write checkpoints)")
    if args.log_interval < 1:
        _fail("--log-interval must be >= 1")
    if args.eval_interval < 1:
        _fail("--eval-interval must be >= 1 (use --eval-iters 0 to turn evaluation off)")
    if args.eval_iters < 0:
        _fail("--eval-iters must be >= 0")
    if args.exit_interval is not None and args.exit_interval < 1:
        _fail("--exit-interval must be >= 1")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        _fail("--exit-duration-in-mins must be > 0")
    if args.max_consecutive_skipped_iters < 1:
        _fail("--max-consecutive-skipped-iters must be >= 1")
    args.params_dtype = "bf16" if args.bf16 else "fp32"
    return args


def args_to_dict(args: argparse.Namespace) -> dict:
    """Plain (checkpoint-safe: loadable with weights_only=True) copy of the args."""
    out = {}
    for k, v in vars(args).items():
        if v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str)) for x in v):
            out[k] = list(v)
    return out
