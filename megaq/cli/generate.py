"""Sample text from a pretrain_gpt.py checkpoint, on one process (TP = PP = 1).

    python tools/generate.py --load CKPT_DIR --prompt "def main(" --max-new-tokens 80

Any TP x PP x DP layout loads (megaq.checkpoint.consolidate.load_consolidated_model): the
checkpoint holds full (DP-consolidated) weights per TP x PP rank; pipeline stages are
stitched back by global layer index and TP shards concatenated along each parameter's
partition dimension (checked by re-slicing: if any shard does not round-trip, the tool
refuses rather than sample from a scrambled model). A model trained with FP8 GEMMs
samples with them (megaq.parallelize.apply_fp8), so its logits are the ones training
computed; its blocks are not compiled (each new context length would compile again).

The tokenizer is the run's, of any type: SentencePiece (SentencePieceTokenizer,
GPTSentencePieceTokenizer, Llama2Tokenizer), GPT2BPETokenizer, HuggingFaceTokenizer, or
the NullTokenizer (then --prompt is token ids separated by spaces, and so is the output).
"""

from __future__ import annotations

import math
import os
import sys

import torch

from megaq.checkpoint.errors import CheckpointError
from megaq.checkpoint.integrity import Verifier
from megaq.checkpoint.paths import TRACKER_FILE, iteration_dir, read_tracker
from megaq.config.flags import add_flag
from megaq.config.run import CheckpointConfig


EPILOG = """tokenizer: each file comes from the first of: the flags above; the copy of the
run's tokenizer files that every checkpoint holds (iter_*/tokenizer/); the path the run
recorded (checkpoints saved before the copy existed). The type is the run's unless
--tokenizer-type is given (--vocab-file with --merge-file imply GPT2BPETokenizer, a
--tokenizer-model directory HuggingFaceTokenizer). A run on --mock-data has no
tokenizer: pass one, or --tokenizer-type NullTokenizer to give and get token ids."""


class GenerateError(RuntimeError):
    """A checkpoint or tokenizer problem; the message names it and the fix."""


@torch.no_grad()
def sample(model, ids: list[int], n: int, vocab_size: int, seq_length: int, temperature: float,
           top_k: int, generator: torch.Generator) -> list[int]:
    model.eval()
    out = list(ids)
    for _ in range(n):
        ctx = torch.tensor([out[-seq_length:]], dtype=torch.long)
        logits = model(input_ids=ctx)[0, -1, :vocab_size].float()
        if temperature <= 0:
            out.append(int(logits.argmax()))
            continue
        logits = logits / temperature
        if top_k > 0:
            kth = torch.topk(logits, min(top_k, vocab_size)).values[-1]
            logits[logits < kth] = -float("inf")
        out.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)))
    return out


def main(argv=None) -> int:
    from megaq.data.errors import ArgumentParser, DataError
    # one `error: ... (see --help)` line for a bad flag (a DataError), as pretrain_gpt.py prints
    from megaq.data.config import TOKENIZER_TYPES
    p = ArgumentParser(description=__doc__.splitlines()[0], epilog=EPILOG)
    p.add_argument("--load", required=True,
                   help="checkpoint root (uses latest_checkpointed_iteration.txt) or an iter_* dir")
    p.add_argument("--prompt", default="def ",
                   help="text to continue (NullTokenizer: token ids separated by spaces)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="at least 0")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy; at least 0")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES,
                   help="default: the run's")
    p.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece .model file or Hugging Face tokenizer directory; default: "
                        "the checkpoint's copy of the run's")
    p.add_argument("--vocab-file", default=None,
                   help="GPT2BPETokenizer's vocab.json; default: the checkpoint's copy")
    p.add_argument("--merge-file", default=None,
                   help="GPT2BPETokenizer's merges.txt; default: the checkpoint's copy")
    add_flag(p, CheckpointConfig, "no_verify_checkpoint")
    try:
        a = p.parse_args(argv)
        # checked before the checkpoint loads: a negative count or temperature would
        # otherwise sample nothing, or sample from a flipped distribution, silently
        if a.max_new_tokens < 0:
            p.error(f"--max-new-tokens must be at least 0, got {a.max_new_tokens}")
        if not (math.isfinite(a.temperature) and a.temperature >= 0):
            p.error(f"--temperature must be a number >= 0 (0 = greedy), got {a.temperature}")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    verify = not a.no_verify_checkpoint
    # the checkpoint formats import torch.distributed.checkpoint (about 0.8 s): only once
    # there is a checkpoint to read, so --help and a flag's refusal come back at once
    from megaq.checkpoint.consolidate import load_consolidated_model
    from megaq.checkpoint.formats import checkpoint_layout
    from megaq.parallelize import apply_fp8
    try:
        ckpt_dir = a.load
        if not os.path.basename(os.path.normpath(ckpt_dir)).startswith("iter_"):
            it = read_tracker(ckpt_dir)
            if it is None:
                raise GenerateError(f"{ckpt_dir} holds no {TRACKER_FILE}; pass a checkpoint "
                                    f"directory written by pretrain_gpt.py --save")
            ckpt_dir = iteration_dir(ckpt_dir, it)
        tp, _ = checkpoint_layout(ckpt_dir, Verifier(ckpt_dir, enabled=verify))
        model, saved = load_consolidated_model(ckpt_dir, verify=verify)
        if model.config.fp8 is not None:
            apply_fp8(model.layers, model.config.fp8)
        from megaq.interop.checkpoint_tokenizer import run_tokenizer
        # the run's own tokenizer type (its eod/vocab rules differ between types), its
        # files from the flags, the checkpoint's copy, or the paths the run recorded
        spec = run_tokenizer(ckpt_dir, saved["data"], model.config.vocab_size,
                             tokenizer_type=a.tokenizer_type, tokenizer_model=a.tokenizer_model,
                             vocab_file=a.vocab_file, merge_file=a.merge_file, verify=verify)
        tok = spec.build()
        # ids past the model's embedding rows would index out of it: a different tokenizer
        if tok.vocab_size > model.config.vocab_size:
            raise GenerateError(f"tokenizer {spec.describe()} has {tok.vocab_size} ids, the model "
                                f"{model.config.vocab_size}; pass the tokenizer the checkpoint "
                                f"was trained with")
        ids = tok.tokenize(a.prompt)
        # each new token is predicted from the ones before it: there must be one to start
        if not ids:
            raise GenerateError(f"--prompt {a.prompt!r} gives no tokens; generation needs at "
                                f"least one token to start from: pass a non-empty --prompt")
    except (GenerateError, CheckpointError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(a.seed)
    out = sample(model, ids, a.max_new_tokens, model.config.vocab_size, model.config.seq_length,
                 a.temperature, a.top_k, g)
    print(f"[generate] {ckpt_dir} (trained with TP={tp}; consolidated to one process); "
          f"tokenizer {spec.describe()}")
    print(tok.detokenize(out))
    return 0


def cli() -> int:
    """The `megaq-generate` command and tools/generate.py."""
    return main()
