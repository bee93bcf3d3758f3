"""The pictures of ``gt.debug`` (globaltensor/pictures.py): ``draw_layout``'s text grid
of who holds which block, on layouts made without processes (a placement of 4 ranks
needs only WORLD_SIZE), ``show_layout`` on a tensor of this one-process world, and the
PNGs of ``plot_layout`` and ``plot_step``."""
import sys

import pytest
import torch

import globaltensor as gt
from globaltensor import sbp
from globaltensor.layout import Layout
from globaltensor.pictures import MAX_HEIGHT, MAX_WIDTH, _step_rows, draw_layout, layout_blocks, plot_layout, plot_step
from globaltensor.placement import Placement
from globaltensor.planner.explain import CallChoice, StepReport

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def world_of_eight(monkeypatch):
    # placements of up to 8 ranks, for layouts only: no tensor is made in these tests
    monkeypatch.setenv("WORLD_SIZE", "8")


def _layout(shape, ranks, s) -> Layout:
    return Layout.make(shape, Placement("cpu", ranks), s)


def _box(text: str) -> list:
    """The grid's lines (the box), without the caption and the notes."""
    return [line for line in text.splitlines() if line[:1] in "+|"]


def test_1d_split_over_four_ranks_exact(world_of_eight):
    assert draw_layout(_layout((8,), [0, 1, 2, 3], sbp.split(0))) == "\n".join([
        "dim 0 (8) across",
        "+--------------+--------------+--------------+-------------+",
        "|      0       |      1       |      2       |      3      |",
        "+--------------+--------------+--------------+-------------+"])


def test_2d_rows_split_over_two_ranks_exact(world_of_eight):
    # 2 x 6 drawn 60 wide and 2 * 60 / 12 + 3 lines tall: the shape's proportions
    blank, edge = "|" + " " * 58 + "|", "+" + "-" * 58 + "+"
    assert draw_layout(_layout((2, 6), [0, 1], sbp.split(0))) == "\n".join([
        "rows: dim 0 (2), columns: dim 1 (6)", edge, blank, "|" + " " * 28 + "0" + " " * 29 + "|",
        blank, blank, edge, blank, "|" + " " * 28 + "1" + " " * 29 + "|", blank, edge])


def test_2x2_mesh_split_rows_and_columns(world_of_eight):
    layout = _layout((8, 8), [[0, 1], [2, 3]], (sbp.split(0), sbp.split(1)))
    blocks = layout_blocks(layout)
    assert blocks.row_cuts == blocks.col_cuts == (0, 4, 8)
    assert blocks.labels == (("0", "1"), ("2", "3")) and blocks.notes == ()
    box = _box(draw_layout(layout))
    edges = [line for line in box if line.startswith("+")]
    assert len(edges) == 3 and all(line.count("+") == 3 for line in edges)
    # a square tensor: twice as wide as tall (a character is about twice as tall as wide)
    assert len(box) == MAX_HEIGHT and len(box[0]) == 2 * MAX_HEIGHT
    assert [line.split() for line in box if line.strip("|+- ")] == [["|", "0", "|", "1", "|"],
                                                                   ["|", "2", "|", "3", "|"]]


def test_broadcast_is_one_block_of_every_rank(world_of_eight):
    for ranks, s in (([0, 1, 2, 3], sbp.broadcast),
                     ([[0, 1], [2, 3]], (sbp.broadcast, sbp.broadcast))):
        layout = _layout((8, 8), ranks, s)
        assert layout_blocks(layout).labels == (("0,1,2,3",),)
        text = draw_layout(layout)
        assert sum(line.startswith("+") for line in _box(text)) == 2
        assert "0,1,2,3" in text and "copies of one block (broadcast)" in text


def test_partial_sum_blocks_join_addends_with_plus(world_of_eight):
    text = draw_layout(_layout((8, 8), [0, 1, 2, 3], sbp.partial_sum))
    assert "0+1+2+3" in text and "their sum is its value (partial_sum)" in text
    # a split of rows on the mesh's first axis, addends on its second
    blocks = layout_blocks(_layout((8, 8), [[0, 1], [2, 3]], (sbp.split(0), sbp.partial_sum)))
    assert blocks.labels == (("0+1",), ("2+3",))
    assert blocks.notes == ("a+b: addends of the block, their sum is its value (partial_sum "
                            "on placement axis 1)",)
    # addends on the first axis, copies across the second: two copies of a sum of two
    assert layout_blocks(_layout((8, 8), [[0, 1], [2, 3]], (sbp.partial_max, sbp.broadcast))
                         ).labels == (("0+2,1+3",),)


def test_strided_split_interleaves_blocks(world_of_eight):
    layout = _layout((8,), [0, 1, 2, 3], sbp.split(0, blocks=2))
    blocks = layout_blocks(layout)
    assert blocks.col_cuts == tuple(range(9))
    assert blocks.labels == (("0", "1", "2", "3", "0", "1", "2", "3"),)
    text = draw_layout(layout)
    assert [cell.strip() for cell in _box(text)[1].split("|")[1:-1]] == list("01230123")
    assert "dim 0 is 2 blocks of 4" in text and "interleave" in text
    # on a mesh: a strided split of the columns and a split of the rows
    mesh = layout_blocks(_layout((8, 12), [[0, 1], [2, 3]], (sbp.split(1, blocks=3), sbp.split(0))))
    assert mesh.labels == (("0", "2") * 3, ("1", "3") * 3)


def test_higher_dims_draw_the_split_dims_and_name_the_rest(world_of_eight):
    blocks = layout_blocks(_layout((4, 8, 16), [[0, 1], [2, 3]], (sbp.split(2), sbp.broadcast)))
    assert blocks.dims == (0, 2) and blocks.labels == (("0,1", "2,3"),)
    assert "dim 1 not drawn (each block spans it whole)" in blocks.notes
    three = layout_blocks(_layout((4, 8, 16, 2), [[[0, 1], [2, 3]], [[4, 5], [6, 7]]],
                                  (sbp.split(0), sbp.split(1), sbp.split(3))))
    assert three.dims == (0, 1) and three.labels == (("0,1", "2,3"), ("4,5", "6,7"))
    assert three.notes[0].startswith("dims 2, 3 not drawn (dim 3 split too")
    text = draw_layout(_layout((3, 5, 7), [0, 1], sbp.broadcast))
    assert text.startswith("rows: dim 0 (3), columns: dim 1 (5)") and "dim 2 not drawn" in text


def test_the_box_fits_and_keeps_the_shapes_proportions(world_of_eight):
    for shape, s in (((1024, 16), sbp.split(0)), ((16, 4096), sbp.split(1)),
                     ((5, 7), sbp.split(1)), ((9, 3), sbp.split(0)), ((7,), sbp.split(0))):
        box = _box(draw_layout(_layout(shape, [0, 1, 2, 3], s)))
        assert len({len(line) for line in box}) == 1, box
        assert 16 <= len(box[0]) <= MAX_WIDTH and len(box) <= MAX_HEIGHT, box
    tall = _box(draw_layout(_layout((1024, 16), [0, 1, 2, 3], sbp.split(0))))
    wide = _box(draw_layout(_layout((16, 4096), [0, 1, 2, 3], sbp.split(1))))
    assert len(tall) > len(tall[0]) / 2 and len(wide) < len(wide[0]) / 4
    # an uneven split draws its bigger parts bigger: 5 columns over 4 ranks, 2 1 1 1
    cells = _box(draw_layout(_layout((4, 5), [0, 1, 2, 3], sbp.split(1))))[0].split("+")[1:-1]
    assert len(cells[0]) > max(map(len, cells[1:])), cells


def test_empty_ranks_scalars_and_too_many_blocks(world_of_eight):
    text = draw_layout(_layout((3,), [0, 1, 2, 3], sbp.split(0)))
    assert "rank(s) 3 hold no elements" in text and "|" in text
    scalar = draw_layout(_layout((), [0, 1, 2, 3], sbp.partial_sum))
    assert scalar.splitlines()[:4] == ["a scalar", "+--------------+", "|   0+1+2+3    |",
                                     "+--------------+"]
    many = draw_layout(_layout((100,), list(range(8)), sbp.split(0, blocks=5)))
    assert many.startswith("(1 x 40 blocks: too many to draw") and "+" not in many


def test_long_labels_are_shortened_or_wrapped(world_of_eight, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "32")
    assert layout_blocks(_layout((8,), list(range(32)), sbp.broadcast)).labels == (("0-31",),)
    assert layout_blocks(_layout((8,), list(range(32)), sbp.partial_sum)).labels == (("0+...+31",),)
    mesh = [list(range(16)), list(range(16, 32))]
    text = draw_layout(_layout((8, 8), mesh, (sbp.partial_sum, sbp.broadcast)))
    assert "0+16," in text and "15+31" in text   # wrapped over lines, whole
    assert all(len(line) <= MAX_WIDTH for line in _box(text))


def test_show_layout_draws_above_each_ranks_slice(capsys):
    # this process is a world of one: a real tensor
    x = gt.randn(4, 6, placement=gt.placement.all("cpu"), sbp=gt.sbp.split(0))
    text = gt.debug.show_layout(x)
    assert capsys.readouterr().out == text + "\n"
    lines = text.splitlines()
    assert lines[0] == f"(4, 6) torch.float32 on {x.placement}, sbp (split(dim=0),)"
    assert lines[1] == "  rows: dim 0 (4), columns: dim 1 (6)"
    assert lines[-1] == "  rank 0 [0]: [0:4, 0:6] shape (4, 6)"
    assert "  " + "\n  ".join(draw_layout(x.global_layout).splitlines()) in text


def test_plot_layout_writes_a_png(tmp_path, world_of_eight):
    for i, s in enumerate([(sbp.split(0), sbp.split(1)), (sbp.broadcast, sbp.partial_sum),
                           (sbp.split(1, blocks=2), sbp.broadcast)]):
        path = tmp_path / f"layout{i}.png"
        plot_layout(_layout((8, 8), [[0, 1], [2, 3]], s), str(path))
        data = path.read_bytes()
        assert data[:8] == PNG_MAGIC and 2000 < len(data) < 200_000, len(data)
    many = _layout((128, 128), [[0, 1], [2, 3]], (sbp.split(0, blocks=64), sbp.split(1, blocks=64)))
    with pytest.raises(ValueError, match="128 x 128 blocks, too many to plot"):
        plot_layout(many, str(tmp_path / "many.png"))
    assert not (tmp_path / "many.png").exists()


def test_plot_layout_of_a_tensor(tmp_path):
    x = gt.randn(6, placement=gt.placement.all("cpu"), sbp=gt.sbp.broadcast)
    gt.debug.plot_layout(x, str(tmp_path / "x.png"))
    assert (tmp_path / "x.png").read_bytes()[:8] == PNG_MAGIC


def _report(n: int) -> StepReport:
    """``n`` calls; every third sends nothing, the later half runs in backward."""
    calls = tuple(CallChoice(i, "mm" if i % 2 else "addmm", "(split(dim=0)) -> (split(dim=0))",
                             "(broadcast) -> (broadcast)" if i % 4 == 0 else
                             "(split(dim=0)) -> (split(dim=0))", 1e-4 * i, 8e-5 * i,
                             0 if i % 3 == 0 else 1000 * i, 0 if i % 3 == 0 else 4096 * i,
                             0 if i % 3 == 0 else 2048 * (i % 7), i >= n // 2) for i in range(n))
    return StepReport(calls, sum(c.per_op_cost for c in calls), sum(c.planned_cost for c in calls), 0.1)


def test_step_rows_keep_the_top_calls_and_sum_the_rest():
    report = _report(60)     # 40 calls send bytes
    rows = _step_rows(report, top=30)
    assert len(rows) == 31 and rows[-1][0] == "others (10 calls)"
    kept = [int(r[0].split()[0][1:]) for r in rows[:-1]]
    assert kept == sorted(kept) and all(i % 3 for i in kept)     # in call order, none silent
    # the kept are the biggest by bytes, the others hold the remaining bytes and time
    sending = [c for c in report.calls if c.index % 3]
    assert sorted(kept) == sorted(c.index for c in sending)[-30:]
    assert sum(r[1] for r in rows) == report.per_op_bytes
    assert sum(r[2] for r in rows) == report.planned_bytes
    assert rows[-1][3] == pytest.approx(sum(c.per_op_cost for c in sending[:10]))
    assert [r[6] for r in rows[:-1]] == [i >= 30 for i in kept]
    assert rows[0][0] == f"#{kept[0]} {report.calls[kept[0]].op}" + (" *" if kept[0] % 4 == 0 else "")
    assert len(_step_rows(_report(10), top=30)) == 6       # no "others" row


def test_plot_step_writes_a_png(tmp_path):
    for n, name in ((60, "many.png"), (6, "few.png"), (0, "empty.png")):
        plot_step(_report(n), str(tmp_path / name))
        data = (tmp_path / name).read_bytes()
        assert data[:8] == PNG_MAGIC and 2000 < len(data) < 300_000, (name, len(data))


def test_explain_step_says_which_calls_ran_in_backward():
    from globaltensor.planner import record
    record.clear()
    P = gt.placement.all("cpu")
    model = gt.nn.to_global(torch.nn.Linear(4, 3), P, gt.sbp.broadcast)
    x = gt.to_global(torch.randn(2, 4), P, gt.sbp.split(0))
    try:
        report = gt.debug.explain_step(lambda: model(x).sum().backward())
    finally:
        record.clear()
    flags = [c.in_backward for c in report.calls]
    ops = [c.op for c in report.calls]
    assert flags[:ops.index("sum") + 1] == [False] * (ops.index("sum") + 1) and any(flags), (ops, flags)
    assert flags == sorted(flags)      # backward runs after forward


def test_pictures_need_matplotlib_and_say_how_to_get_it(tmp_path, world_of_eight, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)    # as if not installed
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_layout(_layout((4,), [0, 1], sbp.split(0)), str(tmp_path / "x.png"))
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_step(_report(4), str(tmp_path / "s.png"))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name, args", [
    ("show_layout", (torch.ones(2),)), ("notation", (torch.ones(2),)),
    ("plot_layout", (torch.ones(2), "unwritten.png")), ("explain", (torch.ones(2),))])
def test_a_plain_tensor_is_refused_by_name(name, args):
    with pytest.raises(TypeError, match=f"gt.debug.{name}: expected a GlobalTensor.* got Tensor"):
        getattr(gt.debug, name)(*args)


def test_explain_of_a_function_points_to_explain_step():
    with pytest.raises(TypeError, match="got function .*gt.debug.explain_step"):
        gt.debug.explain(lambda: None)
