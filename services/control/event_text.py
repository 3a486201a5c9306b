"""One sentence per recorded run event (the dashboard's event list, the API's ``text``).

:func:`describe` maps each kind the run engine (:mod:`services.supervise.events`) and the control
plane (states, stops, re-attaches, shared-queue news) record to a sentence; a kind it does not
know reads as one compact ``kind key=value ...`` line.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Callable
from typing import Any

MAX_CHARS = 400  # a sentence longer than this is cut (reasons can carry long paths)


def describe(kind: str, data: dict[str, Any] | None) -> str:
    """The sentence of one event.

    Args:
        kind: the event's kind (``restarted``, ``state`` ...).
        data: its payload as recorded.

    Returns:
        One line, at most :data:`MAX_CHARS` characters; unknown kinds (or payloads a sentence
        cannot be made of) give ``kind key=value ...``.
    """
    data = data if isinstance(data, dict) else {}
    make = SENTENCES.get(kind)
    text = None
    if make is not None:
        try:
            text = make(data)
        except (KeyError, TypeError, ValueError):
            text = None  # a payload of another shape (an older record): the compact line
    if text is None:
        text = _compact(kind, data)
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 3] + "..."


def _compact(kind: str, data: dict[str, Any]) -> str:
    parts = [kind]
    for key, value in data.items():
        shown = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
        parts.append(f"{key}={shown}")
    return " ".join(parts)


def exit_phrase(code: int | None) -> str:
    """``exit 137``, ``SIGKILL`` (negative codes: killed by that signal) or ``an unknown exit``.

    Args:
        code: an exit code as the launcher reports it.
    """
    if code is None:
        return "an unknown exit"
    if code >= 0:
        return f"exit {code}"
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _attempt(data: dict[str, Any]) -> str:
    attempt, budget = data.get("attempt"), data.get("max_restarts")
    if not attempt:
        return ""
    return f" (attempt {attempt} of {budget})" if budget else f" (attempt {attempt})"


def _role_of(process: str) -> str:
    """``trainer1`` -> ``trainer``: process names are their role and an index."""
    return re.sub(r"\d+$", "", process)


def _what_restarts(data: dict[str, Any]) -> str:
    process, scope = str(data["process"]), data.get("scope")
    if scope == "group":
        return f"every {_role_of(process)} rank"
    if scope == "run":
        return "the whole run"
    return process


def _why(data: dict[str, Any]) -> str:
    """What caused a restart, from the process's side."""
    process, code = str(data["process"]), data.get("code")
    if code is None:
        return f"{process} lost what it held"
    if code < 0:
        return f"{process} was killed by {exit_phrase(code)}"
    return f"{process} exited with code {code}"


def _state(d: dict[str, Any]) -> str:
    state = str(d["state"])
    text = f"run resumed: {state}" if d.get("resume") else f"run {state}"
    if d.get("reason"):
        text += f": {d['reason']}"
    if d.get("failed_process"):
        text += f" ({d['failed_process']}, {exit_phrase(d.get('exit_code'))})"
    elif state == "RECOVERING" and d.get("attempt"):
        text += f" (attempt {d['attempt']})"
    return text


def _launched(d: dict[str, Any]) -> str:
    queue = d.get("queue")
    return "every process launched" + (f" on queue {queue}" if queue else "")


def _exited(d: dict[str, Any]) -> str:
    process, role, code = d["process"], d.get("role"), d["code"]
    who = f"{process} ({role})" if role and role != process else str(process)
    if code == 0:
        return f"{who} exited normally"
    if code < 0:
        return f"{who} was killed by {exit_phrase(code)}"
    return f"{who} exited with code {code}"


def _unresponsive(d: dict[str, Any]) -> str:
    return f"{d['process']} (pid {d['pid']}) was unresponsive ({d['reason']}) and was killed"


def _recovering(d: dict[str, Any]) -> str:
    then = f"{_what_restarts(d)} restarts in {float(d.get('delay_s') or 0.0):g} s{_attempt(d)}"
    if d.get("code") is not None:
        return f"{_why(d)}; {then}"
    return f"{then}: {d['reason']}"  # nothing exited (or an older record): the policy's reason


def _restarted(d: dict[str, Any]) -> str:
    process, scope = str(d["process"]), d.get("scope")
    company = {"group": f", with every {_role_of(process)} rank", "run": ", with the whole run"}
    along = company.get(scope, "")
    if "code" not in d:  # an older record: no cause
        return f"{process} restarted{along}{_attempt(d)}"
    if d["code"] is None:
        return f"{_what_restarts(d)} restarted after {_why(d)}{_attempt(d)}"
    return f"{process} restarted after {exit_phrase(d['code'])}{along}{_attempt(d)}"


def _failed(d: dict[str, Any]) -> str:
    return f"run failed on {d['process']} ({exit_phrase(d.get('code'))}): {d['reason']}"


def _data_complete(d: dict[str, Any]) -> str:
    return f"the collators finished: {int(d['samples']):,} samples in the epoch"


def _stop_requested(d: dict[str, Any]) -> str:
    grace = d.get("grace_s")
    return "stop requested" + (
        f": the trainers get {float(grace):g} s to checkpoint" if grace is not None else ""
    )


def _resumed(d: dict[str, Any]) -> str:
    left = f"resumed from {d['from_state']}"
    if d.get("checkpoint") is None:
        return f"{left} with no checkpoint: training starts over"
    if d.get("step") is None:
        return f"{left} at checkpoint {d['checkpoint']}"
    return f"{left} at the checkpoint of step {d['step']}"


def _reattached(d: dict[str, Any]) -> str:
    names = ", ".join(str(n) for n in d["processes"])
    return f"re-attached after a control-plane restart: {names}"


def _queue_restarted(d: dict[str, Any]) -> str:
    kept = "durable" if d.get("durable") else "not durable"
    return (
        f"queue {d['address']} restarted (instance {d['old_epoch']} -> {d['new_epoch']}, "
        f"{kept}); action: {d['action']}"
    )


def _queue_unreachable(d: dict[str, Any]) -> str:
    return f"queue {d['address']} unreachable for {float(d['down_s']):g} s: {d['error']}"


def _relaunched(d: dict[str, Any]) -> str:
    return f"run started again: {d['reason']}"


# kind -> its sentence; the engine's kinds (services.supervise.events) and the control plane's
SENTENCES: dict[str, Callable[[dict[str, Any]], str]] = {
    "state": _state,
    "launched": _launched,
    "exited": _exited,
    "unresponsive": _unresponsive,
    "recovering": _recovering,
    "restarted": _restarted,
    "failed": _failed,
    "data_complete": _data_complete,
    "stop_requested": _stop_requested,
    "resumed": _resumed,
    "reattached": _reattached,
    "relaunched": _relaunched,
    "queue_restarted": _queue_restarted,
    "queue_unreachable": _queue_unreachable,
}
