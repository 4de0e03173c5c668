import pytest
import torch
import torch.nn.functional as F
from conftest import TinyCNN, make_data, sgd

import dataflow as dfl
from dataflow import stages


def standard_graph(with_allreduce: bool = True) -> dfl.Graph:
    x, y = make_data(32)
    g = dfl.Graph()
    batch = g.add(stages.Load(dfl.io.ArraySource(x, y)))
    out = g.add(stages.Forward(TinyCNN, F.cross_entropy), batch)
    grads = g.add(stages.Backward(), out)
    if with_allreduce:
        grads = g.add(stages.AllReduce(), grads)
    g.add(stages.Update(sgd), grads)
    return g


def test_standard_graph_validates_in_order():
    assert standard_graph().validate(replicas=2) == (
        "Load",
        "Forward",
        "Backward",
        "AllReduce",
        "Update",
    )


def test_dangling_input_names_stage_and_input():
    g = standard_graph()
    g.add(stages.Transform(torch.log1p, name="Log"), "Nowhere")
    with pytest.raises(dfl.GraphError, match=r"'Log' has input 'Nowhere'"):
        g.validate()


def test_cycle_names_the_stages():
    g = dfl.Graph()
    g.add(stages.Transform(torch.log1p, name="A"), "B")
    g.add(stages.Transform(torch.log1p, name="B"), "A")
    with pytest.raises(dfl.GraphError, match="cycle through stages A, B"):
        g.validate()


def test_forward_without_backward():
    x, y = make_data(16)
    g = dfl.Graph()
    batch = g.add(stages.Load(dfl.io.ArraySource(x, y)))
    g.add(stages.Forward(TinyCNN, F.cross_entropy), batch)
    with pytest.raises(dfl.GraphError, match="Forward stage 'Forward' has no Backward"):
        g.validate()


def test_update_needs_allreduce_only_with_several_replicas():
    g = standard_graph(with_allreduce=False)
    assert "Update" in g.validate(replicas=1)
    with pytest.raises(dfl.GraphError, match="Update stage 'Update' has no AllReduce"):
        g.validate(replicas=2)


def test_add_rejects_non_stage_and_bad_input():
    g = dfl.Graph()
    with pytest.raises(dfl.GraphError, match="expected a dataflow stage"):
        g.add(lambda x: x)
    with pytest.raises(dfl.GraphError, match="an input must be the Node"):
        g.add(stages.Backward(), 3)


def test_duplicate_names_are_made_unique():
    g = dfl.Graph()
    a = g.add(stages.Transform(torch.log1p, name="T"))
    b = g.add(stages.Transform(torch.log1p, name="T"), a)
    assert (a.name, b.name) == ("T", "T2")


def test_to_dot_draws_every_edge():
    dot = standard_graph().to_dot()
    assert dot.startswith("digraph")
    for edge in ('"Load" -> "Forward"', '"Backward" -> "AllReduce"', '"AllReduce" -> "Update"'):
        assert edge in dot


def test_empty_graph():
    with pytest.raises(dfl.GraphError, match="empty"):
        dfl.Graph().validate()
