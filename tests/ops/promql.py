"""The metric names a PromQL expression reads (for checking rules and dashboards against a scrape)."""

from __future__ import annotations

import re

_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
}
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()")
_GRAFANA_VARS = re.compile(r"\$\{?\w+(:\w+)?\}?")


def metric_names(expr: str) -> set[str]:
    """Every series name ``expr`` selects (label names, functions and keywords left out)."""
    e = _GRAFANA_VARS.sub("1m", expr)
    e = _STRINGS.sub('""', e)
    e = _MATCHERS.sub("", e)
    e = _RANGES.sub("", e)
    e = _GROUPING.sub("", e)
    return {n for n in _NAME.findall(e) if n not in _KEYWORDS and not re.fullmatch(r"\d\w*", n)}
