"""What a value must look like to be written into a generated script (launch.sh,
job.sbatch) or the files they read. Imports nothing of finetune but errors, so the schema
can use it.

A line break (or any control character) in a value would end a comment or `#SBATCH` line
and start a command of its own, so none is allowed anywhere; host names, partitions and
time limits must match their patterns whole (re.fullmatch: `$` also matches before a
trailing newline). Shell arguments are quoted besides (shlex.quote)."""

from __future__ import annotations

import ipaddress
import re

from finetune.errors import shown

# SLURM's limit on --signal's time before the end of the job.
MAX_SIGNAL_SECONDS = 65535
# Bounds far past any cluster, so absurd numbers are refused instead of written out.
MAX_MACHINES = 100_000
MAX_PROCESSES_PER_MACHINE = 1024
MAX_PROCESSES = 1_000_000
MAX_LENGTH = 2**31 - 1  # tokens in a sequence (and other counts kept in int32 tensors)
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
HOST_RE = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
IPV6_RE = re.compile(r"[0-9A-Fa-f:.]+(?:%[A-Za-z0-9_.-]+)?")
PARTITION_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}(?:,[A-Za-z0-9_.-]{1,64}){0,31}")
# SLURM's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (ASCII digits only).
_TIME_FORMS = (
    re.compile(r"(?P<m>[0-9]{1,7})"),
    re.compile(r"(?P<m>[0-9]{1,7}):(?P<s>[0-9]{1,2})"),
    re.compile(r"(?P<h>[0-9]{1,6}):(?P<m>[0-9]{1,2}):(?P<s>[0-9]{1,2})"),
    re.compile(r"(?P<d>[0-9]{1,5})-(?P<h>[0-9]{1,2})"),
    re.compile(r"(?P<d>[0-9]{1,5})-(?P<h>[0-9]{1,2}):(?P<m>[0-9]{1,2})"),
    re.compile(r"(?P<d>[0-9]{1,5})-(?P<h>[0-9]{1,2}):(?P<m>[0-9]{1,2}):(?P<s>[0-9]{1,2})"),
)


def control_problem(value: str) -> str | None:
    found = CONTROL.search(value)
    if found:
        return f"contains the control character {found.group()!r} (a line break, tab, NUL...)"
    return None


def host_problem(value: str) -> str | None:
    """Why `value` is not a host name, IPv4 or IPv6 address; None if it is one."""
    if ":" in value:
        if IPV6_RE.fullmatch(value):
            try:
                ipaddress.IPv6Address(value)
                return None
            except ValueError:
                pass
        return "not an IPv6 address"
    if re.fullmatch(r"[0-9.]+", value):
        try:
            ipaddress.IPv4Address(value)
            return None
        except ValueError:
            return "not an IPv4 address"
    if len(value) <= 253 and HOST_RE.fullmatch(value):
        return None
    return "not a host name or IP address (letters, digits, '-', '_' and dots)"


def partition_problem(value: str) -> str | None:
    if PARTITION_RE.fullmatch(value):
        return None
    return "not a partition name (letters, digits, '_', '.', '-'; several joined by commas)"


def time_seconds(value: str) -> int:
    """Seconds in a SLURM time limit; ValueError naming the forms and ranges otherwise."""
    for form in _TIME_FORMS:
        match = form.fullmatch(value)
        if match:
            parts = {k: int(v) for k, v in match.groupdict().items()}
            break
    else:
        raise ValueError(f"{shown(value)} is not a SLURM time limit: use MM, MM:SS, HH:MM:SS, "
                         "D-HH, D-HH:MM or D-HH:MM:SS")
    days, hours = parts.get("d", 0), parts.get("h", 0)
    minutes, secs = parts.get("m", 0), parts.get("s", 0)
    if secs > 59 or (minutes > 59 and ("h" in parts or "d" in parts)) or \
            (hours > 23 and "d" in parts):
        raise ValueError(f"{shown(value)}: seconds and minutes go up to 59, and hours up to 23 "
                         "after a day count")
    total = ((days * 24 + hours) * 60 + minutes) * 60 + secs
    if total == 0:
        raise ValueError(f"{shown(value)}: a time limit of 0 means no limit to SLURM; give one")
    return total


def slurm_time(seconds: int) -> str:
    """The canonical form written to job.sbatch: D-HH:MM:SS."""
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"
