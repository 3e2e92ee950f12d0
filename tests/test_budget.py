"""Training for a time budget (nmt/budget.py, train.py --time_budget): the plan's arithmetic, and
whole runs of a tiny model on a fake clock (each step, validation and test scoring costs a set
number of its seconds): the schedule completes, the test scores land inside the budget, a
resume keeps what is left, the model card records the budget and the steps it bought."""

import json
import signal

import pytest
from conftest import TINY, make_corpus, number_pairs, run_here, write_aligned

import nmt.budget
import train
from nmt.budget import MARGIN, Budget
from nmt.checkpoint import load_checkpoint


def test_the_plan_spends_what_is_left_on_steps_and_their_validations(monkeypatch):
    """10 steps took 100 s with one validation of 10 s: 9 s a step; the end keeps one
    validation, the test sets' greedy and beam decoding (as many sentences as a validation's,
    beam at BEAM_COST times greedy) and MARGIN of the budget: 600 - 100 - 62 = 438 s left.
    44 steps more take 396 s and the validations at the ends of epochs 2 to 5 (steps 20 to
    50) 40 s: 436 s; a 45th would make 445."""
    now = [100.0]
    monkeypatch.setattr(nmt.budget, "clock", lambda: now[0])
    budget = Budget(600, 0, 0, steps_per_epoch=10, eval_every=0, test_share=1.0, steps=999,
                    training_started=0, validation_seconds=10, steps_done=10,
                    last=(10.0, 10.0))  # (all of it decoding)
    assert budget.reserve() == pytest.approx(10 + 10 * (1 + nmt.budget.BEAM_COST) + 600 * MARGIN)
    assert budget.plan(10) == 10 + 44
    budget.eval_every = 5  # and every 5 steps: 40 steps (360 s) and 7 validations (70 s), the
    assert budget.plan(10) == 50  # one at step 50 the reserve's; 41 would add one: 449 s
    budget.max_steps = 30
    assert budget.plan(10) == 30  # --max_steps caps the plan
    budget.max_steps, budget.spent_before = 0, 400  # a resume: 400 s spent before this start
    assert budget.plan(10) == 14  # 38 s left: 4 steps (36 s); a 5th brings a validation
    now[0] = 700.0  # past the budget: no step more
    assert budget.plan(10) == 10 and budget.done(10) is False  # (the ranks agree first)
    budget.agreed = budget.steps
    assert budget.done(10)


def test_the_last_validation_says_the_steps_trained_not_a_new_plan(monkeypatch):
    """After the schedule's last step, the final validation's line named a plan made again from
    the speed measured (332 steps where 330 were trained): it says the agreed steps are trained.
    Spent minutes under one read in two significant digits, not 0.0."""
    now = [100.0]
    monkeypatch.setattr(nmt.budget, "clock", lambda: now[0])
    budget = Budget(600, 0, 0, steps_per_epoch=10, eval_every=0, test_share=1.0, steps=30,
                    training_started=0, validation_seconds=10, steps_done=10)
    assert "laid out for 59 steps" in budget.validated(10, 10)  # before the end: planned again
    budget.agreed, budget.steps = 30, 31  # the ranks agreed on 30; a later plan proposed 31
    now[0] = 300.0
    assert budget.validated(10, 30) == ("--time_budget 10 minutes: 5.0 spent; the schedule's "
                                        "30 steps (3.0 epochs) are trained")
    assert budget.steps == 31  # (not planned again)
    assert [nmt.budget.minutes(s) for s in (0.3, 30, 59, 60, 3600)] == \
        ["0.005", "0.5", "0.98", "1.0", "60.0"]


def test_spent_minutes_read_alike_in_every_line(monkeypatch, tmp_path):
    """The plan's line, the start's and a complete schedule's stop name the spent minutes as
    the last validation's does: two significant digits under a minute (not 0.0), "1.0" (not
    "1") where two digits would round up to a minute."""
    from types import SimpleNamespace

    from config import Config
    from nmt.stopping import Stop, stop_message
    now = [120.0]
    monkeypatch.setattr(nmt.budget, "clock", lambda: now[0])
    budget = Budget(600, 0, 100, steps_per_epoch=10, eval_every=0, test_share=1.0, steps=30)
    assert budget.start() == ("--time_budget 10 minutes: 0.33 spent; the schedule laid out for "
                              "30 steps (3.0 epochs) until measured")
    assert budget.words() == ("--time_budget 10 minutes: 0.33 spent; the schedule laid out for "
                              "30 steps (3.0 epochs) by the speed measured")  # (a validation's)
    run = SimpleNamespace(budget=budget, config=Config(model_folder=str(tmp_path)),
                          world_size=1, batches_per_epoch=10)
    progress = SimpleNamespace(step=30, epoch=2, batch=10, signal=None)
    assert stop_message(run, progress, Stop.MAX_STEPS).startswith(
        "the --time_budget's schedule is complete (0.33 of 10 minutes spent) in epoch 2")
    assert [nmt.budget.minutes(s) for s in (59.6, 59.8, 59.99)] == ["0.99", "1.0", "1.0"]


def test_the_plan_waits_for_a_timed_step_then_fits_exactly_and_rank_0_proposes_it(monkeypatch):
    """A validation before this start's first step (--init_from's, or one a stop cut short)
    leaves the plan as it was (no step timed yet); 10 steps of 9 s, counted one by one, are
    planned again at the log step: 1200 - 100 - 74 (the reserve) = 1026 s left, which 114 steps
    fill exactly (a plan fits when its time equals what is left). Rank 0 alone proposes it."""
    now = [0.0]
    monkeypatch.setattr(nmt.budget, "clock", lambda: now[0])
    budget = Budget(1200, 0, 0, steps_per_epoch=1000, eval_every=0, test_share=1.0, steps=30)
    budget.start()
    now[0] = 10.0
    assert "laid out for 30 steps" in budget.validated(10, 0)
    for step in range(1, 11):
        now[0] += 9
        budget.stepped(step, replan=step == 10)
        assert budget.steps == (30 if step < 10 else 10 + 114)
    assert budget.steps_done == 10 and budget.per_step() == 9
    assert budget.proposal(0) == [124, 0] and budget.proposal(1) == [0, 0]
    assert budget.agree([124, 0], 10) is False and budget.done(124)


def test_a_validation_is_asked_for_at_half_the_budget_when_none_is_timed(monkeypatch):
    """Rank 0 asks the ranks to validate after the step once half the budget is spent and no
    validation is timed, by this start or an earlier one: until then the end's reserve is
    unknown. The others add 0s; the ranks take rank 0's word."""
    now = [599.0]
    monkeypatch.setattr(nmt.budget, "clock", lambda: now[0])
    budget = Budget(1200, 0, 0, steps_per_epoch=1000, eval_every=0, test_share=1.0, steps=30)
    assert budget.proposal(0) == [30, 0]
    now[0] = 600.0
    assert budget.proposal(0) == [30, 1] and budget.proposal(1) == [0, 0]
    budget.agree([30, 1], 5)
    assert budget.timing and ("; half the budget was spent before a validation was timed: this "
                              "one times the end's") in budget.validated(10, 5)
    assert budget.proposal(0) == [30, 0]  # timed
    budget.agree([30, 0], 6)
    assert not budget.timing
    resumed = Budget(1200, 700, 100, steps_per_epoch=1000, eval_every=0, test_share=1.0,
                     steps=30, earlier=10.0, last=(10.0, 5.0))
    assert resumed.proposal(0) == [30, 0]  # an earlier start's validation was timed
    resumed.last, resumed.started = None, 500.0  # none timed: its 700 s count, with
    assert resumed.proposal(0) == [30, 1]  # this start's 100 (not this start's alone)


def test_the_plan_is_fitted_in_a_few_costings_where_eval_every_meets_the_epochs_ends(
        monkeypatch):
    """An hour of 30 ms steps, an epoch of 1,000 steps, --eval_every 1000 (each at an epoch's
    end: the validations of no --eval_every): the same plan, fitted in a few dozen costings of
    the validations on the way (a walk a step at a time from an average that counted each
    twice took 30 s a plan, made again at every log step)."""
    now = [100.0]
    monkeypatch.setattr(nmt.budget, "clock", lambda: now[0])
    counted = []
    between = Budget.validations_between
    monkeypatch.setattr(Budget, "validations_between",
                        lambda self, a, b: counted.append(1) or between(self, a, b))
    plans = []
    for every in (0, 1000):
        budget = Budget(3600, 0, 0, steps_per_epoch=1000, eval_every=every, test_share=1.0,
                        steps=9, training_started=0, validation_seconds=10,
                        steps_done=3000, last=(10.0, 10.0))
        counted.clear()
        plans.append(budget.plan(3000))
        assert len(counted) < 100
    assert plans[0] == plans[1] == 87_600  # 3,378 s left: 84,600 steps of 30 ms, 84 validations


def test_the_end_keeps_the_validations_decoding_by_the_test_sentences_its_other_costs_once(
        monkeypatch):
    """The latest validation (10 s, 4 of them decoding) stands for the next: the end keeps one
    (10 s), the test sets' 15 times as many sentences decoded greedy and with the beam (4 s ·
    15 · (1 + BEAM_COST)) and the validation's other 6 s once (loading, scoring), not 15 times
    (a whole validation's 10 s · 15 · 4 kept 610 s for 2 s of test scoring). The first
    validation of a process (imports) or of an untrained model (long outputs) counts only
    until the next."""
    monkeypatch.setattr(nmt.budget, "clock", lambda: 0.0)
    budget = Budget(600, 0, 0, steps_per_epoch=10, eval_every=0, test_share=15.0, steps=30)
    assert budget.reserve() == 600 * MARGIN and budget.per_validation() == 0  # none timed
    budget.validated(30.0, 1, decoding=20.0)
    budget.validated(10.0, 2, decoding=4.0)
    assert budget.per_validation() == 10.0
    assert budget.reserve() == pytest.approx(10 + 6 + 4 * 15 * (1 + nmt.budget.BEAM_COST)
                                             + 600 * MARGIN)


def test_a_validation_where_the_plan_ends_says_the_steps_are_trained(monkeypatch):
    """The plan made again at a validation ends at its step (the ranks take it at the next
    step's exchange): the words say the steps are trained, not a plan laid out for them; a
    validation before any step of this start is timed (--init_from's) has no speed measured."""
    now = [100.0]
    monkeypatch.setattr(nmt.budget, "clock", lambda: now[0])
    budget = Budget(600, 0, 0, steps_per_epoch=10, eval_every=0, test_share=1.0, steps=30)
    assert budget.validated(6.0, 0).endswith("30 steps (3.0 epochs) until measured")
    budget.start()  # (at 100 s: 10 steps in the next 450 s, and 6 s of validation before)
    budget.steps_done, now[0] = 10, 550.0
    assert budget.validated(6.0, 10) == ("--time_budget 10 minutes: 9.2 spent; the schedule's "
                                         "10 steps (1.0 epochs) are trained")
    assert budget.steps == 10 and budget.agreed == 30  # (agreed at the next exchange)


def test_a_plan_whose_steps_fill_what_is_left_exactly_takes_them_all():
    """10 s a step, no validation timed: 40 s left buy 4 steps (40 s, a power of 2 that the
    search doubles to), 30 s buy 3, 39.9 s 3."""
    budget = Budget(600, 0, 0, steps_per_epoch=1000, eval_every=0, test_share=1.0, steps=0)
    assert [budget.fit(0, left, 10.0) for left in (40.0, 30.0, 39.9)] == [4, 3, 3]


def test_a_step_timed_at_no_time_still_plans_a_run_of_some_length():
    """A step measured at 0 s, or less (time.time() set back while it ran), no validation
    timed: the plan counts each step at least a nanosecond, so its search ends, here at
    --max_steps (it doubled a count of free steps until no float could hold it)."""
    budget = Budget(600, 0, 0, steps_per_epoch=1000, eval_every=0, test_share=1.0, steps=0,
                    max_steps=500)
    assert budget.fit(10, 40.0, 0.0) == 500 and budget.fit(10, 40.0, -1.0) == 500


def test_validations_on_the_way_count_epoch_ends_and_eval_every_once_the_last_left_out():
    """Validations after step `start` up to `end`, the one at `end` the reserve's: epoch ends
    (10 steps an epoch) and --eval_every steps within an epoch, each once."""
    budget = Budget(600, 0, 0, steps_per_epoch=10, eval_every=0, test_share=1.0, steps=99)
    assert budget.validations_between(9, 20) == 1  # step 10 (step 20: the reserve's)
    assert budget.validations_between(10, 25) == 1  # step 20
    assert budget.validations_between(10, 30) == 1  # step 20 (step 30: the reserve's)
    budget.eval_every = 4
    assert budget.validations_between(0, 12) == 3  # steps 4, 8, 10 (step 12: the reserve's)
    assert budget.validations_between(0, 21) == 6  # steps 4, 8, 10, 14, 18, 20


def test_a_raised_budget_is_first_planned_at_the_earlier_starts_speed(monkeypatch):
    """A resume past the saved schedule's end (the budget raised): 300 s for 100 steps before,
    4 validations of 15 s among them (2.4 s a step), 20 s of set-up: 1200 - 320 - the end's
    reserve (15 s + the test sets' 60 s + MARGIN's 24) = 781 s, 325 steps more, agreed at once
    (the schedule is not complete), never past --max_steps. The checkpoint's figures alone
    (not this start's clock: every rank plans alike). Where less than a step is left, none."""
    monkeypatch.setattr(nmt.budget, "clock", lambda: 100.0)
    budget = Budget(1200, 320, 40, steps_per_epoch=1000, eval_every=0, test_share=1.0,
                    steps=100, agreed=100, earlier=60.0, last=(15.0, 15.0))
    assert budget.reserve() == 15 + 15 * (1 + nmt.budget.BEAM_COST) + 24
    assert budget.lengthen(100, 300) == 425 and budget.agreed == 425 and not budget.done(100)
    monkeypatch.setattr(nmt.budget, "clock", lambda: 900.0)  # (this start's set-up: unread)
    assert budget.lengthen(100, 300) == 425
    budget.max_steps = 200
    assert budget.lengthen(100, 300) == 200 == budget.agreed
    budget.max_steps, budget.spent_before = 0, 1100  # 1 s left: no step
    assert budget.lengthen(100, 300) == 100 and budget.done(100)


def test_a_raised_budgets_first_plan_counts_the_validations_on_the_way(monkeypatch):
    """The first plan of a raised budget fits the earlier starts' validations on the way (one
    each epoch's end, 15 s by theirs) as a measured plan does: the same 781 s as above buy 306
    steps more at 100 steps an epoch (734.4 s, and 45 s of validations at steps 200 to 400),
    not 325 (the 781 s on steps alone, which the validations would take past the budget)."""
    monkeypatch.setattr(nmt.budget, "clock", lambda: 100.0)
    budget = Budget(1200, 320, 40, steps_per_epoch=100, eval_every=0, test_share=1.0,
                    steps=100, agreed=100, earlier=60.0, last=(15.0, 15.0))
    assert budget.lengthen(100, 300) == 406 == budget.agreed


def test_a_raised_budget_plans_from_the_checkpoints_training_time_its_set_up_apart(monkeypatch,
                                                                                capsys):
    """budget_for, past a saved schedule's end: a step's seconds come from the earlier starts'
    training time less their validations' ((300 - 60) / 100 = 2.4 s), not their set-up (60 s),
    which is spent from the budget all the same: 1200 - 360 - 99 (the end's reserve) = 741 s,
    308 steps more. A raise too small for a step says what is spent, set-up included, and what
    the end keeps, in the words of what was raised; it is complete. Where --max_steps still
    holds at the step, the budget says nothing: the cap is why no step is left."""
    from types import SimpleNamespace
    monkeypatch.setattr(nmt.budget, "clock", lambda: 100.0)
    config = SimpleNamespace(time_budget=20, val_max_sentences=4, accum_steps=1, eval_every=0,
                             max_steps=0)
    data = SimpleNamespace(validation=list(range(4)), test={"t": (["s"] * 4, ["t"] * 4)})

    def resumed(**fields):
        return SimpleNamespace(step=100, seconds_before=300.0, setup_before=60.0,
                               validation_seconds=60.0, last_validation=(15.0, 15.0),
                               complete=False, longer="the --time_budget is raised", **fields)
    raised = resumed()
    assert nmt.budget.budget_for(config, data, 2000, 100, raised, 0.0).steps == 408
    assert "the --time_budget is raised: 408 steps in all" in capsys.readouterr().out
    assert not raised.complete
    config.time_budget = 7.4  # 444 s: 444 - 360 - 83.88 (75 + MARGIN's 8.88) = 0.12 s left
    short = resumed()
    assert nmt.budget.budget_for(config, data, 2000, 100, short, 0.0).agreed == 100
    assert ("the --time_budget is raised, but buys no step more: 6.0 of its 7.4 minutes are "
            "spent, and the end keeps 1.4 of them (a validation, the test sets' scoring, 2% "
            "of the budget)") in capsys.readouterr().out and short.complete
    config.max_steps, lifted = 200, resumed()
    lifted.longer = "--max_steps no longer cuts the schedule"
    nmt.budget.budget_for(config, data, 2000, 100, lifted, 0.0)
    assert "--max_steps no longer cuts the schedule, but buys no step more" in \
        capsys.readouterr().out.splitlines()[-1]
    config.time_budget, config.max_steps, capped = 20, 100, resumed()
    assert nmt.budget.budget_for(config, data, 2000, 100, capped, 0.0).agreed == 100
    assert capsys.readouterr().out == "" and not capped.complete  # (nothing_to_do: the cap)


def test_a_resume_within_its_schedule_is_laid_out_again_at_once_and_says_nothing(
        monkeypatch, capsys):
    """budget_for, a resume before the saved schedule's end (a Ctrl-C): laid out again from
    the checkpoint's figures (408 steps, as above), not the saved 500, with no word of a
    longer schedule (restore_progress's `longer` is for a resume past the saved end). A
    checkpoint with no training time recorded (an older one) keeps the saved plan until this
    start measures; one at step 0 (stopped before its first step, an --init_from's validation
    timed) too: no speed comes from no step."""
    from types import SimpleNamespace
    monkeypatch.setattr(nmt.budget, "clock", lambda: 100.0)
    config = SimpleNamespace(time_budget=20, val_max_sentences=4, accum_steps=1, eval_every=0,
                             max_steps=0)
    data = SimpleNamespace(validation=list(range(4)), test={"t": (["s"] * 4, ["t"] * 4)})

    def resumed(**fields):
        return SimpleNamespace(**{
            "step": 100, "seconds_before": 300.0, "setup_before": 60.0,
            "validation_seconds": 60.0, "last_validation": (15.0, 15.0), "complete": False,
            "longer": "the --time_budget is raised", **fields})
    within = resumed()
    budget = nmt.budget.budget_for(config, data, 2000, 500, within, 0.0)
    assert budget.steps == budget.agreed == 408 and not within.complete
    assert capsys.readouterr().out == ""
    untimed = resumed(seconds_before=0.0, validation_seconds=0.0)
    budget = nmt.budget.budget_for(config, data, 2000, 500, untimed, 0.0)
    assert budget.steps == budget.agreed == 500 and not untimed.complete
    first = resumed(step=0, seconds_before=5.0, validation_seconds=3.0,
                    last_validation=(3.0, 2.0))
    budget = nmt.budget.budget_for(config, data, 2000, 500, first, 0.0)
    assert budget.steps == budget.agreed == 500 and not first.complete
    assert capsys.readouterr().out == ""


def test_a_resume_says_why_its_schedule_is_longer_in_the_words_of_what_changed():
    """A --time_budget resume of a run whose schedule ended at its step: a larger budget, a
    budget given to a run of epochs, a --max_steps cap gone or raised past the saved one; a
    complete schedule, no budget, a checkpoint within its schedule: nothing."""
    from config import Config
    state = {"config": {"time_budget": 3, "max_steps": 0}, "global_step": 50,
             "schedule_steps": 50}
    assert nmt.budget.longer(Config(time_budget=4), state) == "the --time_budget is raised"
    assert nmt.budget.longer(Config(time_budget=3), state) == ""  # complete
    assert nmt.budget.longer(Config(), state) == ""
    epochs = {**state, "config": {"time_budget": 0, "max_steps": 0}}
    assert nmt.budget.longer(Config(time_budget=3), epochs) == "--time_budget is new to this run"
    capped = {**state, "config": {"time_budget": 3, "max_steps": 50}}
    assert nmt.budget.longer(Config(time_budget=3), capped) == \
        "--max_steps no longer cuts the schedule"
    assert nmt.budget.longer(Config(time_budget=3, max_steps=80), capped) == \
        "--max_steps 80 leaves more of the schedule"
    within = {**state, "global_step": 30}  # (a plain resume: its schedule goes on)
    assert nmt.budget.longer(Config(time_budget=4), within) == ""


def test_the_budget_reads_the_runs_epoch_validation_and_test_sets(monkeypatch, capsys):
    """budget_for: an epoch's optimizer steps (7 batches, --accum_steps 2: 4), the test
    sentences over those a validation decodes (8 over --val_max_sentences 4), and a resume of a
    complete schedule is not lengthened (only one whose budget was raised)."""
    from types import SimpleNamespace
    monkeypatch.setattr(nmt.budget, "clock", lambda: 100.0)
    config = SimpleNamespace(time_budget=10, val_max_sentences=4, accum_steps=2, eval_every=0,
                             max_steps=0)
    data = SimpleNamespace(validation=list(range(10)),
                           test={"a": (["s"] * 6, ["t"] * 6), "b": (["s"] * 2, ["t"] * 2)})
    fresh = SimpleNamespace(step=0, seconds_before=0.0, complete=False)
    budget = nmt.budget.budget_for(config, data, 7, 50, fresh, 0.0)
    assert (budget.steps_per_epoch, budget.test_share, budget.steps) == (4, 2.0, 50)
    complete = SimpleNamespace(step=50, seconds_before=90.0, complete=True)
    assert nmt.budget.budget_for(config, data, 7, 50, complete, 0.0).steps == 50
    assert "raised" not in capsys.readouterr().out
    raised = SimpleNamespace(step=50, seconds_before=90.0, complete=False,
                             longer="the --time_budget is raised")
    assert nmt.budget.budget_for(config, data, 7, 50, raised, 0.0).steps > 50
    assert "the --time_budget is raised" in capsys.readouterr().out


class FakeClock:
    """The budget's clock: a step costs STEP seconds, a validation VALIDATION, the test scoring
    TESTS; nothing else moves it. DECODING: a validation's seconds of decoding (None: all)."""
    STEP, VALIDATION, TESTS, DECODING = 2.0, 6.0, 20.0, None

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def fake_time(monkeypatch):
    """A FakeClock in train.py and nmt/budget.py; train_step, run_validation and
    score_test_sets advance it; the clock's reading when the test scoring ended is kept."""
    fake = FakeClock()
    monkeypatch.setattr(nmt.budget, "clock", fake)
    monkeypatch.setattr(train, "clock", fake)
    step, validation, tests = train.train_step, train.run_validation, train.score_test_sets

    def timed(real, seconds, name):
        def call(*args, **kwargs):
            fake.now += seconds  # (before: a time the call reads includes its own)
            result = real(*args, **kwargs)
            if name:
                setattr(fake, name, fake.now)
            if isinstance(result, dict) and "seconds_decoding" in result:  # (a validation's)
                result["seconds_decoding"] = fake.DECODING or seconds
            return result
        return call
    monkeypatch.setattr(train, "train_step", timed(step, fake.STEP, None))
    monkeypatch.setattr(train, "run_validation", timed(validation, fake.VALIDATION, None))
    monkeypatch.setattr(train, "score_test_sets", timed(tests, fake.TESTS, "scored_at"))
    return fake


def corpus(folder):
    make_corpus(folder, n=120, val=4)
    write_aligned(folder, "test", number_pairs(4, seed=9))  # as many as a validation decodes


def latest(home):
    from config import Config
    from nmt.checkpoint import latest_checkpoint_path
    return latest_checkpoint_path(Config(model_folder=str(home / "weights")))


def ideal_steps(out: str, decoding: float = FakeClock.VALIDATION) -> int:
    """The steps 3 minutes buy at the fake clock's costs: a step, and a validation each epoch of
    the run's K steps (its stop line says "of K"), with the end's reserve kept back (a
    validation's `decoding` seconds by the test sentences, greedy and beam, its rest once)."""
    per_epoch = int(out.split("the --time_budget's schedule is complete")[1].split(" of ")[2]
                    .split(" ")[0])
    reserve = 2 * 6 - decoding + decoding * 1 * (1 + nmt.budget.BEAM_COST) + 180 * MARGIN
    return int((180 - reserve) / (FakeClock.STEP + FakeClock.VALIDATION / per_epoch))


FLAGS = ["--data_dir", "c", *TINY, "--lr_schedule", "cosine", "--val_examples", "0",
         "--log_every", "1"]


def test_a_budget_run_completes_its_schedule_and_scores_the_test_set_inside_it(tmp_path,
                                                                               fake_time):
    """3 minutes at 2 s a step and 6 s a validation (one an epoch): the run plans its length
    from what it measures, ends with its schedule complete (the last step is the schedule's
    last), validates, scores the test set before the budget's end, and the card says what the
    budget bought."""
    corpus(tmp_path / "c")
    started = fake_time.now
    t = run_here("train.py", *FLAGS, "--time_budget", "3", cwd=tmp_path)
    out, err = t.stdout.decode(), t.stderr.decode()  # (the budget sets the length, not epochs)
    assert t.returncode == 0, err[-2000:]
    assert "the --time_budget's schedule is complete" in out
    final = load_checkpoint(latest(tmp_path))
    steps = final["global_step"]
    assert final["schedule_steps"] == steps  # the schedule's last step is the run's last
    assert fake_time.scored_at - started <= 180  # the test scores inside the budget
    validations = json.loads((tmp_path / "weights" / "tmodel_validation.json").read_text())
    assert len(validations) >= 3 and validations[-1]["step"] == steps
    assert len({v["step"] for v in validations}) == len(validations)  # none twice
    assert abs(steps - ideal_steps(out)) <= 1  # the budget is used, no more
    card = (tmp_path / "weights" / "MODEL_CARD.md").read_text()
    assert f"- --time_budget 3 minutes bought {steps} optimizer steps" in card
    lr = train.learning_rate(train.Config(**{**final["config"]}), steps, steps)
    assert lr < 0.01 * final["config"]["lr"]  # the cosine at its end
    (tmp_path / "weights" / "MODEL_CARD.md").unlink()  # its end cut short in the scoring
    t = run_here("train.py", cwd=tmp_path)  # scores, with no plan: nothing is left to plan
    assert t.returncode == 0 and "scoring them" in t.stdout.decode(), t.stderr.decode()[-2000:]
    assert "until measured" not in t.stdout.decode()
    assert f"- --time_budget 3 minutes bought {steps} optimizer steps" in \
        (tmp_path / "weights" / "MODEL_CARD.md").read_text()
    t = run_here("train.py", cwd=tmp_path)
    assert t.returncode == 0 and ("the --time_budget 3 minutes' schedule is complete (step "
                                  f"{steps}); raise --time_budget to train on") in t.stdout.decode()
    kept = [p.read_bytes() for p in (latest(tmp_path), tmp_path / "weights" / "MODEL_CARD.md",
                                     tmp_path / "weights" / "tmodel_validation.json")]
    files = sorted(tmp_path.rglob("*"))  # (TensorBoard's events files among them)
    ended = json.loads((tmp_path / "weights" / "results.json").read_text())
    assert ended["step"] == steps and ended["seconds"] == final["provenance"]["seconds"] + 20
    assert ended["setup_seconds"] == 6 + 20  # the first end's validation and test scoring,
    # after the checkpoint: spent, not training (the scoring again: so at the next resume)
    t = run_here("train.py", "--time_budget", "3.5", cwd=tmp_path)  # 18 s more: < the end's
    assert t.returncode == 0 and ("the --time_budget is raised, but buys no step more: 3.2 of "
                                  "its 3.5 minutes are spent, and the end keeps 0.57 of them"
                                  ) in t.stdout.decode(), t.stderr.decode()[-2000:]
    assert [p.read_bytes() for p in (latest(tmp_path), tmp_path / "weights" / "MODEL_CARD.md",
                                     tmp_path / "weights" / "tmodel_validation.json")] == kept
    assert sorted(tmp_path.rglob("*")) == files
    earlier, resumed = ended["seconds"] + ended["setup_seconds"], fake_time.now
    t = run_here("train.py", "--time_budget", "4", cwd=tmp_path)  # a minute more: laid out again
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    assert "the --time_budget is raised: " in t.stdout.decode()
    more = load_checkpoint(latest(tmp_path))
    assert more["schedule_steps"] == more["global_step"] > steps
    assert earlier + fake_time.scored_at - resumed <= 240  # its test scores inside the 4 minutes


def test_the_end_keeps_back_a_validations_decoding_by_the_test_sentences_its_rest_once(
        tmp_path, fake_time):
    """3 minutes, validations of 6 s of which 2 decode: the plan the run measures keeps back
    6 s, the test sets' 2 · 1 · (1 + BEAM_COST) s of decoding and the validation's other 4 s
    (21.6 s with the margin, not the 33.6 s of a validation all decoding), and spends the rest
    on steps; the checkpoint keeps the latest validation's figures, its decoding apart, for a
    resume's first plan."""
    corpus(tmp_path / "c")
    fake_time.DECODING = 2.0
    t = run_here("train.py", *FLAGS, "--time_budget", "3", cwd=tmp_path)
    out = t.stdout.decode()
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    final = load_checkpoint(latest(tmp_path))
    assert tuple(final["provenance"]["last_validation"]) == (6.0, 2.0)
    assert abs(final["global_step"] - ideal_steps(out, decoding=2.0)) <= 1
    assert ideal_steps(out, decoding=2.0) - ideal_steps(out) > 2  # (the difference is seen)


def test_an_epoch_longer_than_the_budget_still_scores_the_test_set_inside_it(tmp_path,
                                                                            fake_time):
    """1.5 minutes, 2 s a step, 44 steps an epoch: no validation would come before the plan's
    end, and with its time unknown the end kept only the margin (the epoch's end at 88 s; its
    validation and the test scoring ran 24 s past). Half the budget spent, the run validates
    once, mid-epoch, to time it; its plan then keeps the end's reserve, and the schedule ends
    mid-epoch with its own validation, each step validated once."""
    make_corpus(tmp_path / "c", n=1200, val=4)
    write_aligned(tmp_path / "c", "test", number_pairs(4, seed=9))
    started = fake_time.now
    t = run_here("train.py", *FLAGS, "--time_budget", "1.5", cwd=tmp_path)
    out = t.stdout.decode()
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    assert "half the budget was spent before a validation was timed" in out
    assert "the --time_budget's schedule is complete" in out and " of 44 (step " in out
    steps = [v["step"] for v in json.loads(
        (tmp_path / "weights" / "tmodel_validation.json").read_text())]
    assert len(steps) == 2 and steps[0] < steps[1] < 44
    assert fake_time.scored_at - started <= 90


def test_a_plan_that_ends_at_an_epochs_end_is_complete_in_that_epochs_checkpoint(tmp_path,
                                                                                fake_time):
    """0.8 minutes: the validation at epoch 0's end makes the plan end there (what is left, 1
    s, is less than a step); the ranks take it at the next epoch's first exchange, which saved
    a checkpoint of epoch 1 at batch 0, a copy of epoch 0's. Epoch 0's checkpoint is saved
    again instead, with the schedule's end (saved before, it said 23 steps, and the same
    command resumed, trained past the budget and scored again); the step is validated once,
    and the same command again says the schedule is complete."""
    corpus(tmp_path / "c")
    t = run_here("train.py", *FLAGS, "--time_budget", "0.8", cwd=tmp_path)
    out = t.stdout.decode()
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    assert "the schedule's 5 steps (1.0 epochs) are trained" in out
    assert "is complete (0.27 of 0.8 minutes spent) in epoch 0 after batch 5 of 5 (step 5); " \
        "saved weights/tmodel_00.pt" in out
    assert sorted(p.name for p in (tmp_path / "weights").glob("*.pt")) == \
        ["tmodel_00.pt", "tmodel_best.pt"]
    assert load_checkpoint(latest(tmp_path))["schedule_steps"] == 5
    assert [v["step"] for v in json.loads(
        (tmp_path / "weights" / "tmodel_validation.json").read_text())] == [5]
    t = run_here("train.py", cwd=tmp_path)
    assert t.returncode == 0 and ("the --time_budget 0.8 minutes' schedule is complete (step "
                                  "5); raise --time_budget to train on") in t.stdout.decode()
    assert load_checkpoint(latest(tmp_path))["global_step"] == 5


def test_a_new_line_from_an_earlier_epoch_spends_the_budget_from_that_epochs_time(tmp_path,
                                                                                 fake_time):
    """--preload 01 on a finished 1.6-minute run: the new line of training goes on from the
    time epoch 1's checkpoint recorded (the abandoned line's time is not spent; its
    results.json is set aside with it), and ends inside the budget from there."""
    corpus(tmp_path / "c")
    t = run_here("train.py", *FLAGS, "--time_budget", "1.6", "--keep_optimizer", "0",
                 cwd=tmp_path)
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    epoch_1 = load_checkpoint(tmp_path / "weights" / "tmodel_01.pt")["provenance"]
    spent = epoch_1["seconds"] + epoch_1["setup_seconds"]
    t = run_here("train.py", "--preload", "01", cwd=tmp_path)
    out = t.stdout.decode()
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    assert f"--time_budget 1.6 minutes: {nmt.budget.minutes(spent)} spent; the schedule laid " \
        "out for" in out
    final = load_checkpoint(latest(tmp_path))["provenance"]
    assert final["seconds"] + final["setup_seconds"] <= 1.6 * 60


def ctrl_c_after(fake_time, seconds: float):
    """train.train_step that sends the first Ctrl-C once `seconds` of the fake clock have
    passed since now: the run stops after that step."""
    step, started = train.train_step, fake_time.now

    def interrupted(*args, **kwargs):
        result = step(*args, **kwargs)
        if fake_time.now - started >= seconds and not getattr(fake_time, "signalled", False):
            fake_time.signalled = True
            signal.raise_signal(signal.SIGINT)  # the first Ctrl-C: stop after this step
        return result
    return interrupted


def test_a_resumed_budget_run_keeps_what_is_left(tmp_path, fake_time, monkeypatch):
    """Stopped (Ctrl-C) a minute into its 3, the run resumes with the 2 minutes left: the
    earlier start's time is counted, and the whole ends inside the 3 minutes with about the
    steps of a run never stopped."""
    corpus(tmp_path / "c")
    started = fake_time.now
    step = train.train_step
    monkeypatch.setattr(train, "train_step", ctrl_c_after(fake_time, 60))
    t = run_here("train.py", *FLAGS, "--time_budget", "3", cwd=tmp_path)
    assert t.returncode == 130, t.stderr.decode()[-2000:]
    stopped = load_checkpoint(latest(tmp_path))
    assert 60 <= stopped["provenance"]["seconds"] < 90
    monkeypatch.setattr(train, "train_step", step)
    t = run_here("train.py", cwd=tmp_path)  # (the budget comes from the checkpoint)
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    assert "the --time_budget's schedule is complete" in t.stdout.decode()
    final = load_checkpoint(latest(tmp_path))
    assert final["schedule_steps"] == final["global_step"] > stopped["global_step"]
    assert final["provenance"]["seconds"] <= 180
    assert fake_time.scored_at - started <= 180 + 5  # (5: the second start's set-up, unmoved)
    assert abs(final["global_step"] - ideal_steps(t.stdout.decode())) <= 1  # as if not stopped


def test_a_raised_budget_whose_patience_has_run_out_says_only_that(tmp_path, fake_time):
    """A finished budget run whose last validations were no better than its best, resumed with
    a larger budget and --patience 1: it said the budget laid out more steps, then that
    training ends here; it says only why it ends, and trains nothing."""
    corpus(tmp_path / "c")
    t = run_here("train.py", *FLAGS, "--time_budget", "1", cwd=tmp_path)
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    path = tmp_path / "weights" / "tmodel_validation.json"
    validations = json.loads(path.read_text())
    validations[0]["bleu"] = 99.0  # (the first the best: the later ones no better)
    path.write_text(json.dumps(validations))
    step = load_checkpoint(latest(tmp_path))["global_step"]
    t = run_here("train.py", "--time_budget", "2", "--patience", "1", cwd=tmp_path)
    out = t.stdout.decode()
    assert t.returncode == 0 and "(--patience 1): training ends here" in out, out
    assert "raised" not in out and "steps in all" not in out
    assert load_checkpoint(latest(tmp_path))["global_step"] == step


def test_a_budget_lowered_below_what_is_spent_trains_no_step(tmp_path, fake_time,
                                                             monkeypatch):
    """Stopped a minute into 3, resumed with --time_budget 1: the budget is spent, so the
    resume trains no step (it trained one, its saved plan kept until measured), says so,
    scores the test set, and the card gives the minutes spent in all, past the budget (it said
    the test scoring was inside it)."""
    corpus(tmp_path / "c")
    step = train.train_step
    monkeypatch.setattr(train, "train_step", ctrl_c_after(fake_time, 60))
    t = run_here("train.py", *FLAGS, "--time_budget", "3", cwd=tmp_path)
    assert t.returncode == 130, t.stderr.decode()[-2000:]
    stopped = load_checkpoint(latest(tmp_path))
    monkeypatch.setattr(train, "train_step", step)
    t = run_here("train.py", "--time_budget", "1", cwd=tmp_path)
    out = t.stdout.decode()
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    assert "--time_budget 1 minutes, but buys no step more: 1.1 of its 1 minutes are spent" in out
    assert load_checkpoint(latest(tmp_path))["global_step"] == stopped["global_step"]
    card = (tmp_path / "weights" / "MODEL_CARD.md").read_text()
    assert f"bought {stopped['global_step']} optimizer steps" in card
    assert "1.5 minutes spent in all" in card  # (66 s, a validation's 6, the test scoring's 20)


def test_a_budget_run_cut_at_max_steps_trains_on_once_the_cap_is_lifted(tmp_path, fake_time):
    """--max_steps 5 stops a 3-minute budget run early: its card says the cap, not the budget,
    set the steps; resumed as its stop line says (--max_steps 0), it trains on inside what is
    left of the budget, where it had been refused as complete; kept at the cap, it is still
    at its end, the budget raised or not (the cap said to be why)."""
    corpus(tmp_path / "c")
    started = fake_time.now
    t = run_here("train.py", *FLAGS, "--time_budget", "3", "--max_steps", "5", cwd=tmp_path)
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    assert "--max_steps 0" in t.stdout.decode()  # the stop line's advice
    assert load_checkpoint(latest(tmp_path))["global_step"] == 5
    card = (tmp_path / "weights" / "MODEL_CARD.md").read_text()
    assert "- --time_budget 3 minutes, cut at --max_steps 5: 5 optimizer steps" in card
    assert "bought" not in card
    t = run_here("train.py", cwd=tmp_path)  # the cap kept: nothing to train
    assert t.returncode == 0 and "already at step 5 of --max_steps 5" in t.stdout.decode()
    t = run_here("train.py", "--time_budget", "4", cwd=tmp_path)  # the budget raised, not the cap
    assert t.returncode == 0 and "already at step 5 of --max_steps 5" in t.stdout.decode()
    assert "buys no step more" not in t.stdout.decode()  # (the cap, not the budget, ends it)
    t = run_here("train.py", "--max_steps", "0", cwd=tmp_path)
    out = t.stdout.decode()
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    assert "--max_steps no longer cuts the schedule: " in out and "is complete (step 5)" not in out
    final = load_checkpoint(latest(tmp_path))
    assert final["schedule_steps"] == final["global_step"] > 5
    assert fake_time.scored_at - started <= 180 + 20 + 5  # (the first end's scoring, a set-up)
    assert "bought" in (tmp_path / "weights" / "MODEL_CARD.md").read_text()


def test_a_resumed_budget_run_counts_every_starts_set_up(tmp_path, fake_time, monkeypatch):
    """Each start's set-up (its data and model: 30 s here) is spent from the budget, the earlier
    starts' too: a checkpoint keeps their set-up apart from the training time (the model card's
    minutes), and a run stopped and resumed still scores its test set inside its 3 minutes
    (the first start's set-up was lost on resume, and the run overran by as much); the card's
    minutes spent in all count both set-ups."""
    corpus(tmp_path / "c")
    started = fake_time.now
    step, get_ds = train.train_step, train.get_ds

    def slow_get_ds(*args, **kwargs):
        fake_time.now += 30
        return get_ds(*args, **kwargs)
    monkeypatch.setattr(train, "get_ds", slow_get_ds)
    monkeypatch.setattr(train, "train_step", ctrl_c_after(fake_time, 90))
    t = run_here("train.py", *FLAGS, "--time_budget", "3", cwd=tmp_path)
    assert t.returncode == 130, t.stderr.decode()[-2000:]
    stopped = load_checkpoint(latest(tmp_path))["provenance"]
    assert stopped["setup_seconds"] == 30 and 60 <= stopped["seconds"] < 90
    monkeypatch.setattr(train, "train_step", step)
    t = run_here("train.py", cwd=tmp_path)
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    final = load_checkpoint(latest(tmp_path))["provenance"]
    assert final["setup_seconds"] == 60
    assert fake_time.scored_at - started <= 180  # both set-ups inside the budget
    assert "2.9 minutes spent in all, set-up and test scoring included" in \
        (tmp_path / "weights" / "MODEL_CARD.md").read_text()  # (172 s, both set-ups' 60 among)


def test_the_budget_is_minutes_not_negative():
    from config import Config
    assert "--time_budget must not be negative" in Config(time_budget=-1).validate()


def test_a_budget_run_trains_past_num_epochs_until_its_schedule_is_complete(tmp_path,
                                                                           fake_time):
    """Under --time_budget the budget, not --num_epochs (20 by default, which it replaces),
    sets the run's length: on a corpus of one step an epoch, 4 minutes at the fake clock's
    costs buy more than 20 epochs, all trained to the schedule's end."""
    make_corpus(tmp_path / "c", n=8, val=2)
    t = run_here("train.py", *FLAGS, "--time_budget", "4", cwd=tmp_path)
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    assert "the --time_budget's schedule is complete" in t.stdout.decode()
    validations = json.loads((tmp_path / "weights" / "tmodel_validation.json").read_text())
    final = load_checkpoint(latest(tmp_path))
    assert validations[-1]["epoch"] >= 20 and final["schedule_steps"] == final["global_step"]
