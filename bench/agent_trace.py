"""Agent workloads for ``kvbench agents``: synthetic sessions, and a JSONL format for recorded ones.

A session is a series of turns; after each turn but the last the agent calls a tool and
stalls, then resumes with its whole history plus the tool's output. One JSON object per
line, one line per session:

    {"session": "s0", "arrival_s": 0.0, "critical": false,
     "turns": [{"input_tokens": 256, "output_tokens": 16, "tool": "search", "stall_s": 2.5},
               {"input_tokens": 96,  "output_tokens": 16, "tool": "code",   "stall_s": 0.8},
               {"input_tokens": 96,  "output_tokens": 16}]}

- ``arrival_s``: when the session's first turn arrives, from the start of the run;
- ``input_tokens``: tokens appended before the turn (the task for the first turn, after the
  shared system prompt; the tool's output for later ones); ``"input": "text"`` instead gives
  the text itself, tokenized by the served model's tokenizer;
- ``output_tokens``: tokens the turn generates (greedy, end-of-sequence ignored, so every
  mode generates the same number);
- ``tool``, ``stall_s``: the tool called after the turn and how long it ran; ``expected_s``
  (optional, default ``stall_s``) is the duration a ``pause`` event announces.

Synthetic stalls are log-normal (heavy-tailed: the mean is well above the median), capped.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

TOOLS = ("search", "code", "browse", "human")
TOOL_SCALE = {"search": 1.0, "code": 0.6, "browse": 1.6, "human": 3.0}  # median multipliers per tool


@dataclass
class Turn:
    input_tokens: int = 0
    output_tokens: int = 16
    tool: str = ""
    stall_s: float = 0.0
    expected_s: float | None = None
    input: str | None = None

    @property
    def announced_s(self) -> float:
        return self.stall_s if self.expected_s is None else self.expected_s


@dataclass
class AgentSession:
    session: str
    arrival_s: float
    turns: list[Turn] = field(default_factory=list)
    critical: bool = False


def synthetic(sessions: int, turns: int, task_tokens: int, tool_tokens: int, output_tokens: int,
              stall_median_s: float, stall_sigma: float, stall_max_s: float, arrival_gap_s: float,
              seed: int) -> list[AgentSession]:
    """``sessions`` sessions of ``turns`` turns, Poisson arrivals ``arrival_gap_s`` apart on average,
    log-normal stalls around ``stall_median_s`` (times the tool's scale), capped at ``stall_max_s``."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(sessions):
        session = AgentSession(f"s{i}", round(t, 3))
        for j in range(turns):
            last = j == turns - 1
            tool = "" if last else rng.choice(TOOLS)
            stall = 0.0 if last else min(stall_max_s, rng.lognormvariate(
                math.log(stall_median_s * TOOL_SCALE[tool]), stall_sigma))
            session.turns.append(Turn(task_tokens if j == 0 else tool_tokens, output_tokens, tool, round(stall, 3)))
        out.append(session)
        t += rng.expovariate(1 / arrival_gap_s) if arrival_gap_s > 0 else 0.0
    return out


def load_jsonl(path: str | Path) -> list[AgentSession]:
    """Sessions from a JSONL trace (format above); a bad line is a ValueError naming it."""
    sessions = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            turns = [Turn(**t) for t in obj["turns"]]
            session = AgentSession(str(obj["session"]), float(obj.get("arrival_s", 0.0)), turns,
                                   bool(obj.get("critical", False)))
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}:{n}: not an agent session ({exc})") from None
        if not turns or any(t.output_tokens < 1 or t.stall_s < 0 or (t.input is None and t.input_tokens < 0)
                            for t in turns):
            raise ValueError(f"{path}:{n}: a session needs turns with output_tokens >= 1 and stall_s >= 0")
        sessions.append(session)
    if not sessions:
        raise ValueError(f"{path}: no sessions")
    return sessions


def dump_jsonl(sessions: list[AgentSession], path: str | Path) -> None:
    lines = []
    for s in sessions:
        d = asdict(s)
        d["turns"] = [{k: v for k, v in t.items() if v is not None} for t in d["turns"]]
        lines.append(json.dumps(d))
    Path(path).write_text("\n".join(lines) + "\n")
