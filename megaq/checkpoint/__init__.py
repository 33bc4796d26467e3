"""Checkpoints in Megatron's layout: atomic saves, exact resume, resharding to any layout,
every file verified and read by one allow-listed unpickler.

Directory (under --save DIR; megaq.checkpoint.paths names every file)::

    latest_checkpointed_iteration.txt   the iteration of the newest complete save
    iter_0000100/
      mp_rank_{tp:02d}_{pp:03d}/model_optim.pt      --ckpt-format torch (torch_format)
      .metadata, __{rank}_0.distcp, common.pt       --ckpt-format torch_dist (dcp_format)
      rng/rank_{rank:05d}.pt    every rank's RNG streams: python, numpy, torch CPU, CUDA,
                                the TP RNG tracker (rng)
      qgz/rank_{rank:05d}.pt    with --zero-gradient-error-feedback: the rank's qgZ
                                residuals (restored when layout and qgZ settings match,
                                else they restart from zero)
      tokenizer/                a copy of the run's tokenizer files (megaq.data.tokenizer_files),
                                for exports and tools/generate.py
      MANIFEST.sha256.json      SHA-256 of every file above, written last (integrity);
                                loads verify every file they read and refuse a
                                directory without it

Every file holds only tensors and plain containers (DCP's index: its own metadata
classes) and is read through safe_unpickle (nothing else is unpickled).

The modules, lowest first (tests/test_import_layers.py checks there is no circle):

    errors.py         CheckpointError, NonFiniteWeights
    safe_unpickle.py  the one allow-listed unpickler (also Megatron's and transformers' files)
    paths.py          file names, the tracker, fsynced and link-refusing writes
    integrity.py      the SHA-256 manifest; Verifier: a directory's files checked before use
    guard.py          the job lock on --save, stale .tmp removal, agreed write errors
    atomic.py         AtomicSave: the temporary directory, its phases and commit
    rng.py            a process's RNG streams
    record.py         the run's record in a checkpoint; checks against this run's flags
    reshard.py        global names, TP shards, Place (a rank's TP x PP coordinates)
    staging.py        --async-save: the host copy and the background save in flight
    torch_format.py   --ckpt-format torch: full (DP-gathered) state per TP x PP rank
    dcp_chunks.py     torch_dist: a rank's ZeRO shard as pieces of global tensors
    dcp_format.py     --ckpt-format torch_dist through torch.distributed.checkpoint
    formats.py        the one place a format is chosen (by flag to save, by directory to load)
    save.py           save_checkpoint
    load.py           load_checkpoint
    consolidate.py    load_consolidated_model: any checkpoint as one process's whole model

The engine's state leaves and enters through its own interface: full_state() /
load_full_state() (torch) and sharded_state() / load_sharded_state() (torch_dist;
megaq.zero.state); FP8's amax histories and the trainer's counters travel in the
record's "extra" (megaq.parallel.fp8_delayed.checkpoint_extra / restore), qgZ's
residuals through engine.error_feedback_state().

Save (collective; rank r of the world, in this order): wait for a background save in
flight; refuse inf / nan weights (one all-reduce); rank 0 creates ``.iter_N.tmp``
(removing stale ones); the format's files: torch: DP rank 0 of each TP x PP rank its
model file (full state gathered over DP), torch_dist: every rank its own pieces through
DCP (rank 0 also the index and common.pt); every rank its RNG file and qgZ residuals;
(torch_dist: each rank hashes its own files); rank 0 writes the manifest, fsyncs,
renames the directory into place, then the tracker. Each phase is agreed: an error on
any rank removes the temporary directory and raises everywhere.

Load (collective): tracker -> ``iter_N``; the manifest required; verify and read the
record, this rank's RNG file and (torch, on a TP / PP change) every shard, agreed over
the ranks; compare settings with the flags (torch_dist: after verifying the files its
read plan touches); read (torch: the model file, resharded when the layout changed;
torch_dist: DCP into the views of engine.sharded_state()); hand over: engine.
load_full_state / load_sharded_state, the qgZ residuals, the LR schedule, the RNG streams.
"""
