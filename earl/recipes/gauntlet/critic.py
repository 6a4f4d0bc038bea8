"""The gauntlet recipe's critic: the Tic-Tac-Toe table, crediting each move within its own game.

A gauntlet's games are independent (fresh board, fresh opponent seed), and surviving more of
them is the same as surviving each one more often; so a move is credited by how its *game*
ended, not by how many games followed it. That keeps the variance of the later games out of
every earlier move's credit. `GameCritic` cuts each gauntlet into its games (a game ends on a
move with a nonzero reward: `earl.agents.gauntlet` pays `survive` or `loss` on a game's last
move and 0 on the others) and hands the games to `TabularCritic` as if each were a trajectory
of its own: the same observation keys (the tokens since the previous move), the same Q(s, a)
table, so a board seen in game 12 shares its value with the same board in game 1. An
unfinished last game (the trajectory cap cut it) is scored as the rewards say: 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from earl import Trajectory
from earl.recipes.tictactoe.critic import TabularCritic

__all__ = ["GameCritic", "split_games"]

Games = tuple[list[Trajectory], list[list[float]], list[tuple[int, int]]]


def split_games(trajs: Sequence[Trajectory], turn_rewards: Sequence[Sequence[float]]) -> Games:
    """Each trajectory's games as trajectories of their own.

    Returns:
        The games (token ids from the end of the previous game's last move to the end of the
        game's last move, turn spans shifted to match), their turn rewards, and per game
        (trajectory index, index of its first turn in that trajectory).
    """
    games: list[Trajectory] = []
    rewards: list[list[float]] = []
    where: list[tuple[int, int]] = []
    for i, (t, rs) in enumerate(zip(trajs, turn_rewards, strict=True)):
        first, lo = 0, 0
        for k in range(len(rs)):
            if rs[k] == 0 and k < len(rs) - 1:
                continue
            hi = t.turn_spans[k][1]
            spans = [(s - lo, e - lo) for s, e in t.turn_spans[first:k + 1]]
            games.append(Trajectory(sample_id=f"{t.sample_id}/{len(where)}", group_id=t.group_id,
                                    token_ids=t.token_ids[lo:hi], turn_spans=spans))
            rewards.append(list(rs[first:k + 1]))
            where.append((i, first))
            first, lo = k + 1, hi
    return games, rewards, where


class GameCritic(TabularCritic):
    """`TabularCritic` over the games of each gauntlet (see the module docstring); same args."""

    def advantages(self, trajs: Sequence[Trajectory],
                   turn_rewards: Sequence[Sequence[float]]) -> list[list[float]]:
        games, rewards, where = split_games(trajs, turn_rewards)
        out: list[list[float]] = [[] for _ in trajs]
        for (i, _), adv in zip(where, TabularCritic.advantages(self, games, rewards), strict=True):
            out[i] += adv
        return out

    def update(self, trajs: Sequence[Trajectory],
               turn_rewards: Sequence[Sequence[float]]) -> None:
        games, rewards, _ = split_games(trajs, turn_rewards)
        TabularCritic.update(self, games, rewards)

    def better_actions(self, trajs: Sequence[Trajectory], *, min_visits: int = 3,
                       margin: float = 0.1) -> list[tuple[int, int, tuple[int, ...], float]]:
        # the agent's own move rewards mark the games; without them (a failed gauntlet) the
        # whole trajectory is one unfinished game
        own = [t.turn_rewards if len(t.turn_rewards) == t.num_turns else [0.0] * t.num_turns
               for t in trajs]
        games, _, where = split_games(trajs, own)
        return [(where[g][0], where[g][1] + k, act, gain) for g, k, act, gain in
                TabularCritic.better_actions(self, games, min_visits=min_visits, margin=margin)]
