from fractions import Fraction

import pytest

from torchpar.parallel.bubble import compute_actions, schedule_actions, simulate
from torchpar.parallel.pipeline import schedule_order
from torchpar.tools.schedule import _shade, text_gantt, write_png, write_svg


def bubble(name, pp, m, v):
    order, stages = schedule_order(name, pp, m, v)
    return simulate(schedule_actions(name, order, pp, m), stages)


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
@pytest.mark.parametrize("pp, m", [(4, 16), (2, 4), (4, 8), (8, 32)])
def test_single_stage_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, pp, m):
    sim = bubble(name, pp, m, 1)
    expected = Fraction(pp - 1, m + pp - 1)
    assert sim["bubble"] == pytest.approx(float(expected), abs=1e-12)
    for b in sim["bubble_per_rank"].values():
        assert b == pytest.approx(float(expected), abs=1e-12)


def test_tutorial_case_is_3_over_19():
    assert bubble("1F1B", 4, 16, 1)["bubble"] == pytest.approx(3 / 19)


@pytest.mark.parametrize("pp, m, v", [(4, 16, 2), (2, 8, 2), (4, 8, 2), (2, 4, 3)])
def test_interleaving_divides_the_bubble_by_v(pp, m, v):
    assert bubble("Interleaved1F1B", pp, m, v)["bubble"] == pytest.approx((pp - 1) / (v * m + pp - 1))


@pytest.mark.parametrize("name", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_zero_bubble_schedules_beat_interleaving(name):
    zb = bubble(name, 4, 16, 2)["bubble"]
    assert zb < bubble("Interleaved1F1B", 4, 16, 2)["bubble"] / 2


def test_every_action_of_torch_order_is_simulated():
    order, stages = schedule_order("ZBVZeroBubble", 2, 4, 2)
    actions = compute_actions(order)
    sim = simulate(actions, stages)
    assert (
        sum(len(t) for t in sim["timeline"].values())
        == sum(len(a) for a in actions.values())
        == 2 * 2 * 4 * 3
    )


def test_picture_text_and_svg(tmp_path):
    sim = bubble("1F1B", 2, 4, 1)
    text = text_gantt(sim)
    assert text.splitlines()[0].startswith("rank 0 |F0  F1") and "bubble  20.0%" in text
    write_svg(sim, tmp_path / "s.svg", "1F1B")
    svg = (tmp_path / "s.svg").read_text()
    assert svg.startswith("<svg") and svg.count('fill="#4C72B0"') == 8  # 2 ranks x 4 forwards
    assert svg.count("bubble 20.0%") == 2


def test_picture_png_and_virtual_stages(tmp_path):
    sim = bubble("Interleaved1F1B", 2, 4, 2)
    text = text_gantt(sim)
    assert text.splitlines()[0].startswith(
        "rank 0 |F0s0  F1s0"
    )  # stage named: each microbatch runs twice per rank
    write_svg(sim, tmp_path / "i.svg", "Interleaved1F1B")
    svg = (tmp_path / "i.svg").read_text()
    # a rank's second stage (2, 3) is drawn lighter than its first (0, 1): 2 ranks x 4 forwards each
    assert svg.count('fill="#4C72B0"') == 8 and svg.count(f'fill="{_shade("#4C72B0", 1)}"') == 8
    assert "F0s2" in svg and "F0s0" in svg
    write_png(sim, tmp_path / "i.png", "Interleaved1F1B")
    head = (tmp_path / "i.png").read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    assert width > 2 * height > 0  # a wide timeline, not an empty figure


def test_cli(capsys):
    from torchpar.commands import main

    assert main(["schedule", "--pp", "4", "--microbatches", "16", "--schedule", "1F1B"]) == 0
    assert "bubble 15.79%" in capsys.readouterr().out
    assert main(["schedule", "--pp", "4", "--microbatches", "16", "--schedule", "ZBV"]) == 2
    assert main(["schedule", "--pp", "2", "--microbatches", "4", "--out", "gantt.jpg"]) == 2
    assert "written as .svg or .png" in capsys.readouterr().err
