"""Ships `kernels/` as `megaq.kernels` next to the `megaq` package (metadata: pyproject.toml).

`kernels/` lives at the top level of the repository for visibility, but an unrelated
PyPI package owns the import name `kernels`, so it is only ever importable as
`megaq.kernels`. A checkout with no install serves the same name from the same folder
(megaq/__init__.py).
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["megaq", "megaq.*"]) + ["megaq.kernels"],
    package_dir={"megaq.kernels": "kernels"},
)
