"""Layouts written as text (``gt.layout``) and the short notation of a layout."""
import pytest
import torch

import globaltensor as gt
from globaltensor.layout import Layout
from globaltensor.layout_spec import notation
from globaltensor.placement import Placement

S, B = gt.sbp.split, gt.sbp.broadcast


@pytest.fixture
def world_of_four(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")   # placements of 4 ranks, made with no processes


def test_a_spec_compares_with_layouts_sbp_tuples_and_specs(world_of_four):
    p = Placement("cpu", [[0, 1], [2, 3]])
    x = Layout.make((8, 4), p, (S(0), B))
    assert x == gt.layout("S(0), B") and gt.layout("S(0), B") == x
    assert (S(0), B) == gt.layout("split(dim=0), broadcast")
    assert gt.layout("S0, B") == gt.layout("S(0),B") and x != gt.layout("B, S(0)")
    assert gt.layout("P, P(max)") == (gt.sbp.partial_sum, gt.sbp.partial_max)
    assert gt.layout("S(1, blocks=2)") == (S(1, blocks=2),)
    assert x == Layout.make((8, 4), p, (S(0), B)) and x != Layout.make((8, 4), p, (B, B))
    assert len({gt.layout("S(0), B"), gt.layout("S0, B")}) == 1
    assert repr(gt.layout("split(0), partial_max")) == 'layout("S(0), P(max)")'


def test_a_spec_that_cannot_be_read_says_what_to_write():
    for bad in ("Q", "S(x)", "", "S(0), ?"):
        with pytest.raises(ValueError, match="gt.layout"):
            gt.layout(bad)


def test_the_notation_names_the_axes_that_split_each_dim(world_of_four):
    one, two = Placement("cpu", [0, 1]), Placement("cpu", [[0, 1], [2, 3]])
    assert notation(Layout.make((8, 4), one, S(0)), torch.float32) == "f32[8@0, 4]"
    assert notation(Layout.make((8, 4), two, (S(0), S(1))), torch.bfloat16) == "bf16[8@0, 4@1]"
    assert notation(Layout.make((8, 4), two, (S(0), S(0)))) == "[8@0@1, 4]"
    assert notation(Layout.make((8, 4), two, (B, gt.sbp.partial_sum))) == "[8, 4]{sum@1}"
    assert notation(Layout.make((8, 6), one, S(0, blocks=2))) == "[8@0/2, 6]"


def test_a_tensors_notation_and_spec_in_one_process():
    x = gt.randn(8, 4, placement=gt.placement("cpu", [0]), sbp=S(0))
    assert gt.debug.notation(x) == "f32[8@0, 4]"
    assert x.global_layout == gt.layout("S(0)") and x.sbp == gt.layout("S(0)")
    assert x.layout == torch.strided     # torch's memory layout, as torch reads it


def test_an_sbp_round_trips_through_its_text_and_old_plan_files_read():
    from globaltensor.layout_spec import sbp_from_text, sbp_text
    for s in (S(0), S(2, blocks=4), B, gt.sbp.partial_sum, gt.sbp.partial_max):
        assert sbp_from_text(sbp_text(s)) == s
    # auto_parallel's plan files before this version wrote these
    assert [sbp_from_text(t) for t in ("split(1,2)", "split(0)", "partial_sum", "broadcast")] == \
        [S(1, blocks=2), S(0), gt.sbp.partial_sum, B]
