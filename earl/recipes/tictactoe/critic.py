"""The Tic-Tac-Toe recipe's critic: a table of per-move credit over board observations.

The value of an observation (the exact tokens the environment showed before an assistant turn)
is a running average of the returns that followed it. A move's advantage is then its
lambda-return minus the value of the observation it answered, so a move that leads to states
from which games are usually lost is blamed even when that game happened to be won — far less
variance than crediting every move with the final outcome. Unseen observations fall back to the
mean return at that turn index. It suits any env with few distinct observations (a board game);
it is not a neural value head and knows nothing of tokens beyond using them as keys. It
implements `earl.Critic`; the recipe hands its factory to the loop (`Recipe.critic`).

With `q_weight > 0` the critic also keeps Q(s, a): the running average of the returns that
followed each (observation, reply tokens) pair. A move's advantage then leans, as the pair is
seen more often, on Q(s, a) - V(s) instead of this one game's return: a mistake that loses only
sometimes (a missed block against a random opponent loses ~1 game in 5) is then blamed every
time it is made, not just in the games where it happened to lose.

Example:
    >>> critic = TabularCritic(alpha=0.2, lam=0.5)
    >>> advs = critic.advantages(trajs, turn_rewards)  # per trajectory, one value per turn
    >>> critic.update(trajs, turn_rewards)             # after computing advantages
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from earl import Trajectory


def turn_actions(t: Trajectory) -> list[tuple[int, ...]]:
    """One entry per assistant turn: the tokens the model replied with."""
    return [tuple(t.token_ids[start:end]) for start, end in t.turn_spans]


def observation_keys(t: Trajectory) -> list[bytes]:
    """One key per assistant turn: the tokens between the previous turn and this one."""
    keys, prev = [], 0
    for start, end in t.turn_spans:
        keys.append(bytes(memoryview(_pack(t.token_ids[prev:start]))))
        prev = end
    return keys


def _pack(ids: Sequence[int]) -> bytes:
    return b"".join(i.to_bytes(4, "little") for i in ids)


def returns_to_go(rewards: Sequence[float]) -> list[float]:
    out, g = [0.0] * len(rewards), 0.0
    for k in range(len(rewards) - 1, -1, -1):
        g += rewards[k]
        out[k] = g
    return out


class TabularCritic:
    """Running-average values keyed by observation; lambda-return advantages.

    Args:
        alpha: step size of the running average (after the first visit, which sets it).
        lam: 0 = one-step TD advantages, 1 = Monte-Carlo return minus value.
        q_weight: how many earlier visits of an (observation, reply) pair count as much as this
            game's return; 0 turns Q(s, a) off (pure lambda-return advantages).
        max_states: observations kept (the least recently updated forgotten first): a policy
            that still plays
            junk makes new observations every game, and a long run's table (checkpointed with
            the producer) would grow without end. Tic-Tac-Toe has 5,478 legal positions.
        max_replies: replies kept per observation in Q (the least visited forgotten first):
            replies are token sequences, and junk ones are new every time (the 2-hour soak's
            producer grew +74% in private memory by them). A position has at most 9 moves.
    """

    def __init__(self, *, alpha: float = 0.2, lam: float = 0.5, q_weight: float = 0.0,
                 max_states: int = 20_000, max_replies: int = 16) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"critic alpha={alpha} must be in (0, 1]")
        if not 0 <= lam <= 1:
            raise ValueError(f"critic lam={lam} must be in [0, 1]")
        if q_weight < 0:
            raise ValueError(f"critic q_weight={q_weight} must be >= 0")
        if max_states < 1 or max_replies < 1:
            raise ValueError(f"critic max_states={max_states} and max_replies={max_replies} "
                             "must be >= 1")
        self.alpha, self.lam, self.q_weight, self.max_states = alpha, lam, q_weight, max_states
        self.max_replies = max_replies
        self.values: dict[bytes, float] = {}
        self.turn_means: dict[int, float] = {}
        # Q(s, a): observation key -> reply tokens -> (running mean return, visits)
        self.q: dict[bytes, dict[tuple[int, ...], tuple[float, int]]] = {}

    def value(self, key: bytes, turn: int) -> float:
        v = self.values.get(key)
        return self.turn_means.get(turn, 0.0) if v is None else v

    def advantages(self, trajs: Sequence[Trajectory],
                   turn_rewards: Sequence[Sequence[float]]) -> list[list[float]]:
        out = []
        for t, rewards in zip(trajs, turn_rewards, strict=True):
            keys = observation_keys(t)[:len(rewards)]
            n = len(keys)
            vs = [self.value(k, i) for i, k in enumerate(keys)]
            adv, g = [0.0] * n, 0.0
            for k in range(n - 1, -1, -1):
                g = rewards[k] if k == n - 1 else \
                    rewards[k] + self.lam * g + (1 - self.lam) * vs[k + 1]
                adv[k] = g - vs[k]
            if self.q_weight > 0:
                for k, (okey, act) in enumerate(zip(keys, turn_actions(t), strict=False)):
                    q, visits = self.q.get(okey, {}).get(act, (0.0, 0))
                    w = visits / (visits + self.q_weight)
                    adv[k] = w * (q - vs[k]) + (1 - w) * adv[k]
            out.append(adv)
        return out

    def update(self, trajs: Sequence[Trajectory],
               turn_rewards: Sequence[Sequence[float]]) -> None:
        for t, rewards in zip(trajs, turn_rewards, strict=True):
            keys, rets = observation_keys(t), returns_to_go(rewards)
            for i, (key, ret) in enumerate(zip(keys, rets, strict=False)):
                v = self.values.pop(key, None)  # re-inserted last: the most recent
                if v is None and len(self.values) >= self.max_states:
                    self.values.pop(next(iter(self.values)))  # the least recent
                self.values[key] = ret if v is None else v + self.alpha * (ret - v)
                m = self.turn_means.get(i)
                self.turn_means[i] = ret if m is None else m + 0.05 * (ret - m)
            if self.q_weight > 0:
                for okey, act, ret in zip(keys, turn_actions(t), rets, strict=False):
                    row = self.q.pop(okey, None)
                    if row is None and len(self.q) >= self.max_states:
                        self.q.pop(next(iter(self.q)))
                    row = self.q[okey] = row or {}
                    if act not in row and len(row) >= self.max_replies:
                        del row[min(row, key=lambda a: row[a][1])]  # the least visited
                    q, visits = row.get(act, (ret, 0))
                    row[act] = (q + max(self.alpha, 1 / (visits + 1)) * (ret - q), visits + 1)

    def better_actions(self, trajs: Sequence[Trajectory], *, min_visits: int = 3,
                       margin: float = 0.1) -> list[tuple[int, int, tuple[int, ...], float]]:
        """Replies known to beat the one each turn took: for self-imitation.

        For every turn whose observation has a reply seen at least `min_visits` times with
        Q(s, a*) - V(s) > `margin` (a* the best such reply, not the one taken), yields
        `(trajectory index, turn index, a* tokens, Q(s, a*) - V(s))`, best first.
        """
        out = []
        for i, t in enumerate(trajs):
            for k, (okey, act) in enumerate(zip(observation_keys(t), turn_actions(t),
                                                strict=True)):
                row = self.q.get(okey)
                if not row:
                    continue
                best = max(((q, a) for a, (q, n) in row.items() if n >= min_visits and a != act),
                           default=None)
                if best is None or best[0] <= row.get(act, (-math.inf, 0))[0]:
                    continue
                gain = best[0] - self.value(okey, k)
                if gain > margin:
                    out.append((i, k, best[1], gain))
        out.sort(key=lambda x: -x[3])
        return out

    def state_dict(self) -> dict[str, object]:
        """The tables, and their caps (what a reader needs to bound the checkpoint's size;
        `load_state_dict` keeps this critic's own)."""
        return {"max_states": self.max_states, "max_replies": self.max_replies,
                "values": {k.hex(): v for k, v in self.values.items()},
                "turn_means": {str(k): v for k, v in self.turn_means.items()},
                "q": [[k.hex(), [[list(a), q, n] for a, (q, n) in row.items()]]
                      for k, row in self.q.items()]}

    def load_state_dict(self, d: dict[str, object]) -> None:
        self.values = {bytes.fromhex(k): float(v) for k, v in d["values"].items()}  # type: ignore[attr-defined]
        self.turn_means = {int(k): float(v) for k, v in d["turn_means"].items()}  # type: ignore[attr-defined]
        self.q = {bytes.fromhex(k): {tuple(a): (float(q), int(n)) for a, q, n in row}
                  for k, row in d.get("q", [])}  # type: ignore[attr-defined]
