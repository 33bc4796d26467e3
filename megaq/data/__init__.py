"""Data pipeline: tokenizers (SentencePiece, GPT-2 BPE, HuggingFace), Megatron .bin/.idx,
GPT dataset, blending, the distributed batch iterator and the built-in corpus.

Modules (import the one you need; nothing here imports torch.distributed):
  errors        DataError: bad input the user can fix (one-line message)
  fsutil        temp-name-then-rename writes and a file lock
  tokenizer     build_tokenizer(type, model, vocab_file, merge_file) -> .vocab_size .eod .pad
                .tokenize .detokenize (SentencePiece types here)
  gpt2_bpe      GPT2BPETokenizer: byte-level BPE from encoder.json + vocab.bpe
  hf_tokenizer  HuggingFaceTokenizer: a local tokenizer directory (transformers/tokenizers)
  tokenizer_training  train_sentencepiece(...) used by tools/train_tokenizer.py
  indexed       Megatron-compatible IndexedDataset reader and IndexedDatasetWriter
  preprocess    jsonl -> .bin/.idx with worker processes (tools/preprocess_data.py)
  gpt_dataset   GPTDataset, MockGPTDataset, build_train_valid_test_datasets
  blending      BlendedDataset and the weighted --data-path parser
  iterator      BatchIterator: each DP rank's micro-batches of each global batch
  builtin       ensure_builtin_corpus(): stdlib text corpus + tokenizer, built on first use
"""
