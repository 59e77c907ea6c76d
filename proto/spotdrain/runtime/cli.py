"""What every entry point shares: one-line usage errors with exit code 2, address parsing."""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn

USAGE_ERROR = 2


class UsageError(Exception):
    """A bad flag or config: one clear line, exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage block; operators' scripts want one line.
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(USAGE_ERROR)


def host_port(value: str, what: str = "address") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"{what} must be HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def fail_usage(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return USAGE_ERROR


def seconds(low: float, high: float):
    """An argparse type for a duration or share: a finite number within [low, high] (NaN and
    infinity are refused: NaN never compares, so a deadline computed from it never fires)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value) or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be a finite number between {low:g} and {high:g}, got {text!r}"
            )
        return value

    return parse


def add_bounded(
    p: argparse.ArgumentParser, flag: str, low: float, high: float, default: float, help: str
) -> None:
    """An option taking a finite number within [low, high] (see `seconds`); its help ends with
    the default."""
    p.add_argument(
        flag, type=seconds(low, high), default=default, help=f"{help} (default {default:g})"
    )
