"""Every Python file of the project compiles: tools and scripts that no other test
imports (GPU benchmarks, device-only checks) would otherwise break unnoticed, as
tools/bench/bench_train.py once did with an indentation error."""

import glob
import os
import py_compile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# each file once: megaq/kernels is a link to kernels/ (listed first), which ** follows
_REAL: dict = {}
for _pattern in ("*.py", "kernels/*.py", "megaq/**/*.py", "tools/**/*.py", "scripts/*.py", "tests/*.py"):
    for _path in sorted(glob.glob(os.path.join(REPO, _pattern), recursive=True)):
        _REAL.setdefault(os.path.realpath(_path), _path)
FILES = sorted(_REAL.values())


def test_the_file_list_is_not_empty():
    assert any(p.endswith(os.path.join("tools", "bench", "bench_train.py")) for p in FILES)


@pytest.mark.parametrize("path", FILES, ids=lambda p: os.path.relpath(p, REPO))
def test_compiles(path, tmp_path):
    py_compile.compile(path, cfile=str(tmp_path / "out.pyc"), doraise=True)
