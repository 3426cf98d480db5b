"""Multi-tenant workload mixes: tenants with different reuse shapes, sizes and lifetimes.

``bench/synthetic.py`` draws every request from one mix of request kinds. Real serving
fleets host tenants that differ more than that, and a policy that wins on one shape can
lose on another; these mixes are built to find out. A mix is a list of tenants, each of
one kind, with a share of the traffic while it is active and an active window (a tenant
may appear or leave mid-trace):

- ``docqa``: questions over the tenant's document corpus (Zipf popularity, documents of
  varied length); some users ask follow-ups on the same document after reading the answer;
- ``chat``: multi-turn conversations, each turn extending the previous prompt, with think
  time between turns (the user reads the answer);
- ``agent``: coding agents working in one of the tenant's repositories: a long repository
  prefix shared by every session on it, then a session history that grows by tool outputs
  at every step, steps following each other quickly;
- ``batch``: a job that reads a corpus of documents once each (summarisation, labelling):
  nothing comes back, the scan only pollutes caches;
- ``oneoff``: unique prompts.

Requests end with a unique partly filled block where the kind's prompts have one (chat
turns and agent steps usually do; a document question is unique anyway). Ids are interned
``(parent id, content)`` pairs, so equal ids mean equal prefixes, and every request is
labelled with its tenant's kind, which ``kvbench replay`` reports TTFT by.

Mixes are named presets (``PRESETS``); ``workload:NAME[:key=value,...]`` loads one with
``requests`` and ``seed`` overridden. Everything is drawn from one seeded generator.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field, replace
from typing import Callable, Hashable

from bench.synthetic import Interner
from bench.traces import Trace

KINDS = ("docqa", "chat", "agent", "batch", "oneoff")


@dataclass(frozen=True)
class TenantSpec:
    kind: str
    share: float  # relative request rate while active
    start: float = 0.0  # active over [start, end) as fractions of the trace
    end: float = 1.0
    system_blocks: int = 2
    # docqa: corpus; agent: repositories; batch: documents per job pass
    corpus: int = 1000
    blocks: tuple[int, int] = (4, 24)  # document (docqa, batch) or repository (agent) length range
    zipf: float = 1.0  # popularity skew of documents or repositories
    followup: float = 0.0  # docqa: share of questions that follow up an earlier one on the same document
    open_sessions: int = 200  # chat conversations or agent sessions open at once
    mean_turns: float = 5.0  # turns (chat) or steps (agent) per session, geometric
    turn_blocks: tuple[int, int] = (1, 3)  # blocks a turn or step adds
    think: float = 0.0  # mean requests (of the whole mix) between a session's turns, gamma(2)
    partial_tail: float = 0.9  # chance that a request ends with a unique partly filled block


@dataclass(frozen=True)
class MixSpec:
    tenants: tuple[TenantSpec, ...]
    requests: int = 20000
    seed: int = 1


@dataclass
class _Session:
    """A chat conversation, an agent's session or a document's follow-up thread."""

    history: list[Hashable]
    ready: float = 0.0


@dataclass
class _Tenant:
    spec: TenantSpec
    tid: int
    rng: random.Random
    cum_weights: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    sessions: list[_Session] = field(default_factory=list)
    unique: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        s = self.spec
        self.cum_weights = list(itertools.accumulate(1.0 / (r + 1) ** s.zipf for r in range(s.corpus)))
        self.lengths = [self.rng.randint(*s.blocks) for _ in range(s.corpus)]

    def _fresh(self) -> tuple:
        return ("u", self.tid, next(self.unique))

    def _system(self) -> list[Hashable]:
        return [("sys", self.tid, i) for i in range(self.spec.system_blocks)]

    def _pick(self) -> int:
        return self.rng.choices(range(self.spec.corpus), cum_weights=self.cum_weights)[0]

    def _item(self, index: int, tag: str = "doc") -> list[Hashable]:
        return [(tag, self.tid, index, j) for j in range(self.lengths[index])]

    def _session(self, now: int, start: Callable[[], list[Hashable]]) -> _Session:
        """A ready session to continue, or a new one (``start()`` gives its first blocks)."""
        s, rng = self.spec, self.rng
        ready = [x for x in self.sessions if x.ready <= now]
        if len(self.sessions) < s.open_sessions or not ready or rng.random() < 1 / s.mean_turns:
            session = _Session(start())
            self.sessions.append(session)
        else:
            session = ready[rng.randrange(len(ready))]
        session.ready = now + (rng.gammavariate(2.0, s.think / 2) if s.think > 0 else 0.0)
        return session

    def _continue(self, session: _Session) -> list[Hashable]:
        lo, hi = self.spec.turn_blocks
        session.history += [self._fresh() for _ in range(self.rng.randint(lo, hi))]
        prompt = list(session.history)
        if self.rng.random() < 1 / self.spec.mean_turns:
            self.sessions.remove(session)
        return prompt

    def request(self, now: int) -> list[Hashable]:
        s, rng = self.spec, self.rng
        if s.kind == "docqa":
            if s.followup > 0 and rng.random() < s.followup:
                session = self._session(now, lambda: self._item(self._pick()))
                return self._system() + self._continue(session)
            return self._system() + self._item(self._pick()) + [self._fresh()]
        if s.kind == "chat":
            return self._system() + self._continue(self._session(now, list)) + self._tail()
        if s.kind == "agent":
            session = self._session(now, lambda: self._item(self._pick(), "repo") + [self._fresh()])
            return self._system() + self._continue(session) + self._tail()
        if s.kind == "batch":
            return self._system() + [self._fresh() for _ in range(rng.randint(*s.blocks))] + [self._fresh()]
        if s.kind == "oneoff":
            return [self._fresh() for _ in range(rng.randint(*s.blocks))] + self._tail()
        raise ValueError(f"unknown tenant kind {s.kind!r}; known: {', '.join(KINDS)}")

    def _tail(self) -> list[Hashable]:
        return [self._fresh()] if self.rng.random() < self.spec.partial_tail else []


def generate(spec: MixSpec) -> tuple[list[list[int]], list[str]]:
    """The requests of a mix and each request's tenant kind."""
    rng = random.Random(spec.seed)
    tenants = [_Tenant(t, i, random.Random(rng.random())) for i, t in enumerate(spec.tenants)]
    interner = Interner()
    requests, kinds = [], []
    for now in range(spec.requests):
        at = now / spec.requests
        active = [t for t in tenants if t.spec.start <= at < t.spec.end]
        if not active:
            raise ValueError(f"no tenant is active at {at:.3f} of the trace")
        tenant = rng.choices(active, weights=[t.spec.share for t in active])[0]
        requests.append(interner.chain(tenant.request(now)))
        kinds.append(tenant.spec.kind)
    return requests, kinds


T = TenantSpec
PRESETS: dict[str, MixSpec] = {
    # Document QA over corpora of different sizes, chat and coding agents; tenants from 40%
    # of the traffic down to 2%.
    "saas": MixSpec((
        T("chat", 0.40, think=150, open_sessions=400),
        T("docqa", 0.15, corpus=3000, zipf=0.9, followup=0.2, think=100),
        T("agent", 0.12, corpus=40, blocks=(20, 80), zipf=1.1, mean_turns=12, think=8, open_sessions=60),
        T("chat", 0.10, think=40, open_sessions=80, mean_turns=3),
        T("docqa", 0.08, corpus=300, blocks=(8, 40), zipf=1.3),
        T("agent", 0.05, corpus=5, blocks=(60, 160), zipf=0.6, mean_turns=25, think=4, open_sessions=20),
        T("oneoff", 0.06, blocks=(1, 30)),
        T("chat", 0.02, think=400, open_sessions=50, mean_turns=8),
        T("docqa", 0.02, corpus=50, blocks=(30, 60), zipf=0.5),
    )),
    # Coding agents with long repository prefixes, beside batch scans of unique documents.
    "agents": MixSpec(requests=8000, tenants=(
        T("agent", 0.45, corpus=120, blocks=(30, 120), zipf=1.0, mean_turns=15, think=10, open_sessions=120),
        T("agent", 0.15, corpus=8, blocks=(100, 200), zipf=0.7, mean_turns=30, think=3, open_sessions=15),
        T("batch", 0.25, blocks=(10, 40)),
        T("chat", 0.15, think=80, open_sessions=150),
    )),
    # Tenants that appear and leave mid-trace: a chat service winds down, a document
    # assistant launches, a batch job runs through the middle, an agent fleet ramps up late.
    "phases": MixSpec((
        T("chat", 0.50, end=0.55, think=120, open_sessions=300),
        T("chat", 0.20, think=60, open_sessions=100, mean_turns=4),
        T("docqa", 0.40, start=0.30, corpus=2000, zipf=1.1, followup=0.3, think=60),
        T("batch", 0.60, start=0.40, end=0.60, blocks=(8, 30)),
        T("agent", 0.50, start=0.65, corpus=30, blocks=(40, 100), zipf=1.0, mean_turns=10, think=6, open_sessions=50),
        T("oneoff", 0.05),
    )),
    # A large chat tenant and a small hot document tenant, with a batch scan every so often.
    "scan": MixSpec((
        T("chat", 0.55, think=200, open_sessions=500, mean_turns=6),
        T("docqa", 0.10, corpus=100, blocks=(10, 30), zipf=1.2),
        *(T("batch", 2.0, start=a, end=a + 0.04, blocks=(5, 25)) for a in (0.15, 0.35, 0.55, 0.75)),
        T("oneoff", 0.05),
    )),
    # Chat alone, in the shape of the Mooncake trace: long first prompts (system prompt and
    # pasted material), a few blocks per turn, minutes of think time, many conversations.
    "chat": MixSpec((
        T("chat", 0.90, system_blocks=3, think=400, open_sessions=1500, mean_turns=4, turn_blocks=(1, 6)),
        T("oneoff", 0.10, blocks=(1, 40)),
    )),
    # Held out for issue 17 (written before any policy ran on it): a fleet whose agent tenant
    # leaves at 70% of the trace, a large slow-reading document assistant with many
    # follow-ups, long chat conversations, a small very hot corpus that starts late and a
    # batch job in the second half.
    "fleet": MixSpec(requests=15000, seed=11, tenants=(
        T("agent", 0.30, end=0.70, corpus=20, blocks=(40, 150), zipf=0.8, mean_turns=20, think=20, open_sessions=80),
        T("docqa", 0.25, corpus=5000, zipf=0.8, followup=0.4, think=300),
        T("chat", 0.25, think=600, open_sessions=800, mean_turns=6, turn_blocks=(2, 5)),
        T("batch", 0.10, start=0.50, blocks=(20, 60)),
        T("docqa", 0.10, start=0.20, corpus=200, blocks=(20, 50), zipf=1.5),
        T("oneoff", 0.05, blocks=(5, 50)),
    )),
}
del T


def parse_spec(spec: str) -> MixSpec:
    """``workload:NAME`` or ``workload:NAME:requests=N,seed=S``."""
    _, _, rest = spec.partition(":")
    name, _, options = rest.partition(":")
    if name not in PRESETS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(PRESETS)}")
    values = {}
    for item in filter(None, options.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in ("requests", "seed"):
            raise ValueError(f"bad workload option {item!r}; known: requests, seed")
        try:
            values[key] = int(value)
        except ValueError:
            raise ValueError(f"workload option {key} needs an integer, got {value!r}") from None
    return replace(PRESETS[name], **values)


def generate_from_spec(spec: str) -> Trace:
    requests, kinds = generate(parse_spec(spec))
    return Trace(spec, requests, kinds)
