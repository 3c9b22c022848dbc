"""What the outputs say about variation and faults: `variation:` is one dataclass (NIC faults included), the
JSON's `hardware` section says how the collectives were priced and lists what `variation:` names, the
summary and the HTML report say the same in one wording, and a plain scenario's outputs do not change.

Expected values come from the scenario's own inputs (the faults, the layout asked for, the reference's
switch counts: topology.LEAF_DOWNLINKS, SPINES_PER_LEAF), never from a run of the model."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_sim.cli import main
from fsdp_sim.hardware.topology import SPINES_PER_LEAF
from fsdp_sim.hardware.variation import (LinkFault, Variation, pace_factor, paced_by, slowest_rank_factor,
                                         weakest_nic_node)
from fsdp_sim.results.html import run_report
from fsdp_sim.results.report import summary
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate

TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn_hidden": 176, "vocab": 1003}
FAULTS = {"stragglers": [{"rank": 3, "speed": 0.9}], "nodes": [{"node": 1, "speed": 0.95}],
          "links": [{"node": 1, "nic": 2, "bandwidth": 0}, {"node": 2, "nic": 0, "bandwidth": 0.5}]}
FAT_TREE = {"topology": "fat_tree", "nodes_per_leaf": 2, "oversubscription": 2.0}


def _data(nodes: int = 4, network: dict | None = None, variation: dict | None = None) -> dict:
    """The tiny model on `nodes` H100 nodes of 8 (one shard group over all of them: its rings cross nodes)."""
    hardware = {"profile": "h100-sxm", "nodes": nodes} | ({"network": network} if network else {})
    return ({"model": TINY, "training": {"micro_batch": 2, "seq_len": 32}, "hardware": hardware}
            | ({"variation": variation} if variation else {}))


def _hardware(data: dict) -> dict:
    return simulate(parse_scenario(data)).to_dict()["hardware"]


def _cli(tmp_path, data: dict, capsys, *flags: str) -> tuple[int, str, str]:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    rc = main(["run", str(path), *flags])
    out, err = capsys.readouterr()
    return rc, out, err


def test_variation_holds_the_link_faults():
    """`variation.links` is parsed into `Variation.links`, in (node, NIC) order; `Scenario.link_faults` reads it."""
    sc = parse_scenario(_data(variation={"links": FAULTS["links"][::-1], "seed": 7}))
    assert sc.variation.links == (LinkFault(1, 2, 0.0), LinkFault(2, 0, 0.5))
    assert sc.link_faults is sc.variation.links and sc.variation.seed == 7
    assert parse_scenario(_data()).variation == Variation()


def test_json_lists_the_variation_and_the_graph_pricing():
    """Every fault kind at once on a 2:1 fat tree of two nodes a leaf: the JSON names each, the weakest node
    for rings (node 1: one NIC of 8 down, 7/8 of its sum; node 2 keeps 7.5/8), what paces compute (rank 3
    at 0.9: 1/0.9 is past the expected slowest of 32 under 2.6 %) and how the collectives were priced."""
    hw = _hardware(_data(network=FAT_TREE, variation=FAULTS))
    assert hw["variation"] == FAULTS | {"links": [{"node": 1, "nic": 2, "bandwidth": 0.0},
                                                  {"node": 2, "nic": 0, "bandwidth": 0.5}],
                                        "weakest_nic_node": {"node": 1, "nic_sum_fraction": 7 / 8}}
    assert hw["paced_by"] == "rank 3" and hw["slowest_named_speed"] == 0.9
    assert hw["slowest_rank_factor"] == pytest.approx(1 / 0.9)
    leaves = 4 // 2
    assert hw["collective_pricing"] == {"priced_on": "topology graph", "because": ["oversubscription", "nic_faults"],
                                        "topology": "fat_tree", "nodes_per_leaf": 2,
                                        "spines": max(1, math.floor(leaves * SPINES_PER_LEAF)),
                                        "oversubscription": 2.0, "groups": ["shard"]}


def test_each_reason_alone_and_a_plain_scenario_has_none_of_the_keys():
    """Oversubscription alone (rail-optimised default layout, 32 nodes a rail leaf) and NIC faults alone each
    give their reason; a plain multi-node scenario keeps its JSON: no new key (its goldens unchanged)."""
    over = _hardware(_data(network={"oversubscription": 2.0}))
    assert over["collective_pricing"]["because"] == ["oversubscription"]
    assert over["collective_pricing"]["topology"] == "rail_optimized"
    assert over["collective_pricing"]["nodes_per_leaf"] == 32 and "variation" not in over
    nic = _hardware(_data(variation={"links": [{"node": 0, "nic": 1, "bandwidth": 0.25}]}))
    assert nic["collective_pricing"]["because"] == ["nic_faults"] and nic["collective_pricing"]["oversubscription"] == 1.0
    assert nic["variation"]["weakest_nic_node"] == {"node": 0, "nic_sum_fraction": 1 - 0.75 / 8}
    plain = _hardware(_data())
    assert not {"variation", "collective_pricing", "paced_by", "slowest_named_speed"} & plain.keys()


def test_nic_faults_on_one_node_are_listed_but_priced_by_the_closed_forms(tmp_path, capsys):
    """One node: no collective crosses a NIC, so the faults are listed and the summary says they cost nothing."""
    data = _data(nodes=1, variation={"links": [{"node": 0, "nic": 3, "bandwidth": 0}]})
    hw = _hardware(data)
    assert "collective_pricing" not in hw and hw["variation"]["links"] == [{"node": 0, "nic": 3, "bandwidth": 0.0}]
    rc, out, _ = _cli(tmp_path, data, capsys)
    assert rc == 0
    assert ("  fabric             collectives priced by the closed forms: no collective crosses the NICs (one node), "
            "so the NIC faults cost nothing") in out.splitlines()


def test_summary_lines_say_what_paces_the_step_in_one_wording(tmp_path, capsys):
    rc, out, _ = _cli(tmp_path, _data(network=FAT_TREE, variation=FAULTS), capsys)
    assert rc == 0
    lines = out.splitlines()
    assert lines[3].endswith(", paced by rank 3 at speed 0.90 (slower than the expected slowest of 32 GPUs under "
                             "spread 2.6 %: compute x1.111)")
    assert lines[4] == ("  variation          rank 3 at speed 0.90, node 1 at speed 0.95, node 1 NIC 2 down, node 2 NIC 0 "
                        "at bandwidth 0.50 (the weakest node for rings across nodes: node 1, its NICs at 87.5 % of their sum)")
    assert lines[5] == ("  fabric             collectives priced on the topology graph (oversubscription 2:1 on fat_tree "
                        "with 2 nodes per leaf and NICs below their rate; 1 spine) for the shard group")


@pytest.mark.parametrize("variation, pacer, words", [
    ({"nodes": [{"node": 2, "speed": 0.8}], "stragglers": [{"rank": 0, "speed": 0.85}]}, "node 2",
     "paced by node 2 at speed 0.80 (slower than the expected slowest of 32 GPUs under spread 2.6 %: compute x1.250)"),
    ({"stragglers": [{"rank": 5, "speed": 0.99}]}, "spread",
     "the slowest of 32 GPUs' pace (spread 2.6 %, slower than any rank or node named: compute x"),
])
def test_the_pacer_is_the_slowest_named_or_the_spread(variation, pacer, words):
    d = simulate(parse_scenario(_data(variation=variation))).to_dict()
    assert d["hardware"]["paced_by"] == pacer
    assert f", {words}" in summary(d).splitlines()[3]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.05, 1.5), max_size=3), st.lists(st.floats(0.05, 1.5), max_size=3),
       st.floats(0.0, 0.05), st.sampled_from([2, 16, 512]))
def test_paced_by_names_what_pace_factor_charges(straggler_speeds, node_speeds, spread, world):
    """The pacer named is the one whose factor `pace_factor` charges: 1 / its speed, or the spread's."""
    var = Variation(spread, stragglers=tuple(enumerate(straggler_speeds)), nodes=tuple(enumerate(node_speeds)))
    gpn = min(world, 8)
    pacer = paced_by(var, world, gpn)
    if pacer == "spread":
        assert pace_factor(var, world, gpn) == slowest_rank_factor(world, spread)
    else:  # a named rank in a named node runs at both speeds (rank_speeds)
        kind, index = pacer.split()
        speed = dict(var.stragglers if kind == "rank" else var.nodes)[int(index)]
        speed *= dict(var.nodes).get(int(index) // gpn, 1.0) if kind == "rank" else 1.0
        assert speed == var.slowest_named(gpn) and pace_factor(var, world, gpn) == 1 / speed


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.tuples(st.integers(0, 5), st.integers(0, 7)), st.sampled_from([0.0, 0.25, 0.5, 1.0]),
                       min_size=1, max_size=10))
def test_the_weakest_nic_node_keeps_the_least_of_its_sum(faults):
    links = tuple(LinkFault(n, j, b) for (n, j), b in sorted(faults.items()))
    weakest = weakest_nic_node(links, 8)
    kept = {n: 1 - sum(1 - b for (m, _), b in faults.items() if m == n) / 8 for n, _ in faults}
    if all(v == 1 for v in kept.values()):
        assert weakest is None
    else:
        assert weakest["nic_sum_fraction"] == pytest.approx(min(kept.values()))
        assert weakest["node"] == min(n for n, v in kept.items() if v == pytest.approx(min(kept.values())))


def test_html_and_json_say_what_the_summary_says(tmp_path, capsys):
    rc, out, _ = _cli(tmp_path, _data(network=FAT_TREE, variation=FAULTS), capsys,
                      "--html", str(tmp_path / "r.html"), "--json", str(tmp_path / "r.json"))
    assert rc == 0
    page = (tmp_path / "r.html").read_text()
    assert "<h2>Fabric and variation</h2>" in page
    for words in ("collectives priced on the topology graph (oversubscription 2:1 on fat_tree with 2 nodes per leaf",
                  "rank 3 at speed 0.90", "node 1 at speed 0.95", "node 1 NIC 2 down", "node 2 NIC 0 at bandwidth 0.50",
                  "node 1, its NICs at 87.5 % of their sum"):
        assert f"<td>{words}" in page and words in out
    assert json.loads((tmp_path / "r.json").read_text())["hardware"]["paced_by"] == "rank 3"
    assert "Fabric and variation" not in run_report(simulate(parse_scenario(_data())))


def test_per_rank_json_keeps_the_lists_and_the_pricing(tmp_path, capsys):
    """`--per-rank` plays each rank at its speed, so nothing paces the representative rank (no `paced_by`);
    the faults and the pricing are listed all the same."""
    rc, out, _ = _cli(tmp_path, _data(network=FAT_TREE, variation=FAULTS), capsys, "--per-rank",
                      "--json", str(tmp_path / "r.json"))
    assert rc == 0
    hw = json.loads((tmp_path / "r.json").read_text())["hardware"]
    assert "paced_by" not in hw and hw["variation"]["links"][0] == {"node": 1, "nic": 2, "bandwidth": 0.0}
    assert hw["collective_pricing"]["because"] == ["oversubscription", "nic_faults"]
    assert "  fabric             collectives priced on the topology graph" in out


@pytest.mark.parametrize("variation, words", [
    ({"links": [{"node": 0, "nic": 8, "bandwidth": 0}]}, "variation.links[0].nic: 8 is not in [0, 7]"),
    ({"links": [{"node": 1, "nic": 0, "bandwidth": 0}], "stragglers": [{"rank": 32, "speed": 0.9}]},
     "variation.stragglers[0].rank: 32 is out of range"),
])
@pytest.mark.parametrize("flags", [(), ("--per-rank",)])
def test_bad_variation_is_one_line_exit_2(tmp_path, capsys, variation, words, flags):
    rc, out, err = _cli(tmp_path, _data(variation=variation), capsys, *flags)
    assert rc == 2 and out == "" and err.count("\n") == 1 and words in err


def test_the_graphml_carries_the_layout_as_laid(tmp_path, capsys):
    import networkx as nx

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_data(network=FAT_TREE)))
    assert main(["topology", str(path), "-o", str(tmp_path / "g.graphml")]) == 0
    g = nx.read_graphml(tmp_path / "g.graphml").graph
    assert (g["topology"], g["nodes_per_leaf"], g["spines"], g["oversubscription"]) == ("fat_tree", 2, 1, 2.0)


def test_the_weakest_nic_node_counts_only_the_nics_the_jobs_rings_use():
    """A job on 2 of an H100 node's 8 GPUs uses the 2 NICs beside them (topology.job_nic_homes): NIC 7 down
    there is no weakest node (its rings never reach it), NIC 1 down leaves that node half its sum; one node's
    job has no rings across nodes at all."""
    def weakest(nodes, gpus, nic):
        data = _data(nodes=nodes, variation={"links": [{"node": 0, "nic": nic, "bandwidth": 0}]})
        data["hardware"]["gpus_per_node"] = gpus
        return _hardware(data)["variation"].get("weakest_nic_node")

    assert weakest(4, 2, 7) is None
    assert weakest(4, 2, 1) == {"node": 0, "nic_sum_fraction": 0.5}
    assert weakest(4, 8, 7) == {"node": 0, "nic_sum_fraction": 7 / 8}
    assert weakest(1, 8, 7) is None
