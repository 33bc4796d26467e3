"""megaq: installs the `megaq` package and ships `kernels/` as `megaq.kernels`.

`kernels/` lives at the top level of the repository for visibility, but an unrelated
PyPI package owns the import name `kernels`, so it is only ever importable as
`megaq.kernels`.
"""

from setuptools import find_packages, setup

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
    # tokenizers: GPT-2 BPE reference and HuggingFaceTokenizer tests (tests/test_data_tokenizer_bpe_hf.py)
    extras_require={"test": ["pytest", "tokenizers==0.23.3"], "plot": ["matplotlib"]},
)
