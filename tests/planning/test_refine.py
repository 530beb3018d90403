"""The opt-in search on a compute-balanced plan (trainer_lib/planning/refine.py): it keeps every
rule of the partition, never lengthens the predicted step, finds the changes a hand-made plan
needs, gives the same plans compiled and as plain Python, and shortens the step on the bench mix."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import REPO
from trainer_lib.planning import annealing, refine
from trainer_lib.planning.bins import NEUTRAL, PIXELS, STRAY
from trainer_lib.planning.items import EITHER, TEXT, VISION, MiniBatchItems, places
from trainer_lib.planning.partition import partition_mini_batch
from trainer_lib.planning.plan import plan_step
from trainer_lib.planning.ranks import StepShape
from trainer_lib.planning.refine import Refinement, refine_slots


def step_cost(slots, language, vision, groups) -> float:
    """Sum over slots of the slowest bin's vision cost (each image set once) plus the slowest
    bin's language cost: what the search lowers."""
    cost = {g: v for g, v in zip(groups, vision, strict=True) if g is not None}
    return sum(
        max(sum(cost[g] for g in {groups[i] for i in b} - {None}) for _, b in slot)
        + max(sum(language[i] for i in b) for _, b in slot)
        for slot in slots
    )


def test_a_sample_moves_to_level_its_slot():
    """Slot 0 holds 8+4 | 4, slot 1 holds 6 | 6 (text; language = tokens): moving the 4 beside the
    other 4 gives 8 | 8 and the step 14, its optimum (the 8 and the 6s cannot shrink)."""
    lengths = [8, 4, 4, 6, 6]
    slots = [[(12, [0, 1]), (4, [2])], [(6, [3]), (6, [4])]]
    groups = [None] * 5
    items = MiniBatchItems(lengths, dp=2, cap=100, groups=groups)  # no pixels: every place EITHER
    assert items.place == [EITHER] * 5
    out = refine_slots(slots, items, Refinement())
    assert step_cost(out, lengths, [0.0] * 5, groups) == 14
    assert sorted(sorted(b) for _, b in out[0]) == [[0], [1, 2]] and out[1] == slots[1]
    assert [t for slot in out for t, _ in slot] == [
        sum(lengths[i] for i in b) for slot in out for _, b in slot
    ]


def test_a_swap_keeps_each_image_set_in_one_bin():
    """Two image sets, each split over both bins of one slot: both bins encode both sets (20 each).
    One swap puts each set's samples together: each bin encodes one set, the tower's slowest bin
    halves and the language is unchanged."""
    lengths, language = [5, 5, 5, 5], [5.0] * 4
    groups, vision = ["g1", "g2", "g1", "g2"], [10.0] * 4
    slots = [[(10, [0, 1]), (10, [2, 3])]]
    items = MiniBatchItems(
        lengths, dp=2, cap=100, kinds=[PIXELS] * 4, groups=groups, language=language, vision=vision
    )
    assert items.place == [VISION] * 4
    out = refine_slots(slots, items, Refinement())
    assert step_cost(slots, language, vision, groups) == 30
    assert step_cost(out, language, vision, groups) == 20
    assert sorted(len({groups[i] for i in b}) for _, b in out[0]) == [1, 1]


@pytest.mark.parametrize("image_set", ["g", None])
def test_the_rules_hold_where_a_gain_would_break_them(image_set):
    """The gains the search must refuse: a text sample near the cap would level slot 0 but must not
    join the vision slot, an image sample must not join the text slot, and no bin may pass the cap
    (nor, in a vision slot without an image of its own, ``cap - reserve``). The slot that runs the
    tower is the one holding the image sample, whether or not the caller gave it an image set."""
    cap, reserve = 20, 3
    lengths = [18, 2, 10, 2, 9]
    kinds = [NEUTRAL, NEUTRAL, PIXELS, NEUTRAL, STRAY]
    groups = [None, None, image_set, None, None]
    items = MiniBatchItems(
        lengths, dp=2, cap=cap, kinds=kinds, groups=groups, language=[float(n) for n in lengths],
        vision=[0.0, 0.0, 7.0, 0.0, 0.0], reserve=reserve,
    )  # fmt: skip
    place = items.place
    assert place == places(lengths, kinds, cap, reserve)
    slots = [[(20, [0, 1]), (9, [4])], [(10, [2]), (2, [3])]]  # slot 1 runs the tower
    out = refine_slots(slots, items, Refinement(anneal_steps=2000))
    for k, slot in enumerate(out):
        images = any(kinds[i] == PIXELS for _, b in slot for i in b)
        for tokens, b in slot:
            assert tokens == sum(lengths[i] for i in b) <= cap
            if k == 1:
                assert all(place[i] != TEXT for i in b)  # nothing that must not meet the tower
                assert any(kinds[i] == PIXELS for i in b) or tokens + reserve <= cap
            else:
                assert not images
    assert sorted(i for slot in out for _, b in slot for i in b) == list(range(5))


def bench_inputs(bench_mix, seed: int) -> list[tuple]:
    import numpy as np

    pack, cm = bench_mix
    samples = pack.make_step(np.random.default_rng(seed))
    return pack.mini_batch_inputs(samples, 8, 256, cm)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000), cap=st.sampled_from([4096, 8192, 16384]), anneal=st.sampled_from([0, 5000])
)
def test_the_search_never_lengthens_the_step_and_keeps_the_slots(bench_mix, seed, cap, anneal):
    """On the bench mix (dp 8, 256 samples): the refined partition runs the same slots, keeps every
    sample once, and its predicted step is at most the plan's without the search; annealing
    starts from the descent's plan, so it ends at most there."""
    lengths, keys, kinds, vision, extra = bench_inputs(bench_mix, seed)[0]
    kwargs = dict(dp=8, cap=cap, keys=keys, kinds=kinds, vision=vision, reserve=6, **extra)
    plain = partition_mini_batch(MiniBatchItems(lengths, **kwargs))
    descent = partition_mini_batch(MiniBatchItems(lengths, **kwargs), Refinement(anneal_steps=0))
    refined = partition_mini_batch(MiniBatchItems(lengths, **kwargs), Refinement(anneal_steps=anneal))

    def cost(part) -> float:
        slots = [[(0, part.ranks[r][k]) for r in range(8)] for k in range(part.num_micro_batches)]
        return step_cost(slots, extra["language"], vision, extra["groups"])

    assert refined.num_micro_batches == plain.num_micro_batches
    assert sorted(i for row in refined.ranks for b in row for i in b) == list(range(len(lengths)))
    assert cost(refined) <= cost(descent) * (1 + 1e-9) <= cost(plain) * (1 + 1e-9)


def test_the_same_seed_gives_the_same_plan(bench_mix):
    lengths, keys, kinds, vision, extra = bench_inputs(bench_mix, 3)[1]
    kwargs = dict(dp=8, cap=16384, keys=keys, kinds=kinds, vision=vision, reserve=6, **extra)
    runs = [
        partition_mini_batch(MiniBatchItems(lengths, **kwargs), Refinement(anneal_steps=20_000))
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_the_python_kernels_give_the_compiled_plans(bench_mix, tmp_path):
    """Without numba the kernels run as Python (``NUMBA_DISABLE_JIT=1`` runs them so): the same
    plans, descent and annealing, as compiled."""
    inputs = bench_inputs(bench_mix, 7)[2]
    (tmp_path / "inputs.json").write_text(json.dumps(inputs))
    script = (
        "import json, sys\n"
        "from trainer_lib.planning.items import MiniBatchItems\n"
        "from trainer_lib.planning.partition import partition_mini_batch\n"
        "from trainer_lib.planning.refine import Refinement\n"
        "lengths, keys, kinds, vision, extra = json.load(open(sys.argv[1]))\n"
        "items = MiniBatchItems(lengths, dp=8, cap=16384, keys=[tuple(k) for k in keys],\n"
        "    kinds=kinds, vision=vision, reserve=6, language=extra['language'],\n"
        "    groups=[g if g is None else tuple(g) for g in extra['groups']])\n"
        "part = partition_mini_batch(items, Refinement(anneal_steps=3000))\n"
        "print(json.dumps(part.ranks))\n"
    )
    plans = []
    for jit in ("0", "1"):
        env = {**os.environ, "NUMBA_DISABLE_JIT": jit, "PYTHONPATH": str(REPO)}
        run = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / "inputs.json")],
            env=env, capture_output=True, text=True, timeout=300, cwd=REPO,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        plans.append(json.loads(run.stdout))
    assert plans[0] == plans[1]


def test_the_search_shortens_the_step_on_the_bench_mix(bench_mix):
    """plan_step with ``refine`` on a bench step (dp 8, mini-batch 256, cap 8k, where the plan
    leaves most idle): the same micro-batches per rank, a lower FLOP idle and a shorter step."""
    import numpy as np

    pack, cm = bench_mix
    samples = pack.make_step(np.random.default_rng(2))
    shape = StepShape(dp_size=8, mini_batch_size=256, seq_len=16384, micro_batch_max_tokens=8192)
    plain = plan_step(samples, pack.SPEC, shape, cost_model=cm, refine=None)
    refined = plan_step(samples, pack.SPEC, shape, cost_model=cm, refine=Refinement())
    assert [r[0].num_micro_batches for r in refined.mini_batches] == [
        r[0].num_micro_batches for r in plain.mini_batches
    ]
    assert refined.sync_idle(cm) < plain.sync_idle(cm) - 0.01
    assert pack.step_flops(refined, cm) < 0.99 * pack.step_flops(plain, cm)


def test_costless_samples_leave_nothing_to_search():
    """Where every sample costs nothing, every plan costs the same: the search, annealing too,
    returns the plan as it was (before, the annealing's temperature divided by zero)."""
    slots = [[(3, [0]), (2, [1])], [(4, [2]), (1, [3])]]
    items = MiniBatchItems([3, 2, 4, 1], dp=2, cap=10, groups=[None] * 4, language=[0.0] * 4)
    out = refine_slots(slots, items, Refinement(anneal_steps=100))
    assert out == slots


def test_the_annealing_draws_from_splitmix64():
    """The kernel's generator gives SplitMix64's reference outputs for seed 1234567 (Rosetta Code,
    "Pseudo-random numbers/Splitmix64"; Steele, Lea & Flood 2014), compiled and as Python. The
    compiled loop keeps its state ``uint64`` as the annealing does (numba returns a ``uint64``
    in a tuple to Python as a signed int, so the state must not round-trip through Python)."""
    expected = [
        6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
        16408922859458223821,
    ]  # fmt: skip
    numba = pytest.importorskip("numba")
    splitmix = annealing._splitmix

    @numba.njit
    def draws(state, k):
        out = np.empty(k, np.uint64)
        for p in range(k):
            state, bits = splitmix(state)
            out[p] = bits
        return out

    assert [int(x) for x in draws(np.uint64(1234567), 5)] == expected
    state, out = np.uint64(1234567), []
    with np.errstate(over="ignore"):
        for _ in range(5):
            state, bits = splitmix.py_func(state)
            out.append(int(bits))
    assert out == expected


def _bench_items(bench_mix, seed: int, j: int) -> MiniBatchItems:
    """Mini-batch ``j`` of a bench step (dp 8, 256 samples, cap 16k), costs in the card's time."""
    assert bench_inputs(bench_mix, seed)[j][4]["unit_seconds"] == bench_mix[1].seconds_per_unit
    lengths, keys, kinds, vision, extra = bench_inputs(bench_mix, seed)[j]
    return MiniBatchItems(
        lengths, dp=8, cap=16384, keys=keys, kinds=kinds, vision=vision, reserve=6, **extra
    )  # fmt: skip


def _step(items: MiniBatchItems, part) -> float:
    slots = [[(0, part.ranks[r][k]) for r in range(items.dp)] for k in range(part.num_micro_batches)]
    return step_cost(slots, items.language, items.vision, items.groups)


def test_the_default_budget_is_two_percent_of_the_step_within_its_floor_and_cap():
    assert refine.default_budget_s(None) == refine.BUDGET_FLOOR_S == 0.002  # no time on a card
    assert refine.default_budget_s(1.0) == pytest.approx(0.02)
    assert refine.default_budget_s(0.01) == refine.BUDGET_FLOOR_S
    assert refine.default_budget_s(100.0) == refine.BUDGET_CAP_S == 0.045
    assert Refinement(plan_time_budget_s=0.3).budget_s(1.0) == 0.3  # given: as given


def test_the_budget_buys_iterations_at_the_measured_rates(bench_mix):
    """A budget is a count at the constant rates, never a clock: 5 descent changes' worth of
    budget is ``changes=5``, 3000 annealing steps' worth is ``anneal_steps=3000``."""
    items = _bench_items(bench_mix, 4, 0)
    by_time = Refinement(anneal_steps=0, plan_time_budget_s=5.5 / refine.DESCENT_CHANGES_PER_S)
    by_count = Refinement(changes=5, anneal_steps=0, plan_time_budget_s=math.inf)
    assert partition_mini_batch(items, by_time) == partition_mini_batch(items, by_count)
    by_time = Refinement(changes=0, plan_time_budget_s=3000.5 / refine.ANNEAL_STEPS_PER_S)
    by_count = Refinement(changes=0, anneal_steps=3000, plan_time_budget_s=math.inf)
    assert partition_mini_batch(items, by_time) == partition_mini_batch(items, by_count)
    assert partition_mini_batch(items, by_count) != partition_mini_batch(items)  # it did search


def test_budget_zero_gives_the_plan_as_constructed(bench_mix):
    for j in range(4):
        items = _bench_items(bench_mix, 5, j)
        plain = partition_mini_batch(items)
        assert partition_mini_batch(items, Refinement(plan_time_budget_s=0.0)) == plain
        assert partition_mini_batch(items, Refinement(changes=0, anneal_steps=0)) == plain


@pytest.mark.parametrize("budget", [1e-5, 1e-4, 1e-3, None])
def test_a_budget_never_leaves_the_step_longer_than_no_search(bench_mix, budget):
    """Any budget, however small, ends at most where the constructed plan is (the descent only
    lowers the step, the annealing returns the best plan it saw); the default budget (None:
    2% of a ~2.5 s step on the card, capped at 45 ms) shortens it."""
    for j in range(4):
        items = _bench_items(bench_mix, 6, j)
        plain = partition_mini_batch(items)
        refined = partition_mini_batch(items, Refinement(plan_time_budget_s=budget))
        assert refined.num_micro_batches == plain.num_micro_batches
        assert _step(items, refined) <= _step(items, plain) * (1 + 1e-12)
        if budget is None:
            assert _step(items, refined) < _step(items, plain) * (1 - 1e-4)


def test_the_same_seed_gives_the_same_plan_within_the_default_budget(bench_mix):
    items = _bench_items(bench_mix, 3, 1)
    runs = [partition_mini_batch(items, Refinement(seed=11)) for _ in range(2)]
    assert runs[0] == runs[1]


def test_bad_refinements_are_refused():
    with pytest.raises(ValueError, match="plan_time_budget_s"):
        Refinement(plan_time_budget_s=-0.1)
    with pytest.raises(ValueError, match="plan_time_budget_s"):
        Refinement(plan_time_budget_s=math.nan)
    with pytest.raises(ValueError, match="anneal_steps"):
        Refinement(plan_time_budget_s=math.inf)  # no bound on the annealing
    with pytest.raises(ValueError, match="unit_seconds"):
        MiniBatchItems([1], dp=1, cap=10, unit_seconds=0.0)
    with pytest.raises(ValueError, match="changes and anneal_steps"):
        Refinement(changes=-1)
    with pytest.raises(ValueError, match="changes and anneal_steps"):
        Refinement(anneal_steps=-5)
    with pytest.raises(ValueError, match="seed"):
        Refinement(seed=-1)
