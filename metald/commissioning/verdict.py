"""What every check comes down to: a status, the values it measured, and one sentence."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Status(StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"  # the tool or the hardware is absent and the profile does not need it
    ERROR = "error"  # the check could not run or its output could not be read


@dataclass(frozen=True)
class Verdict:
    status: Status
    sentence: str
    values: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status in (Status.PASSED, Status.SKIPPED)


def passed(sentence: str, **values: Any) -> Verdict:
    return Verdict(Status.PASSED, sentence, values)


def failed(problems: list[str], **values: Any) -> Verdict:
    return Verdict(Status.FAILED, "; ".join(problems), values)


def skipped(sentence: str, **values: Any) -> Verdict:
    return Verdict(Status.SKIPPED, sentence, values)


def error(sentence: str, **values: Any) -> Verdict:
    return Verdict(Status.ERROR, sentence, values)


def judge(problems: list[str], ok_sentence: str, **values: Any) -> Verdict:
    """Failed with the problems joined in one sentence, or passed with ``ok_sentence``."""
    return failed(problems, **values) if problems else passed(ok_sentence, **values)
