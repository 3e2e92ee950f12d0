"""Training for a time budget (--time_budget MINUTES): the run's length in optimizer steps, and
so the learning-rate schedule's, set from the throughput this run measures (its steps and its
validations), corrected as it goes, so that the schedule completes, the last validation and
the test scoring end inside the budget. A resume keeps what is left: the training time of
the earlier starts is in the checkpoint (its provenance), a finished run's end in results.json.

Each plan: the most steps whose time (a step's seconds each, and a validation's at each
validation on the way) fits in the time left less the end's reserve; the end's reserve = one
validation, the test sets' scoring (the validation's decoding by their sentences, greedy and
beam, and its other costs once), and MARGIN of the budget for what is not measured (saving,
the model card). A validation's figures are the latest's; until this start has timed a step
(and a validation), the earlier starts' stand in."""

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
    steps_done: int = 0  # this start's optimizer steps
    earlier: float = 0.0  # the earlier starts' validations' seconds, all together
    last: tuple = None  # the latest validation (any start's): its seconds, its decoding's
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
        """Seconds a validation: the latest's (the first of a process pays for imports, and an
        untrained model decodes longer), 0 before any is timed."""
        return self.last[0] if self.last else 0.0

    def reserve(self) -> float:
        """Seconds kept for the end: the last validation; the test sets' scoring, their
        sentences decoded greedy and with the beam at the validation's pace, its other costs
        (the scoring, loading) once; MARGIN of the budget."""
        seconds, decoding = self.last or (0.0, 0.0)
        return (2 * seconds - decoding + decoding * self.test_share * (1 + BEAM_COST)
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
        per_validation, per_step = self.per_validation(), max(per_step, 1e-9)

        def cost(n: int) -> float:
            return n * per_step + per_validation * self.validations_between(step, step + n)
        fits, too_many = 0, 1  # (cost grows with n: doubled until too many, then bisected)
        while cost(too_many) <= left:
            fits, too_many = too_many, 2 * too_many
        while too_many - fits > 1:
            middle = (fits + too_many) // 2
            fits, too_many = (middle, too_many) if cost(middle) <= left else (fits, middle)
        self.steps = step + fits
        if self.max_steps:
            self.steps = min(self.steps, self.max_steps)
        return self.steps

    def validations_between(self, start: int, end: int) -> int:
        """Validations after step `start` up to step `end`, the one at `end` left out (the
        reserve's): at each epoch's end, and every --eval_every steps within an epoch."""
        def multiples(k: int) -> int:  # of k after `start`, up to `end`
            return end // k - start // k
        ends, within = multiples(self.steps_per_epoch), 0
        if self.eval_every:  # those that are not an epoch's end
            within = multiples(self.eval_every) - multiples(
                math.lcm(self.eval_every, self.steps_per_epoch))
        at_end = end % self.steps_per_epoch == 0 or (self.eval_every and
                                                       end % self.eval_every == 0)
        return max(ends + within - (1 if at_end and end > start else 0), 0)

    def lengthen(self, step: int, training_before: float) -> int:
        """A resume's first plan, from the earlier starts' speed: `step` steps in
        `training_before` seconds (their validations, `earlier`, apart), the end's reserve
        kept, agreed at once; 0 (the saved plan kept) where no training time was recorded. It
        reads the checkpoint only, not the clock, so that every rank makes the same (this
        start's set-up is spent from the first plan it measures)."""
        if training_before <= self.earlier:
            return 0
        self.fit(step, self.seconds - self.spent_before - self.reserve(),
                 (training_before - self.earlier) / step)
        self.agreed = self.steps
        return self.steps

    def proposal(self, rank: int) -> list:
        """What this rank adds to the step's exchange: rank 0 its plan, and whether to validate
        after the step because half the budget is spent and no validation is timed (an epoch
        longer than that, no --eval_every): without one the end's reserve is unknown, and the
        last validation and the test sets would overrun the budget. The others add 0s."""
        untimed = self.last is None and self.spent() >= self.seconds / 2
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

    def validated(self, seconds: float, step: int, decoding: float = None) -> str:
        """A validation of `seconds` at `step`, `decoding` of them its decoding (all if not
        given): in the plan, which is made again; its words. After the schedule's last step, or
        where the plan made again ends at it, nothing is left to plan: the words say what was
        trained."""
        self.validation_seconds += seconds
        self.last = seconds, seconds if decoding is None else decoding
        if not self.done(step) and self.plan(step) > step:
            return self.words("by the speed measured" if self.steps_done else "until measured") \
                + ("; half the budget was spent before a validation was timed: this one times "
                   "the end's" if self.timing else "")
        return (f"--time_budget {self.seconds / 60:g} minutes: {minutes(self.spent())} spent; "
                f"the schedule's {step:,} steps ({step / self.steps_per_epoch:.1f} epochs) "
                f"are trained")

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
    sets' sentences over a validation's, the schedule's length `steps` until measured. A resume
    is laid out again at once from the checkpoint's figures (unless --max_steps holds it at its
    step), and one that buys no step is complete: said so where it was to train on."""
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
                    earlier=getattr(progress, "validation_seconds", 0.0),
                    last=getattr(progress, "last_validation", None))
    capped = config.max_steps and step >= config.max_steps  # (no plan trains on: nothing_to_do)
    longer = getattr(progress, "longer", "") if steps <= step else ""  # (past the saved end)
    if not step or complete or capped or steps <= step and not longer or not budget.lengthen(
            step, progress.seconds_before):  # (past the end with no reason: --patience's end)
        return budget
    if budget.steps > step and longer:
        print(f"{longer}: {budget.steps:,} steps in all, by the speed of the earlier starts, "
              f"until this one measures its own")
    elif budget.steps == step:  # (the end's reserve: what a resume trains nothing with)
        print(f"{longer or f'--time_budget {config.time_budget:g} minutes'}, but buys no step "
              f"more: {minutes(spent_before)} of its {config.time_budget:g} minutes are spent, "
              f"and the end keeps {minutes(budget.reserve())} of them (a validation, the test "
              f"sets' scoring, {MARGIN:.0%} of the budget)")
        progress.complete = True
    return budget


def longer(config, state: dict) -> str:
    """Why a --time_budget resume of a run whose schedule ended at its step (`state`, the
    checkpoint) lays it out longer, in words (nothing: it does not): a --max_steps that cut it
    lifted, a larger budget, a budget given to a run that had none."""
    saved = state["config"].get("time_budget", 0)
    if not config.time_budget or completed(config, state) or state["global_step"] < state.get(
            "schedule_steps", math.inf):  # (within its schedule: a plain resume)
        return ""
    if cap_lifted(config, state):
        return (f"--max_steps {config.max_steps} leaves more of the schedule" if config.max_steps
                else "--max_steps no longer cuts the schedule")
    return "the --time_budget is raised" if saved else "--time_budget is new to this run"


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
