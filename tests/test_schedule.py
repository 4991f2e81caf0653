"""Pipeline schedules as tick tables: every slot is legal, the bubble is the textbook one, bad setups fail early."""

import pytest

from jaxpar.cli import main
from jaxpar.core.plan import Plan
from jaxpar.pipeline.schedule import EMPTY, Schedule
from jaxpar.pipeline.slot_places import ORDER
from jaxpar.pipeline.schedule_pictures import render, save_png

CASES = [("gpipe", 2, 2, 1), ("gpipe", 4, 16, 1), ("1f1b", 2, 2, 1), ("1f1b", 4, 4, 1), ("1f1b", 4, 16, 1),
         ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2), ("interleaved", 4, 16, 3),
         ("zb-h1", 2, 2, 1), ("zb-h1", 4, 4, 1), ("zb-h1", 4, 16, 1)]
EXPLICIT = [c for c in CASES if c[0] != "gpipe"]


def forward_ticks(s: Schedule) -> dict[tuple[int, int], int]:
    """(microbatch, ring position) -> tick of its forward slot; each must occur exactly once."""
    seen = {}
    for t in range(s.ticks):
        for stage in range(s.stages):
            j = int(s.forward[t, stage])
            if j != EMPTY:
                key = (j, int(s.chunk[t, stage]) * s.stages + stage)
                assert key not in seen, f"{key} scheduled twice"
                seen[key] = t
    return seen


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_forward_visits_every_position_in_order_one_hop_per_tick(name, p, m, v):
    s = Schedule(name, p, m, v)
    ticks = forward_ticks(s)
    assert len(ticks) == m * p * v
    for j in range(m):
        for position in range(1, p * v):
            assert ticks[(j, position)] == ticks[(j, position - 1)] + 1
    assert [ticks[(j, p * v - 1)] for j in range(m)] == list(s.output_ticks)


def slot_ticks(table, m, p) -> dict[tuple[int, int], int]:
    """(microbatch, stage) -> tick of its slot in an action table; each exactly once."""
    out = {}
    for t in range(table.shape[0]):
        for stage in range(p):
            if table[t, stage] != EMPTY:
                assert (int(table[t, stage]), stage) not in out
                out[int(table[t, stage]), stage] = t
    assert len(out) == m * p
    return out


def position_ticks(s: Schedule, kind: str) -> dict[tuple[int, int], int]:
    """(microbatch, ring position) -> tick of its `kind` slot; each exactly once."""
    out = {}
    for t in range(s.ticks):
        for stage in range(s.stages):
            j = int(s.actions[kind][t, stage])
            if j != EMPTY:
                key = (j, int(s.chunks[kind][t, stage]) * s.stages + stage)
                assert key not in out, f"{key} scheduled twice"
                out[key] = t
    assert len(out) == s.microbatches * s.stages * s.virtual_stages
    return out


@pytest.mark.parametrize("name,p,m,v", EXPLICIT)
def test_backward_follows_its_forward_and_the_next_position(name, p, m, v):
    s = Schedule(name, p, m, v)
    back, last = ("B" if "B" in s.actions else "BW"), p * v - 1
    fwd, bwd, release = (position_ticks(s, kind) for kind in ("F", back, "W" if "W" in s.actions else "BW"))
    for j in range(m):
        assert bwd[j, last] == fwd[j, last]  # the head's cotangent is ready in the same tick
        for position in range(last):
            assert bwd[j, position] == bwd[j, position + 1] + 1  # one hop back per tick, round the ring
        for position in range(p * v):
            assert release[j, position] >= bwd[j, position]  # W runs in B's tick (after it) or later
    starts = [start for start, _, _ in s.segments]
    assert starts == sorted(starts) and s.segments[-1][1] == s.ticks == v * m + v * p + p - 2
    for start, stop, kinds in s.segments:  # a segment's slot kinds are the ones with work in its ticks
        for kind, table in s.actions.items():
            assert (kind in kinds) == bool((table[start:stop] != EMPTY).any())


def positions(s: Schedule, kind: str) -> dict[tuple[int, int, int], int]:
    """(stage, microbatch, chunk) -> where its `kind` slot runs in the stage's program: tick, then place in ORDER."""
    out = {}
    for t, stage in zip(*(s.actions[kind] != EMPTY).nonzero()):
        key = (int(stage), int(s.actions[kind][t, stage]), int(s.chunks[kind][t, stage]))
        out[key] = int(t) * len(ORDER) + ORDER.index((kind, int(s.places[kind][t, stage])))
    return out


@pytest.mark.parametrize("name,p,m,v", EXPLICIT + [("zb-h1", 4, 5, 1), ("zb-h1", 3, 3, 1), ("interleaved", 2, 8, 3)])
def test_a_ring_row_is_never_overwritten_while_its_residuals_or_cotangent_are_needed(name, p, m, v):
    """Rows from the table, held from the slot that writes them to the last that reads them, both included, in
    program order (a row freed by a slot can be taken by a later slot of the same tick): no two held at once share
    one. zb-h1's kept cotangents share the ring's rows (beyond them: a buffer of their own), and the ring has as
    few rows as the most residual sets held at once."""
    s = Schedule(name, p, m, v)
    back = "B" if "B" in s.actions else "BW"
    first, reads = positions(s, "F"), [positions(s, kind) for kind in (back, "W") if kind in s.actions]
    held = {("res", *key): (first[key], max(r[key] for r in reads)) for key in first}
    if "W" in s.actions:
        made, used = positions(s, "B"), positions(s, "W")
        held |= {("cot", *key): (made[key], used[key]) for key in made if made[key] // len(ORDER) < used[key] // len(ORDER)}
    row = {}
    for kind, table in s.actions.items():
        for t, stage in zip(*(table != EMPTY).nonzero()):
            key = (int(stage), int(table[t, stage]), int(s.chunks[kind][t, stage]))
            row.setdefault(("res", *key), set()).add(int(s.rows[kind][t, stage]))
            if kind in s.cotangent_rows and ("cot", *key) in held:
                row.setdefault(("cot", *key), set()).add(int(s.cotangent_rows[kind][t, stage]))
    assert all(len(r) == 1 for r in row.values())  # every slot of a set names the same row
    row = {label: r.pop() for label, r in row.items()}
    assert all(row[label] < s.in_flight for label in held if label[0] == "res")
    most = 0
    for stage in range(p):
        mine = [label for label in held if label[1] == stage]
        for point in sorted({x for label in mine for x in held[label]}):
            live = [label for label in mine if held[label][0] <= point <= held[label][1]]
            assert len({row[label] for label in live}) == len(live), f"stage {stage} at {point}: rows shared"
            most = max(most, sum(1 for label in live if label[0] == "res"))
        for label in mine:  # a W in its B's tick takes the cotangent as the B does: no row
            if label[0] == "res" and "W" in s.actions and ("cot", *label[1:]) not in held:
                assert s.cotangent_rows["W"][used[label[1:]] // len(ORDER), stage] == EMPTY
    assert s.in_flight == most


def test_slots_run_in_an_order_their_data_allow():
    """Within a tick: the last chunk's forward before the loss head and its backward; every other forward after the
    slots that free rows of its stage in its tick, before the head where none does (zb-h1: every stage but 0, whose B
    reads its residuals last; its W's free them first); a W before the B and F slots that take rows, except on the
    last chunk in its B's tick (it needs the head's cotangent)."""
    for s in (Schedule("1f1b", 4, 8), Schedule("zb-h1", 4, 8), Schedule("interleaved", 4, 8, 2)):
        back = "B" if "B" in s.actions else "BW"
        f, b = positions(s, "F"), positions(s, back)
        reads = [positions(s, kind) for kind in (back, "W") if kind in s.actions]
        freed = {key: max(r[key] for r in reads) for key in f}
        early = ORDER.index(("F", 0))
        for key, at in f.items():
            tick = at // len(ORDER)
            same_tick = tick == b[key] // len(ORDER)
            frees_later = any(other[0] == key[0] and last // len(ORDER) == tick and last % len(ORDER) > early
                              for other, last in freed.items())
            assert (at % len(ORDER) < ORDER.index(("head", 0))) == (same_tick or not frees_later)
        if "W" in s.actions:
            assert (s.places["W"][s.actions["W"] != EMPTY] == 0).all()
            assert {int(stage) for stage in s.places["F"].nonzero()[1]} == {0}  # only stage 0 waits
    assert ORDER.index(("W", 0)) < ORDER.index(("F", 0)) < ORDER.index(("head", 0)) < ORDER.index(("B", 0)) \
        < ORDER.index(("F", 1))


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (4, 3)])
def test_interleaved_keeps_a_ring_flat_in_m_smaller_than_1f1b(p, v):
    """Chunk-sized residual sets: as many at m = 2p as at 8p, fewer stage-equivalents than 1F1B's 2p - 2 (as many
    at p = 2: two)."""
    rings = [Schedule("interleaved", p, m, v).in_flight for m in (2 * p, 4 * p, 8 * p)]
    assert len(set(rings)) == 1
    assert rings[0] / v < Schedule("1f1b", p, 2 * p).in_flight == 2 * p - 2 or rings[0] / v == p == 2
    assert Schedule("1f1b", p, 2 * p).live_microbatches == 2 * p - 2


@pytest.mark.parametrize("name,p,m,v", EXPLICIT)
def test_loops_cover_the_ticks_and_run_the_head_only_with_a_last_chunk(name, p, m, v):
    """Unfolded, the loops are the ticks in order with their slot kinds (a one-tick run folded into the next may idle
    some of them), and the head runs on exactly the ticks where the last stage's forward slot holds the last chunk;
    the scans they trace do not multiply with m."""
    s = Schedule(name, p, m, v)
    kinds_of = {t: kinds for start, stop, kinds in s.segments for t in range(start, stop)}
    t = 0
    for start, repeats, runs in s.loops:
        assert start == t
        for _ in range(repeats):
            for n, kinds, head in runs:
                for _ in range(n):
                    assert set(kinds_of[t]) <= set(kinds) and head == bool(s.head[t])
                    assert kinds_of[t] == kinds or n > 1 and t == start  # only a run's first tick idles a kind
                    t += 1
    assert t == s.ticks and s.head.sum() == m
    scans = lambda x: sum(len(runs) for _, _, runs in x.loops)  # noqa: E731
    assert scans(Schedule(name, p, 8 * p, v)) == scans(Schedule(name, p, 2 * p, v))


def test_1f1b_ring_holds_2p_minus_2_microbatches():
    """Stage 0 starts the forward of j + 2p - 2 in the tick of j's backward, after it, in the row it freed."""
    assert [Schedule("1f1b", 4, m).in_flight for m in (4, 8, 32)] == [4, 6, 6]
    assert [Schedule("zb-h1", 4, m).in_flight for m in (4, 8, 32)] == [4, 6, 6]
    assert Schedule("interleaved", 4, 8, 2).in_flight == 10


def test_1f1b_phases_are_warm_up_steady_and_cool_down():
    p, m = 4, 16
    s = Schedule("1f1b", p, m)
    assert [kinds for _, _, kinds in s.segments] == [("F",), ("F", "BW"), ("BW",)]
    warm, steady, cool = s.phases
    assert (warm, steady, cool) == (p - 1, m, p - 1)
    assert (s.forward[warm:warm + steady, p - 1] != EMPTY).all()


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8), (4, 32)])
def test_zb_h1_fills_1f1b_cool_down_with_deferred_weight_gradients(p, m):
    """B on 1F1B's backward ticks, W of j on every stage at 2p-2+j: W slots on m ticks, not m+p-1."""
    zb, ref = Schedule("zb-h1", p, m), Schedule("1f1b", p, m)
    assert (zb.forward == ref.forward).all() and (zb.backward == ref.backward).all()
    bwd, weight = slot_ticks(zb.actions["B"], m, p), slot_ticks(zb.actions["W"], m, p)
    assert all(weight[j, i] - bwd[j, i] == i for j in range(m) for i in range(p))  # stage i defers W by i
    assert sum(1 for t in range(zb.ticks) if (zb.actions["W"][t] != EMPTY).any()) == m
    assert zb.in_flight == ref.in_flight  # as many ring rows as 1F1B, kept cotangents included
    assert zb.cotangents_in_flight == p - 1  # the last stage's; stage 0's W takes its cotangent as its B does
    # Stage i keeps i cotangents where it keeps i residual sets fewer than stage 0: in the ring's rows, from
    # m = 2p - 2 on (fewer microbatches leave rows free for fewer cotangents: the rest get a buffer of their own).
    assert zb.ring_layout().cotangent_buffer_rows == max(0, 2 * p - 2 - m)
    assert zb.ring_layout(shared=False).cotangent_buffer_rows == p - 1
    assert zb.bubble == pytest.approx(2 * (p - 1) / (3 * m + 2 * (p - 1)), abs=1e-12)
    assert zb.bubble < ref.bubble


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_bubble_is_the_textbook_fraction(name, p, m, v):
    s = Schedule(name, p, m, v)
    if name != "zb-h1":
        assert s.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert s.bubble == pytest.approx(s.bubble_formula, abs=1e-12)


def test_interleaving_shrinks_the_bubble():
    bubbles = [Schedule("interleaved", 4, 8, 4).bubble, Schedule("interleaved", 4, 8, 2).bubble,
               Schedule("1f1b", 4, 8).bubble]
    assert bubbles == sorted(bubbles) and len(set(bubbles)) == 3


@pytest.mark.parametrize("options,message", [
    (dict(schedule="zigzag"), "schedule must be one of"),
    (dict(microbatches=2), "needs at least 4 microbatches"),
    (dict(schedule="interleaved"), "needs virtual_stages >= 2"),
    (dict(schedule="interleaved", virtual_stages=2, microbatches=6), "microbatches=6 does not divide by 4"),
    (dict(virtual_stages=2), "needs schedule 'interleaved'"),
    (dict(microbatches=-1), "microbatches must be >= 1"),
])
def test_bad_pipeline_options_fail_when_the_plan_is_made(options, message):
    with pytest.raises(ValueError, match=message):
        Plan.create("pipe=4,data=2", **options)


def test_pipeline_options_without_a_pipeline_fail():
    with pytest.raises(ValueError, match="microbatches=4 splits the batch for a pipeline, but mesh axis pipe=1"):
        Plan.create("data=8", microbatches=4)


def test_microbatches_default_to_one_per_stage_and_count_in_the_batch_check():
    plan = Plan.create("pipe=4,data=2")
    assert plan.pipeline_microbatches == 4 and Plan.create("data=8").pipeline_microbatches == 1
    plan.check_batch(8)
    with pytest.raises(ValueError, match="microbatches=4"):
        plan.check_batch(12)


def test_render_draws_every_stage_and_the_bubble():
    s = Schedule("1f1b", 4, 8)
    text = render(s).plain
    rows = [line for line in text.splitlines() if line.startswith("stage ")]
    assert len(rows) == 4
    cells = [row.split()[2:] for row in rows]
    assert all(len(c) == len(s.timeline()) for c in cells)
    assert sum(c.count("·") for c in cells) == round(s.bubble * 4 * len(s.timeline()))
    assert "bubble 27.3%" in text


def test_zb_h1_render_shows_three_slot_kinds():
    s = Schedule("zb-h1", 4, 8)
    rows = [line for line in render(s).plain.splitlines() if line.startswith("stage ")]
    cells = [row.split()[2:] for row in rows]
    assert all(len(c) == len(s.timeline()) == 3 * 8 + 2 * 3 for c in cells)
    assert sum(c.count("·") for c in cells) == round(s.bubble * 4 * len(s.timeline()))


def test_png_is_written(tmp_path):
    path = tmp_path / "schedule.png"
    save_png(Schedule("interleaved", 4, 8, 2), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_jaxpar_inspect_draws_a_schedule(tmp_path, capsys):
    path = tmp_path / "timeline.png"
    assert main(["inspect", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--png", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1f1b: p=4, m=8; bubble 27.3%" in out and out.count("stage ") >= 4
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert main(["inspect", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8", "--png", str(path)]) == 0
    out = capsys.readouterr().out
    assert "zb-h1: p=4, m=8; bubble 20.0%" in out and "weight-backward" in out
    assert path.read_bytes()[:4] == b"\x89PNG"
    flags = ["--schedule", "interleaved", "--stages", "4", "--microbatches", "6", "--virtual-stages", "2"]
    assert main(["inspect", *flags]) == 2
    assert "microbatches=6 does not divide by 4" in capsys.readouterr().err.replace("\n", " ")
