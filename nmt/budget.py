"""Training for a time budget (--time_budget MINUTES): the run's length in optimizer steps, and
so the learning-rate schedule's, set from the throughput this run measures (its steps and its
validations), corrected as it goes, so that the schedule completes, the last validation and
the test scoring end inside the budget. A resume keeps what is left: the training time of
the earlier starts is in the checkpoint (its provenance).

Each plan: steps left = (time left - the end's reserve) / (a step's seconds + a validation's
seconds / steps between validations); the end's reserve = one validation, the test sets'
greedy and beam decoding (estimated from the validation's, by sentences), and MARGIN of the
budget for what is not measured (saving, the model card). Until this start has timed a step
(and a validation), the earlier starts' measurements stand in."""

import math
import time
from dataclasses import dataclass

BEAM_COST = 3.0  # beam 4's decoding over greedy's, for the test sets' reserve (an upper guess)
MARGIN = 0.02  # of the budget, kept back for what is not measured


def minutes(seconds: float) -> str:
    """Seconds in minutes for the log: one decimal, or two significant digits under a minute
    (from 59.7 s on, which two digits round to "1", one decimal: "1.0")."""
    return f"{seconds / 60:.1f}" if seconds / 60 >= 0.995 else f"{seconds / 60:.2g}"


def clock() -> float:
    """The budget's clock (tests put a fake one here)."""
    return time.time()


@dataclass
class Budget:
    seconds: float  # the whole budget, every start together
    spent_before: float  # the earlier starts' time (a resume)
    started: float  # when this start began (its set-up included)
    steps_per_epoch: int  # optimizer steps an epoch: a validation each
    eval_every: int  # and one every this many steps (0: none)
    test_share: float  # test sentences over the validation sentences a validation decodes
    steps: int  # the run length this rank's plan proposes (rank 0's is the one agreed)
    max_steps: int = 0  # --max_steps: the plan never goes past it (0: no cap)
    agreed: int = None  # the run length the ranks agreed on at the last step: the schedule's
    training_started: float = None  # when this start's first step began
    validation_seconds: float = 0.0  # this start's validations, all together
    validations: int = 0
    steps_done: int = 0  # this start's optimizer steps
    earlier: tuple = (0.0, 0)  # the earlier starts' validations: their seconds, their number
    timing: bool = False  # validate after this step: none is timed by half the budget

    def __post_init__(self):
        self.agreed = self.steps if self.agreed is None else self.agreed

    def spent(self) -> float:
        return self.spent_before + clock() - self.started

    def per_step(self) -> float:
        """Seconds a step (the training time of this start, validations left out)."""
        training = clock() - self.training_started - self.validation_seconds
        return training / self.steps_done

    def per_validation(self) -> float:
        """Seconds a validation: this start's, or, before its first, the earlier starts'."""
        seconds, count = ((self.validation_seconds, self.validations) if self.validations
                          else self.earlier)
        return seconds / max(count, 1)

    def reserve(self) -> float:
        """Seconds kept for the end: the last validation, the test sets' decoding (greedy and
        beam), MARGIN of the budget."""
        return (self.per_validation() * (1 + self.test_share * (1 + BEAM_COST))
                + MARGIN * self.seconds)

    def plan(self, step: int) -> int:
        """The run's length (optimizer steps) that ends inside the budget, `step` steps done,
        by what this start has measured (unchanged before its first step is timed): the most
        steps whose time, and that of the validations on the way (each epoch's end and every
        --eval_every steps; the last is in the reserve), fit in what is left."""
        if not self.steps_done or self.training_started is None:
            return self.steps
        return self.fit(step, self.seconds - self.spent() - self.reserve(), self.per_step())

    def fit(self, step: int, left: float, per_step: float) -> int:
        """The plan: `step` steps done, the most steps more whose time (`per_step` seconds
        each) and that of the validations on the way fit in `left` seconds, never past
        --max_steps."""
        per_validation = self.per_validation()

        def cost(n: int) -> float:
            return n * per_step + per_validation * self.validations_between(step, step + n)
        every = 1 / self.steps_per_epoch + (1 / self.eval_every if self.eval_every else 0)
        n = max(math.floor(left / max(per_step + per_validation * every, 1e-9)), 0)  # on average
        while n > 0 and cost(n) > left:  # then exactly, a step at a time
            n -= 1
        while cost(n + 1) <= left:
            n += 1
        self.steps = step + n
        if self.max_steps:
            self.steps = min(self.steps, self.max_steps)
        return self.steps

    def validations_between(self, start: int, end: int) -> int:
        """Validations after step `start` up to step `end`, the one at `end` left out (the
        reserve's): at each epoch's end, and every --eval_every steps within an epoch."""
        ends = end // self.steps_per_epoch - start // self.steps_per_epoch
        within = 0
        if self.eval_every:
            within = sum(1 for s in range(start + 1, end + 1)
                         if s % self.eval_every == 0 and s % self.steps_per_epoch)
        at_end = end % self.steps_per_epoch == 0 or (self.eval_every and
                                                       end % self.eval_every == 0)
        return max(ends + within - (1 if at_end and end > start else 0), 0)

    def lengthen(self, step: int, training_before: float) -> int:
        """A resume past the saved schedule's end (the budget raised, or a --max_steps that cut
        it lifted): a first plan from the earlier starts' speed, `step` steps in
        `training_before` seconds (their validations, `earlier`, apart) and the end's reserve
        kept, agreed at once. It reads the checkpoint only, not the clock, so that every rank
        makes the same (this start's set-up is spent from the first plan it measures)."""
        seconds, count = self.earlier
        per_step = (training_before - seconds) / step if training_before > seconds else 1.0
        self.fit(step, self.seconds - self.spent_before - self.reserve(), per_step)
        self.agreed = self.steps
        return self.steps

    def proposal(self, rank: int) -> list:
        """What this rank adds to the step's exchange: rank 0 its plan, and whether to validate
        after the step because half the budget is spent and no validation is timed (an epoch
        longer than that, no --eval_every): without one the end's reserve is unknown, and the
        last validation and the test sets would overrun the budget. The others add 0s."""
        untimed = not (self.validations or self.earlier[1]) and self.spent() >= self.seconds / 2
        return [self.steps, int(untimed)] if rank == 0 else [0, 0]

    def agree(self, plan: list, step: int) -> bool:
        """Takes what the ranks agreed on (rank 0's proposal, from the exchange): the plan, and
        whether to validate after this step; whether the plan is already complete (it shrank
        to the `step` steps taken)."""
        self.agreed, self.timing = int(plan[0]), bool(plan[1])
        return self.done(step)

    def stepped(self, step: int, replan: bool) -> bool:
        """A step taken, the `step`th; `replan` (a log step): plan again (the new plan is
        taken at the next exchange). Whether the plan agreed on is complete."""
        self.steps_done += 1
        if replan:
            self.plan(step)
        return self.done(step)

    def validated(self, seconds: float, step: int) -> str:
        """A validation of `seconds` at `step`: in the plan, which is made again; its words.
        After the schedule's last step nothing is planned: the words say what was trained."""
        self.validation_seconds += seconds
        self.validations += 1
        if self.done(step):
            return (f"--time_budget {self.seconds / 60:g} minutes: {minutes(self.spent())} "
                    f"spent; the schedule's {self.agreed:,} steps "
                    f"({self.agreed / self.steps_per_epoch:.1f} epochs) are trained")
        self.plan(step)
        return self.words() + ("; half the budget was spent before a validation was timed: "
                               "this one times the end's" if self.timing else "")

    def done(self, step: int) -> bool:
        """Whether the schedule agreed on is complete after `step` steps."""
        return step >= self.agreed

    def start(self) -> str:
        """This start's training begins (its steps timed from now); the plan in words."""
        self.training_started = clock()
        return self.words("until measured")

    def words(self, basis: str = "by the speed measured") -> str:
        """Where the budget stands, for the log; `basis`: what the plan's length rests on."""
        return (f"--time_budget {self.seconds / 60:g} minutes: {minutes(self.spent())} spent; "
                f"the schedule laid out for {self.steps:,} steps "
                f"({self.steps / self.steps_per_epoch:.1f} epochs) {basis}")


def budget_for(config, data, batches: int, steps: int, progress, started: float):
    """--time_budget's plan for a run (None without the flag): what the earlier starts spent
    (train.py's Progress), the epoch's optimizer steps (`batches` of data.train), the test
    sets' sentences over a validation's, the schedule's length `steps` until measured; a resume
    past the saved schedule's end (not complete: the budget raised) lengthened at once, unless
    --max_steps still holds it there."""
    if not config.time_budget:
        return None
    step, complete = progress.step, progress.complete
    # every start together: the earlier starts' training and their set-ups (this one's: its
    # clock runs from `started`)
    spent_before = progress.seconds_before + getattr(progress, "setup_before", 0.0)
    decoded = min(config.val_max_sentences or len(data.validation), len(data.validation))
    tests = sum(len(sources) for sources, _ in (data.test or {}).values())
    budget = Budget(config.time_budget * 60, spent_before, started,
                    math.ceil(batches / config.accum_steps), config.eval_every,
                    tests / max(decoded, 1), steps, config.max_steps,
                    earlier=getattr(progress, "validation_time", (0.0, 0)))
    capped = config.max_steps and step >= config.max_steps  # (no plan trains on: nothing_to_do)
    if 0 < steps <= step and not complete and not capped:
        raised = "--max_steps no longer cuts the schedule" if getattr(
            progress, "cap_lifted", False) else "the --time_budget is raised"
        if budget.lengthen(step, progress.seconds_before) > step:
            print(f"{raised}: {budget.steps:,} steps in all, by the speed of the earlier "
                  f"starts, until this one measures its own")
        else:  # (the end's reserve: what a resume trains nothing with)
            print(f"{raised}, but buys no step more: {minutes(spent_before)} of its "
                  f"{config.time_budget:g} minutes are spent, and the end keeps "
                  f"{minutes(budget.reserve())} of them (a validation, the test sets' "
                  f"decoding, {MARGIN:.0%} of the budget)")
            progress.complete = True
    return budget


def cap_lifted(config, state: dict) -> bool:
    """Whether --max_steps cut a --time_budget run's schedule short (its plan ended at the cap,
    not where the budget would have) and is raised or gone now: the budget plans on from
    there."""
    cap, end = state["config"].get("max_steps", 0), state.get("schedule_steps", math.inf)
    return bool(cap) and end >= cap and (not config.max_steps or config.max_steps > cap)


def completed(config, state: dict) -> bool:
    """Whether a checkpoint ends a --time_budget run whose schedule completed, and neither the
    budget nor a --max_steps that cut the schedule short was raised since: then a resume has
    nothing to do."""
    saved = state["config"].get("time_budget", 0)
    return bool(config.time_budget and saved and config.time_budget <= saved
                and state["global_step"] >= state.get("schedule_steps", math.inf)
                and not cap_lifted(config, state))
