"""megaq: installs the `megaq` package and ships `kernels/` as `megaq.kernels`.

`kernels/` lives at the top level of the repository for visibility, but an unrelated
PyPI package owns the import name `kernels`, so it is only ever importable as
`megaq.kernels`.
"""

from setuptools import find_packages, setup

HF_PINS = ["transformers==5.23.0", "tokenizers==0.23.3", "safetensors==0.8.0",
           "huggingface-hub==2.4.0", "protobuf==7.36.2"]

packages = find_packages(include=["megaq", "megaq.*"]) + ["megaq.kernels"]

setup(
    name="megaq",
    version="0.1.0",
    description="GPT pretraining: Megatron-style TP/PP with a ZeRO-3 engine speaking ZeRO++",
    python_requires=">=3.10",
    packages=packages,
    package_dir={"megaq.kernels": "kernels"},
    # torch is deliberately not pinned here: scripts/setup_env.sh installs the CPU
    # build only where no torch is importable, and never replaces a CUDA build.
    install_requires=["numpy", "sentencepiece", "tqdm"],
    # hf: tools/convert_checkpoint.py's transformers side (the export itself needs none of
    # it; reading safetensors and building tokenizer.json do). Pinned as CI tests them.
    extras_require={"test": ["pytest", *HF_PINS], "plot": ["matplotlib"], "hf": HF_PINS},
)
