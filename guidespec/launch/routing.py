"""Which data-parallel replica serves a request: the one most likely to hold its prompt's prefix
in its KV cache and its grammar compiled, bounded by load (``CacheAwareRouter``), or the next
in turn (``RoundRobinRouter``, the baseline).

The router keeps what it has sent where: the chain hashes of each prompt's first full blocks
(``prefix_hashes``: block ``i``'s hash covers every token before it, as the engines' own prefix
cache keys its blocks) and each grammar's key, each mapped to the replicas that were sent them.
A request goes to the replica that was sent the longest run of its leading blocks; with none,
to the replica holding the fewest prefixes (each prefix draws its own stream of requests: placing
them evenly spreads the load that affinity will keep there), then the fewest blocks, then one that
was sent its grammar (compiled there; the others load it from the shared grammar store), then its
prefix's *home*: the replica that ranks first for the hash of its first block (rendezvous
hashing: routers that share no state send a prefix to the same replica). Among replicas that
hold as much of a prompt, it goes to the one last sent that prefix: a prefix that spilled moves
with its spill (the busy replica it left is relieved for good, and its cache turns over to its
other prefixes) instead of returning to its first replica whenever that one has room; a spill
goes, as a new prefix does, to the replica holding the fewest prefixes.
Affinity yields to load: a replica is taken only while its requests in flight, with this one,
stay within ``balance`` times the mean, or one past the mean at small loads (consistent hashing
with bounded loads); a prefix then spills over to the next replica, which learns it too. A
*hot* prefix (more of the last 64 requests than a replica's share) held as far by several
replicas is held to one past the mean instead: moving on costs it no cache hit, so it is shared
by load rather than piled up to the bound. A replica that dies is forgotten (its caches died
with it).

Pure bookkeeping, no I/O: the local group (``entrypoints.data_parallel.EngineGroup``) and the Ray Serve
request router (``entrypoints.ray_serve``) drive it with their replicas' names and loads.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import Counter, OrderedDict, deque
from typing import Any, Mapping, Sequence

ROUTING_POLICIES = ("cache_aware", "round_robin")
_RECENT = 64  # requests over which a prefix's share of the traffic is counted (hot or not)


def prefix_hashes(prompt_ids: Sequence[int], block_size: int, max_blocks: int) -> list[int]:
    """The chain hashes of the prompt's first ``max_blocks`` full blocks: equal hashes mean
    equal tokens from the prompt's start to that block's end."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, min(len(prompt_ids) // block_size, max_blocks) * block_size, block_size):
        previous = hash((previous, tuple(prompt_ids[start : start + block_size])))
        hashes.append(previous)
    return hashes


def _rank(key: int | str, replica: str) -> bytes:
    """Rendezvous hashing's weight of ``replica`` for ``key``: the same in every process."""
    return hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest()


class CacheAwareRouter:
    """``choose`` a replica for a request, then ``routed`` once it was sent there (a caller may
    send it elsewhere: to the replica the request was sent, whichever that was); ``forget`` a
    replica whose engine died."""

    def __init__(
        self, block_size: int = 16, max_blocks: int = 256, balance: float = 1.5, max_entries: int = 200_000
    ) -> None:
        check_balance(balance)
        self.block_size, self.max_blocks, self.balance, self.max_entries = block_size, max_blocks, balance, max_entries
        self._blocks: OrderedDict[int, set[str]] = OrderedDict()  # block hash -> replicas sent it (LRU)
        self._grammars: OrderedDict[str, set[str]] = OrderedDict()  # grammar key -> replicas sent it (LRU)
        self._held: Counter[str] = Counter()  # blocks each replica was sent (that the tables still hold)
        self._firsts: set[int] = set()  # the hashes that are a prompt's first block: a prefix's identity
        self._tenants: Counter[str] = Counter()  # prefixes (first blocks) each replica was sent
        self._recent: deque[int] = deque(maxlen=_RECENT)  # the last requests' first blocks
        self._last: dict[int, str] = {}  # first block -> the replica last sent it
        self._recent_count: Counter[int] = Counter()
        self.decisions: Counter[str] = Counter()  # why each request went where it went

    def choose(
        self, replicas: Sequence[str], loads: Mapping[str, float], prompt_ids: Sequence[int], grammar_key: str = ""
    ) -> str:
        """The replica for a request; ``loads``: each replica's requests in flight."""
        if not replicas:
            raise ValueError("no replica to route to")
        hashes = prefix_hashes(prompt_ids, self.block_size, self.max_blocks)
        matched = self._matched_blocks(hashes, replicas)
        has_grammar = self._grammars.get(grammar_key, set()) if grammar_key else set()
        home: int | str = hashes[0] if hashes else grammar_key or hash(tuple(prompt_ids))

        def preference(replica: str) -> tuple[int, tuple[int, int], bool, bool, bytes]:
            # those holding the most of the prompt first, among them the one last sent it; then
            # (a prompt nobody holds, or a spill) the replica with the fewest prefixes (as many
            # requests come for each, as far as it knows: the most room in its cache), then
            # holding the fewest blocks; then one that has its grammar, then its home
            size = (self._tenants[replica], self._held[replica]) if replica not in matched else (0, 0)
            last = self._last.get(hashes[0]) != replica if hashes else True
            return (-matched.get(replica, 0), size, last, replica not in has_grammar, _rank(home, replica))

        ordered = sorted(replicas, key=preference)
        mean = (sum(max(0.0, loads.get(r, 0.0)) for r in replicas) + 1) / len(replicas)  # this request included
        bound = max(math.ceil(mean) + 1, math.floor(self.balance * mean))  # (one past the mean, at least)
        # a hot prefix (more of the recent requests than a replica's share) that several replicas
        # hold as far: moving on costs no hit, so its holders are left one past the mean
        hot = bool(hashes) and self._recent_count[hashes[0]] * len(replicas) > len(self._recent)
        longest = max(matched.values(), default=0)
        shared = hot and sum(1 for n in matched.values() if n == longest) > 1
        for replica in ordered:
            limit = min(bound, math.ceil(mean) + 1) if shared and matched.get(replica) == longest else bound
            if loads.get(replica, 0.0) + 1 <= limit:
                self.decisions[self._reason(replica, matched, has_grammar, ordered)] += 1
                return replica
        chosen = min(replicas, key=lambda r: (loads.get(r, 0.0), preference(r)))
        self.decisions["load"] += 1
        return chosen

    def routed(self, replica: str, prompt_ids: Sequence[int], grammar_key: str = "") -> None:
        """``replica`` was sent this prompt (and grammar): it holds them from now on."""
        hashes = prefix_hashes(prompt_ids, self.block_size, self.max_blocks)
        if hashes:
            self._last[hashes[0]] = replica
            if len(self._recent) == self._recent.maxlen:
                oldest = self._recent[0]
                self._recent_count[oldest] -= 1
                if not self._recent_count[oldest]:
                    del self._recent_count[oldest]
            self._recent.append(hashes[0])
            self._recent_count[hashes[0]] += 1
        for i, h in enumerate(hashes):
            owners = self._blocks.get(h)
            if i == 0:
                self._firsts.add(h)
                if owners is None or replica not in owners:
                    self._tenants[replica] += 1
            if owners is None:
                self._blocks[h] = {replica}
                self._held[replica] += 1
                while len(self._blocks) > self.max_entries:
                    gone, owners_of_gone = self._blocks.popitem(last=False)
                    first = gone in self._firsts
                    self._firsts.discard(gone)
                    self._last.pop(gone, None)
                    for owner in owners_of_gone:
                        self._held[owner] -= 1
                        self._tenants[owner] -= first
            else:
                if replica not in owners:
                    owners.add(replica)
                    self._held[replica] += 1
                self._blocks.move_to_end(h)
        if grammar_key:
            owners = self._grammars.get(grammar_key)
            if owners is None:
                self._grammars[grammar_key] = {replica}
                while len(self._grammars) > self.max_entries:
                    self._grammars.popitem(last=False)
            else:
                owners.add(replica)
                self._grammars.move_to_end(grammar_key)

    def forget(self, replica: str) -> None:
        """``replica``'s caches are gone (its engine died, or it was removed)."""
        for table in (self._blocks, self._grammars):
            _discard(table, replica)
        self._held.pop(replica, None)
        self._tenants.pop(replica, None)
        self._firsts.intersection_update(self._blocks)
        self._last = {first: last for first, last in self._last.items() if last != replica}

    def _matched_blocks(self, hashes: list[int], replicas: Sequence[str]) -> dict[str, int]:
        """How many of the prompt's leading blocks each replica was sent."""
        alive = set(replicas)
        matched: dict[str, int] = {}
        for i, h in enumerate(hashes):
            owners = self._blocks.get(h)
            extended = [r for r in (owners or ()) if r in alive and matched.get(r, 0) == i]
            if not extended:
                break
            for r in extended:
                matched[r] = i + 1
        return matched

    def _reason(self, replica: str, matched: dict[str, int], has_grammar: set[str], ordered: list[str]) -> str:
        if replica != ordered[0]:
            return "spill"  # the preferred replica was too loaded
        if matched.get(replica):
            return "prefix"
        return "grammar" if replica in has_grammar else "home"


def _discard(table: OrderedDict, replica: str) -> None:  # type: ignore[type-arg]
    for key in [k for k, owners in table.items() if replica in owners]:
        table[key].discard(replica)
        if not table[key]:
            del table[key]


class RoundRobinRouter:
    """Each request to the next replica in turn, whatever it holds (the baseline)."""

    def __init__(self) -> None:
        self._turn = itertools.count()
        self.decisions: Counter[str] = Counter()

    def choose(
        self, replicas: Sequence[str], loads: Mapping[str, float], prompt_ids: Sequence[int], grammar_key: str = ""
    ) -> str:
        if not replicas:
            raise ValueError("no replica to route to")
        self.decisions["round_robin"] += 1
        return sorted(replicas)[next(self._turn) % len(replicas)]

    def routed(self, replica: str, prompt_ids: Sequence[int], grammar_key: str = "") -> None:
        pass

    def forget(self, replica: str) -> None:
        pass


Router = CacheAwareRouter | RoundRobinRouter


DEFAULT_BALANCE = 1.5


def check_balance(balance: object) -> float:
    """``balance`` as a load bound: a number >= 1 (a multiple of the mean load), else ValueError."""
    if isinstance(balance, bool) or not isinstance(balance, (int, float)) or not balance >= 1 or balance == math.inf:
        raise ValueError(f"the routing balance must be a number >= 1 (a multiple of the mean load), got {balance!r}")
    return float(balance)


def make_router(policy: str, block_size: int = 16, balance: float = DEFAULT_BALANCE) -> Router:
    if policy == "cache_aware":
        return CacheAwareRouter(block_size=block_size, balance=balance)
    if policy == "round_robin":
        return RoundRobinRouter()
    raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")


def grammar_key_of(params: object) -> str:
    """The routing key of a request's grammar (its canonical form), or "" when it has none."""
    guided = getattr(params, "guided", None)
    if guided is None:
        return ""
    try:
        return str(guided.cache_key(""))
    except Exception:  # (a malformed grammar is the engine's to refuse, not the router's)
        return ""


class Board:
    """What the routers of one process share with its other parts (Ray Serve's ingress): the
    routers themselves (each sees the replicas' reports), and the replicas that refused a request
    as unavailable (replica -> until when, ``time.monotonic``, they get none). Ray Serve sends a
    request router's module to the process by value, so its globals are copies: this lives here."""

    def __init__(self) -> None:
        self.routers: list[Any] = []
        self.unavailable: dict[str, float] = {}


BOARD = Board()
