"""Looking at a run: TensorBoard and wandb receive what metrics.jsonl receives and go on under the
same run after a resume; ``torchpar plot`` and ``torchpar plan --out`` draw pictures."""

import json
import statistics
import sys

import numpy as np
import pytest
from harness import TINY
from test_train import records, run


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """4 steps saved at 2 and 4, then a run that resumes from step 2 (the steps 3-4 it replaces
    are in the event files already) and goes on to 6: TensorBoard and wandb offline on."""
    tmp = tmp_path_factory.mktemp("metrics")
    out = tmp / "run"
    common = [sys.executable, "-m", "torchpar", "train", "--config", str(TINY), "--job.dump_folder", str(out),
              "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--metrics.enable_tensorboard",
              "true", "--metrics.enable_wandb", "true"]
    first = run([*common, "--training.steps", "4"], tmp)
    assert first.returncode == 0, first.stderr
    second = run([*common, "--training.steps", "6", "--checkpoint.load_step", "2"], tmp)
    assert second.returncode == 0, second.stderr
    return out


def scalars(folder, key):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder / "tb"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(key)]


@pytest.mark.slow
def test_tensorboard_holds_the_loss_series_of_metrics_jsonl_once_per_step(resumed):
    logged = {}
    for r in records(resumed):  # the resumed run's steps 3-4 replace the first run's
        logged[r["step"]] = r["loss"]
    tb = scalars(resumed, "loss")
    assert [step for step, _ in tb] == [1, 2, 3, 4, 5, 6]  # no gap, no step twice
    assert all(abs(value - logged[step]) < 1e-6 for step, value in tb)
    assert [step for step, _ in scalars(resumed, "grad_norm")] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_wandb_run(resumed):
    runs = sorted((resumed / "wandb").glob("offline-run-*"))
    assert len(runs) == 2  # one folder per attempt, both under one run id
    assert len({r.name.rsplit("-", 1)[1] for r in runs}) == 1


def picture_colours(path) -> set:
    import matplotlib.image

    pixels = (matplotlib.image.imread(str(path))[..., :3] * 255).round().astype(int).reshape(-1, 3)
    return {tuple(p) for p in np.unique(pixels, axis=0)}


@pytest.mark.slow
def test_plot_draws_one_run_and_overlays_two(resumed, tmp_path):
    from torchpar.commands import main

    assert main(["plot", str(resumed), "--out", str(tmp_path / "one.png")]) == 0
    other = tmp_path / "other"  # a second run: the same records, the losses half a nat higher
    other.mkdir()
    shifted = [{**r, "loss": r["loss"] + 0.5} for r in records(resumed)]
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shifted))
    assert main(["plot", str(resumed), str(other), "--out", str(tmp_path / "two.png")]) == 0
    blue, orange = (31, 119, 180), (255, 127, 14)  # matplotlib's first two colours: one per run
    one, two = picture_colours(tmp_path / "one.png"), picture_colours(tmp_path / "two.png")
    assert blue in one and orange not in one
    assert blue in two and orange in two
    assert (tmp_path / "two.png").stat().st_size > 20_000


def test_pictures_redraw_their_own_file_and_no_other(tmp_path, capfd):
    """plot's default picture is redrawn on the next plot (torchpar drew it: its mark is in the
    metadata); a user's file of that name is refused and left byte for byte unless --overwrite.
    The same for schedule's hand-written SVG."""
    from torchpar.commands import main

    run = tmp_path / "run"
    run.mkdir()
    rows = (json.dumps({"step": s, "loss": 5.0 - s / 10, "lr": 1e-3}) + "\n" for s in range(1, 6))
    (run / "metrics.jsonl").write_text("".join(rows))
    picture = run / "metrics.png"
    picture.write_bytes(b"the user's picture")
    capfd.readouterr()
    assert main(["plot", str(run)]) == 2
    assert "metrics.png already exists" in capfd.readouterr().err
    assert picture.read_bytes() == b"the user's picture"
    assert main(["plot", str(run), "--overwrite"]) == 0
    first = picture.read_bytes()
    assert first.startswith(b"\x89PNG")
    assert main(["plot", str(run)]) == 0  # its own picture: redrawn
    assert picture.read_bytes().startswith(b"\x89PNG") and not list(run.glob("*.tmp"))
    svg = tmp_path / "s.svg"
    assert main(["schedule", "--pp", "2", "--microbatches", "4", "--out", str(svg)]) == 0
    assert main(["schedule", "--pp", "2", "--microbatches", "6", "--out", str(svg)]) == 0
    assert "6 microbatches" in svg.read_text()
    svg.write_text("<svg>mine</svg>")
    assert main(["schedule", "--pp", "2", "--microbatches", "4", "--out", str(svg)]) == 2
    assert svg.read_text() == "<svg>mine</svg>"


@pytest.mark.slow
def test_plot_warns_about_a_run_without_losses(resumed, tmp_path, capfd):
    """Beside a run with losses, one without them is drawn with a warning; alone it is refused
    (see the bad-inputs table)."""
    from torchpar.commands import main

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text('{"step": 1, "lr": 0.001}\n')
    capfd.readouterr()
    assert main(["plot", str(resumed), str(empty), "--out", str(tmp_path / "two.png")]) == 0
    assert "torchpar: warning: empty: no loss in its metrics.jsonl" in capfd.readouterr().err


def test_plan_draws_the_memory_of_its_layouts(tmp_path):
    from torchpar.commands import main

    out = tmp_path / "memory.png"
    assert main(["plan", "--model", "70B", "--gpu", "A100-80GB", "--top", "6", "--out", str(out)]) == 0
    assert out.stat().st_size > 20_000 and len(picture_colours(out)) > 20


@pytest.mark.slow
def test_logged_steps_carry_their_breakdown_and_the_traffic_the_planner_predicts():
    """dp2 ZeRO-2, tp2 and pp2 (rank 0: the first stage): the bytes rank 0 sent in steps 2 and 3,
    counted by the ledger, equal the planner's prediction logged at step 1; the time inside them is
    logged per mesh dimension."""
    from harness import run_layouts
    from test_plan import LEDGER_LAYOUTS

    names = ("dp2_zero2", "tp2", "pp2")
    counted = ["--training.steps", "3", "--metrics.log_communication", "true"]
    runs = run_layouts(2, {name: [*LEDGER_LAYOUTS[name], *counted] for name in names})
    for name in names:
        step1, *later = [r for r in runs[name]["logged"] if "loss" in r]
        assert "comm_bytes" not in step1 and [r["step"] for r in later] == [2, 3]
        for r in later:
            assert r["comm_bytes"] == pytest.approx(step1["predicted_comm_bytes"], rel=1e-9), name
            # Time inside the collectives of every dimension that sent bytes, within the step's.
            dims = {k[5:-6] for k in r if k.startswith("comm_") and k.endswith("_bytes")} - {""}
            assert dims and all(0 < r[f"comm_{d}_s"] for d in dims if r[f"comm_{d}_bytes"] > 0), r
            step = sum(r[f"time_{p}_s"] for p in ("forward_backward", "reduce_clip", "optimizer"))
            assert sum(r[f"comm_{d}_s"] for d in dims) < step, r
        for r in (step1, *later):
            phases = [r[f"time_{p}_s"] for p in ("data", "forward_backward", "reduce_clip", "optimizer")]
            assert all(t >= 0 for t in phases) and phases[1] > 0 and 0 <= r["data_share"] < 1


@pytest.mark.slow
def test_the_profiler_writes_a_trace_of_each_requested_iteration(tmp_path):
    out = tmp_path / "run"
    r = run([sys.executable, "-m", "torchpar", "train", "--config", str(TINY), "--training.steps", "4",
             "--job.dump_folder", str(out), "--profiling.enable_profiling", "true",
             "--profiling.profile_freq", "2", "--profiling.enable_memory_snapshot", "true"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "memory snapshots exist only for CUDA" in r.stderr  # and traces are written anyway
    for iteration in (2, 4):
        trace_file = out / "profiling" / "traces" / f"iteration_{iteration}" / "rank0_trace.json"
        trace = json.loads(trace_file.read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any(n.startswith("ProfilerStep#") for n in names) and "aten::mm" in names


def test_a_long_phase_says_it_is_still_going(capsys):
    """Start-up phases, saves and evaluations that run long print a line naming the phase (so a
    stall shows where it is), from a thread that ends with the phase."""
    import threading
    import time

    from torchpar.console import progress

    with progress("building the model", after_s=0.05, every_s=0.05):
        time.sleep(0.3)
    with progress("quiet on other ranks", shown=False, after_s=0.01):
        time.sleep(0.1)
    with progress("short", after_s=5):
        pass
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 3 and all(line.startswith("torchpar: building the model: still going after ")
                                   for line in lines), lines
    assert not [t for t in threading.enumerate() if t.name == "torchpar-progress"]


@pytest.mark.slow
def test_measured_pipeline_bubble_beside_the_predicted_one():
    """pp2 1F1B with 8 microbatches: every logged step carries the bubble measured from the timed
    compute actions (forward, backward, loss) of both ranks beside the cost model's 1/9, and the
    mean forward and backward times. Measured, the bubble is at least the model's and, on this
    2-core machine, about twice it: the model's sends are free, gloo's are not (see the README)."""
    from harness import run_layouts

    pp2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
           "--parallelism.zero_stage", "0", "--training.steps", "8"]
    (run,) = run_layouts(2, {"pp2_1F1B_m8": pp2}).values()
    steps = [r for r in run["logged"] if "loss" in r][1:]  # the first step builds the stages
    for r in steps:
        assert r["pp_bubble_predicted"] == pytest.approx(1 / 9)
        # 1F1B's bubble does not depend on the backward/forward ratio: the model with the measured
        # times agrees with the model.
        assert r["pp_bubble_measured_costs"] == pytest.approx(1 / 9)
        assert 1 / 9 - 0.03 < r["pp_bubble"] <= r["pp_bubble_max"], r
    # Timings of the median step: one step's stall on this 2-core machine (a page fault storm, a
    # descheduled rank) may stretch its forward several times over.
    assert 0 < statistics.median(r["pp_time_F_s"] for r in steps) < statistics.median(
        r["pp_time_B_s"] for r in steps)
    assert statistics.median(r["pp_bubble_max"] for r in steps) < 0.5, steps


class FakeGpu:
    """A device clock the test advances, events that complete at its time, and counts of the
    waits: the CUDA path of the step breakdown on a CPU."""

    def __init__(self):
        self.now, self.events, self.event_waits, self.device_waits = 0.0, 0, 0, 0

    def run(self, seconds: float) -> None:
        self.now += seconds

    def record(self):
        self.events += 1
        return FakeEvent(self)

    def synchronize(self) -> None:
        self.device_waits += 1


class FakeEvent:
    def __init__(self, gpu: FakeGpu):
        self.gpu, self.at = gpu, gpu.now

    def elapsed_time(self, end: "FakeEvent") -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as torch.cuda.Event's

    def synchronize(self) -> None:
        self.gpu.event_waits += 1


def test_on_a_gpu_the_breakdown_waits_once_at_the_end_of_a_timed_step():
    """Phases and pipeline actions are CUDA events (here fakes on a clock the test advances), read
    after the step: no device-wide synchronization and no wait at any border, one wait per timed
    step; untimed steps record nothing. Actions get wall-clock times counted back from the last
    event; on the CPU the timer is the host's clock."""
    from torchpar.breakdown import DeviceEvents, HostClock, StepBreakdown

    gpu = FakeGpu()
    breakdown = StepBreakdown(None, gpu.synchronize, timer=DeviceEvents(gpu.record, clock=lambda: 1000.0))
    with breakdown.step(timed=True, count_bytes=False):
        for _ in range(2):  # two accumulation microbatches: their phases add up
            with breakdown.phase("data"):
                gpu.run(0.5)
            with breakdown.phase("forward_backward"):
                with breakdown.action("F"):
                    gpu.run(1.0)
                with breakdown.action("B"):
                    gpu.run(2.0)
        gpu.run(0.25)  # between phases: in none
        with breakdown.phase("reduce_clip"):
            gpu.run(0.75)
        with breakdown.phase("optimizer"):
            gpu.run(1.0)
        assert (gpu.event_waits, gpu.device_waits, gpu.events) == (0, 0, 20)  # a start and an end per span
    assert (gpu.event_waits, gpu.device_waits, gpu.events) == (1, 0, 21)  # the last event, waited for
    record = breakdown.record()
    assert {k: record[k] for k in record if k.startswith("time_")} == pytest.approx(
        {"time_data_s": 1.0, "time_forward_backward_s": 6.0, "time_reduce_clip_s": 0.75,
         "time_optimizer_s": 1.0})
    assert record["data_share"] == pytest.approx(1.0 / 8.75)
    # The device's clock ends at 9.0 s, the host reads 1000.0 then: the first forward ran 0.5-1.5 s.
    assert breakdown.actions[0] == ("F", pytest.approx(991.5), pytest.approx(992.5))
    assert [kind for kind, *_ in breakdown.actions] == ["F", "B", "F", "B"]

    with breakdown.step(timed=False, count_bytes=False):
        with breakdown.phase("data"):
            gpu.run(1.0)
    assert (gpu.event_waits, gpu.device_waits, gpu.events) == (1, 0, 21) and breakdown.record() == {}
    assert isinstance(StepBreakdown(None, lambda: None).timer, HostClock)  # this machine: a CPU


def test_a_run_stopped_in_a_phase_names_it(capsys):
    """Ctrl-C or an unforeseen fault during a start-up phase names the innermost phase (on every
    rank, whether its progress lines are shown or not)."""
    from torchpar.console import progress, run_command

    def interrupted(argv):
        with progress("joining the process group of 8 rank(s)", shown=False):
            with progress("building, parallelizing and initializing the model", shown=False):
                raise KeyboardInterrupt

    assert run_command(interrupted, []) == 130
    assert ("torchpar: error: interrupted while building, parallelizing and initializing the model"
            in capsys.readouterr().err)

    def faulty(argv):
        with progress("loading the checkpoint x", shown=False):
            raise RuntimeError("a fault")

    with pytest.raises(RuntimeError) as raised:
        run_command(faulty, [])
    assert raised.value.__notes__ == ["torchpar: raised while loading the checkpoint x"]
