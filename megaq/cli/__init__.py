"""The user commands, one module each, with `main(argv)` (returns an exit status; tests
call it) and `cli()` (the console script). pyproject.toml's [project.scripts] installs
them; tools/<name>.py keeps Megatron-LM's `python tools/<name>.py` working from a checkout.

    megaq-pretrain          megaq.pretrain (pretrain_gpt.py)
    megaq-preprocess        preprocess_data.py      jsonl -> Megatron's .bin/.idx
    megaq-train-tokenizer   train_tokenizer.py      a SentencePiece model
    megaq-build-corpus      build_corpus.py         the built-in corpus (no download)
    megaq-convert           convert_checkpoint.py   megaq <-> transformers, Megatron-LM
    megaq-generate          generate.py             sample from a checkpoint
    megaq-plot              plot_metrics.py         metrics files -> PNG curves
"""
