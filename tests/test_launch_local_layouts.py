"""Every example command in docs/CHOOSING_A_LAYOUT.md passes megaq's validation at the
world size it is written for (the `<!-- validate: world=N ranks_per_node=G -->` line
before its code block)."""

import os
import re
import shlex

import pytest

from megaq.config.arguments import parse_config

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                   "CHOOSING_A_LAYOUT.md")
BLOCK = re.compile(r"<!-- validate: world=(\d+) ranks_per_node=(\d+) -->\n```bash\n(.*?)```", re.S)


def examples():
    text = open(DOC).read()
    found = [(int(w), int(g), body) for w, g, body in BLOCK.findall(text)]
    assert len(found) == text.count("<!-- validate:")  # no marker without its block
    return found


def flags_of(command: str) -> list[str]:
    words = shlex.split(command.replace("\\\n", " "))
    words = words[words.index("pretrain_gpt.py") + 1:]
    return [{"$DATA": "/data/corpus_text_document", "$TOK": "/data/tok.model"}.get(w, w)
            for w in words]


@pytest.mark.parametrize("world,rpn,command", examples(),
                         ids=lambda x: None if not isinstance(x, str) else x.split("--num-layers")[1][:4].strip())
def test_layout_examples_validate(world, rpn, command):
    config = parse_config(flags_of(command), world_size=world, ranks_per_node=rpn)
    # What the text promises: one node's examples use all 8 GPUs; hpZ is the DP ranks
    # per node whenever it is on.
    p, hpz = config.parallel, config.zero.hpz_partition_size
    assert p.dp == world // (p.tp * p.pp)
    if hpz > 1:
        assert hpz == min(rpn // p.tp, p.dp)


def test_every_model_size_has_an_8_gpu_command():
    eight = [c for w, _, c in examples() if w == 8]
    sizes = {flags_of(c)[flags_of(c).index("--hidden-size") + 1] for c in eight}
    assert sizes == {"2048", "4096", "8192"}  # 1.3B, 7B, 70B (rehearsal depth)
