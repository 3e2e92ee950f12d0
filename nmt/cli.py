"""How a script meets its user: a user's error as one line on stderr and exit code 2, Ctrl-C as
one line and 130 (143 for SIGTERM), never a traceback (`run_main`, `fail`); an argument parser
whose errors are that one line (`ArgumentParser`); under torchrun, rank 0 alone speaks
(`ReportedElsewhere`). Every script runs its `main` through `run_main`. The settings themselves
(Config, the flags, the presets) are config.py's; the one process fact the core needs, whether
this is rank 0 (`config.is_main`), stays there, below the core."""

import argparse
import difflib
import os
import select
import signal
import sys
import threading
import time

from tqdm import tqdm

from config import UserError, is_main


ABORT_SAID = threading.Event()  # run_main has printed its "aborted" line (nmt.stopping reads it)


def below_a_bar() -> str:
    """The newline a line to stderr starts with so as not to land on a progress bar's line: on
    a terminal (a bar's line, or the ^C it echoed), and wherever a tqdm bar is open (in a log
    redirected to a file, an open bar's line has no newline yet)."""
    drawn = len(tqdm._instances) > 0  # (a disabled bar leaves them at once, a closed one too)
    return "\n" if drawn or sys.stderr.isatty() else ""


def stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & (select.POLLERR | select.POLLHUP) for _, event in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), no file (a test's)
        return False


class StoppedAndSaid(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM: `signum`) met where the code has already said what it kept and how
    to go on (distillation's translated chunks): run_main exits as for any stop, without its
    own "aborted" line, which would speak of checkpoints."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__()
        self.signum = signum


class ReportedElsewhere(Exception):
    """Under torchrun: rank 0 met a user's error while the others waited for it, and has
    printed the line. The others exit 2 without a word (no second line, no traceback)."""


def fail(prog: str, message: str, quiet: bool = False):
    """The one way a script reports a user's error: one line on stderr, exit code 2. `quiet`
    (a torchrun process other than rank 0, whose rank 0 meets the same error): no line, and a
    pause first, so that rank 0's line is out before torchrun sees a process fail and stops
    the others."""
    if quiet:
        time.sleep(10)  # torchrun usually ends this process sooner, when rank 0 exits
    else:
        for bar in list(tqdm._instances):  # an open bar ended first (its line, then a newline):
            bar.close()  # the error is a line of its own, the last (in a log too)
        sys.stderr.write(f"{prog}: error: {message}\n")
    sys.exit(2)


def run_main(prog: str, main, aborted: str = "aborted"):
    """Runs a script's `main`: a UserError becomes one line and exit 2, a stdout whose reader
    has gone a quiet exit 1, Ctrl-C one line and exit 130 (143 for a SIGTERM that aborts),
    wherever it lands (also while an error unwinds, as when a torchrun process's collective
    fails because another process was interrupted first). Under torchrun only rank 0 says
    "aborted"."""
    try:
        try:
            result = main()
            sys.stdout.flush()  # (a reader gone is met here, not in the exit's own flush)
            return result
        except UserError as e:
            fail(prog, str(e))
        except BrokenPipeError:
            if not stdout_gone():  # another pipe's: a failure to show
                raise
            # stdout's reader has gone (`translate.py ... | head -1`): no word, and no second
            # failure when the exit flushes stdout again (Python's own advice)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        except ReportedElsewhere:  # at once: rank 0 gone, this rank's process group is
            sys.stdout.flush()  # broken, and tearing it down at exit could abort the
            sys.stderr.flush()  # process (std::terminate, exit -6) before torchrun
            os._exit(2)  # reports rank 0's exit 2
    except KeyboardInterrupt as interrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C cannot cut the exit
        if is_main() and not isinstance(interrupt, StoppedAndSaid):
            sys.stderr.write(f"{below_a_bar()}{prog}: {aborted}\n")
            ABORT_SAID.set()
        # 130 for Ctrl-C; a SIGTERM turned into this interrupt (nmt.stopping.abort) says so: 143
        sys.exit(128 + int(getattr(interrupt, "signum", signal.SIGINT)))


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr and exit code 2 (no usage dump), and an unknown
    flag names the nearest one (`--data-dir`: did you mean --data_dir?). `leftover`: what the
    script says of words it has no place for (translate.py: one sentence an argument), or a
    function of the arguments parsed that says it. Under torchrun every process parses the same
    command line: rank 0 alone says what is wrong."""

    def __init__(self, *args, leftover: str = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.leftover = leftover
        self.given = []  # the arguments being parsed

    def parse_args(self, args=None, namespace=None):
        self.given = list(sys.argv[1:] if args is None else args)
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            self.error(self.unrecognized(extra, parsed))
        return parsed

    def unrecognized(self, extra: list, parsed=None) -> str:
        """What is wrong with the arguments left over: the first unknown flag, with the nearest
        known one; else the words, with `leftover`."""
        flags = [a.split("=")[0] for a in extra if a.startswith("-") and len(a) > 1
                 and not a[1:].replace(".", "", 1).isdigit()]  # (-1 and -0.5 are values)
        if flags:
            near = nearest_flag(flags[0], [o for o in self._option_string_actions
                                           if o.startswith("--")])
            return f"unrecognized argument {flags[0]}" + (f": did you mean {near}?" if near
                                                          else "")
        leftover = self.leftover(parsed) if callable(self.leftover) else self.leftover
        return f"unrecognized arguments: {' '.join(extra)}" + (f"; {leftover}" if leftover else "")

    def error(self, message):
        if message.startswith("the following arguments are required"):  # (checked first)
            unknown = self.unknown_flags()
            message = self.unrecognized(unknown) if unknown else message  # (a typo, not absent)
        self.refuse(f"{message} (see --help)")

    def unknown_flags(self) -> list:
        """The arguments being parsed that argparse reads as flags it does not know: not an
        abbreviation it takes (--ref for --reference), nor a word after "--" or with a space
        in it (which argparse reads as a positional argument)."""
        known, unknown = self._option_string_actions, []
        for a in self.given:
            if a == "--":
                break
            flag = a.split("=")[0]
            if a.startswith("--") and " " not in a and flag not in known and not (
                    self.allow_abbrev and any(o.startswith(flag) for o in known)):
                unknown.append(a)
        return unknown

    def refuse(self, message):
        """A command line refused for what it names (a checkpoint), not for its flags: the one
        line, from rank 0 alone under torchrun, and exit code 2."""
        under_torchrun = "WORLD_SIZE" in os.environ  # as nmt.runtime.start_distributed tells
        fail(self.prog, message, quiet=under_torchrun and not is_main())


def nearest_flag(typed: str, flags: list):
    """The known flag nearest to `typed` (dashes read as underscores: --data-dir is --data_dir),
    or None where none is near."""
    wanted = "--" + typed.lstrip("-").replace("-", "_")
    if wanted in flags:
        return wanted
    found = difflib.get_close_matches(wanted, flags, n=1, cutoff=0.75)
    return found[0] if found else None
