"""docs/results/published_clusters.json is the data of the planner's independent check:
a hand edit that breaks its references or its arithmetic would silently move the check."""
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "docs", "results", "published_clusters.json")


def _load():
    with open(DATA) as f:
        return json.load(f)


def test_every_reference_resolves_and_ids_are_unique():
    doc = _load()
    ids = [c["id"] for c in doc["cells"]]
    assert len(ids) == len(set(ids)), "duplicate cell ids"
    for c in doc["cells"]:
        assert c["source"] in doc["sources"], c["id"]
        assert c["flop_convention"] in doc["flop_conventions"], c["id"]
        assert c["check_use"].split()[0].rstrip(":") in ("primary", "secondary", "context"), c["id"]
        for field, key in c["inferred"].items():
            assert key in doc["inference_notes"], (c["id"], field, key)


def test_link_rates_are_the_links_used():
    """inter_node_gbps is what the run was allowed to use: links used x link rate."""
    for c in _load()["cells"]:
        hw = c["hardware"]
        if hw["inter_node_gbps"] is None:
            continue
        assert hw["inter_node_gbps"] == hw["nics_used_per_node"] * hw["nic_gbps"], c["id"]
        assert hw["num_gpus"] == hw["num_nodes"] * hw["gpus_per_node"], c["id"]


def test_zeropp_speedups_are_the_ratio_of_the_bars_and_match_the_printed_labels():
    cells = [c for c in _load()["cells"] if c["source"] == "zeropp_blog"]
    assert len(cells) == 20
    for c in cells:
        p = c["published"]
        z3, zpp = p["zero3_tflops_per_gpu"], p["zeropp_tflops_per_gpu"]
        for bar in (z3, zpp):   # each reading rounds to the integer printed on the figure
            assert abs(bar["value"] - bar["label_printed"]) <= 0.5 + bar["uncertainty"], c["id"]
        sp = p["speedup_zeropp_over_zero3"]
        assert abs(sp["value"] - zpp["value"] / z3["value"]) < 1e-3, c["id"]
        hw = c["hardware"]
        assert (hw["num_gpus"], hw["gpus_per_node"]) == (384, 16), c["id"]
        assert c["systems"]["zeropp"]["zero_hpz_partition_size"] == hw["gpus_per_node"], c["id"]
