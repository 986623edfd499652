"""Errors a user can cause, and the helpers that phrase them.

Every such error is a `UserError`; the CLI prints its message as one line on stderr and exits
with code 2, with no traceback. Messages name the field, the value, the rule and the fix:

    raise UserError("train.lr", -0.1, "must be > 0", "use a positive learning rate such as 3e-4")
    # -> train.lr=-0.1: must be > 0; use a positive learning rate such as 3e-4
"""
from __future__ import annotations

import difflib
from typing import Any, Iterable

EXIT_USER_ERROR = 2


class UserError(ValueError):
    """A mistake in user input (config, flag, file); printed as one line, exit code 2."""

    def __init__(self, field: str, value: Any = None, rule: str = "", fix: str = ""):
        self.field, self.value, self.rule, self.fix = field, value, rule, fix
        head = field if value is None else f"{field}={value!r}" if isinstance(value, str) else f"{field}={value}"
        text = head + (f": {rule}" if rule else "") + (f"; {fix}" if fix else "")
        super().__init__(" ".join(text.split()))  # one line, whatever the parts held


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """'did you mean 'steps'?' for the closest choice, else the list of valid choices."""
    choices = sorted(choices)
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    return "valid: " + ", ".join(choices)


def divide(numerator: int, denominator: int, *, what: str) -> int:
    """numerator / denominator, or a UserError naming `what` when it does not divide evenly.

    The one helper for every split (batch over ranks, heads over tensor-parallel ranks, ...).
    """
    if denominator <= 0 or numerator % denominator:
        raise UserError(what, numerator, f"is not divisible by {denominator}",
                        f"choose a multiple of {denominator}")
    return numerator // denominator


def raised_in(err: BaseException, *modules: str) -> bool:
    """Whether the innermost frame of `err`'s traceback runs code of one of `modules` (a module's
    name, or a package's: "deepspeed" covers deepspeed.runtime.config). What tells a library's
    refusal of bad input (turned into a UserError) from a bug of ours (left a traceback).

        raised_in(err, "torch", "deepspeed")
    """
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    name = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
    return any(name == m or name.startswith(m + ".") for m in modules)
