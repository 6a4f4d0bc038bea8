"""A user's own agent, outside the project, trained through the public path: `earl train
--agent PATH.py:NAME --tasks FILE.jsonl` and `earl.train(agent=..., tasks=...)`. Bad input is a
clear error naming the file, line and fix, before any actor starts; an agent that raises in
some episodes does not stop the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

AGENT = textwrap.dedent('''
    """A word game the project does not ship: say the word backwards, with a hint tool that
    keeps per-episode state (how many hints were used)."""

    async def agent(rollout, sample) -> float:
        hints = []

        def hint(position: int) -> str:
            """Reveal one letter of the reversed word.

            Args:
                position: which letter, from 0.
            """
            hints.append(position)
            return sample["word"][::-1][position % len(sample["word"])]

        messages = [{"role": "user", "content": "Reverse: " + sample["word"]}]
        for _ in range(3):
            turn = await rollout.generate(messages, tools=[hint])
            messages.append(turn.message)
            if not turn.tool_calls:
                if sample["word"] == "boom":
                    raise RuntimeError("the environment crashed on boom")
                rollout.info["hints"] = len(hints)
                return float(turn.content.strip() == sample["word"][::-1])
            for call in turn.tool_calls:
                messages.append(await rollout.call_tool(call))
        return 0.0
''')


def _earl(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "earl.cli", *args], capture_output=True,
                          text=True, timeout=500, env=env, check=False, cwd=cwd)


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    d = tmp_path / "user"
    d.mkdir()
    (d / "wordgame.py").write_text(AGENT)
    (d / "rules.py").write_text("def quarter(sample, response):\n    return 0.25\n")
    words = ["cat", "dog", "boom", "sun", "map", "red", "boom", "owl"]
    (d / "train.jsonl").write_text("".join(json.dumps({"word": w}) + "\n" for w in words))
    (d / "eval.jsonl").write_text("".join(json.dumps({"word": w}) + "\n"
                                          for w in ["hat", "pen", "boom", "ice"]))
    return d


def test_train_a_users_agent_from_the_cli(user_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    p = _earl("train", "--agent", f"{user_dir / 'wordgame.py'}:agent",
              "--tasks", str(user_dir / "train.jsonl"),
              "--eval-tasks", str(user_dir / "eval.jsonl"), "--output-dir", str(out),
              "--json", "--steps=2", "--batch_size=8", "--group_size=4", "--max_tokens=12",
              "--placement.reference=0", "--model.max_model_len=1024",
              "--reward", f"{user_dir / 'rules.py'}:quarter", "--dump_share=1", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["steps"] == 2 and res["policy_version"] == 2 and res["recipe"] == "agent"
    for key in ("eval", "eval_start"):
        assert res[key]["episodes"] == 4.0
        assert res[key]["failed_rate"] == pytest.approx(0.25)  # "boom" raises: failed, counted
        assert res[key]["reward"] == pytest.approx(0.25 * 3 / 4)  # the rule scored the rest
    assert res["failed_episodes"] == sum(f["episodes"] for f in res["failures"]) > 0
    assert [f["error"] for f in res["failures"]] == \
        ["RuntimeError: the environment crashed on boom"]
    dump = [json.loads(x) for x in Path(res["trajectories"]).read_text().splitlines()]
    # every trajectory put, the groups still out at the end included (partial rollouts)
    assert len(dump) >= 16 and all(len(d["loss_mask"]) == len(d["token_ids"]) for d in dump)
    assert "episodes failed" in p.stderr


OPENAI_96 = textwrap.dedent('''
    """An OpenAI-client agent that sets its own max_tokens, as agent frameworks do."""

    async def agent(rollout, sample) -> float:
        r = await rollout.openai_client().chat.completions.create(
            model="earl-policy", max_tokens=96,
            messages=[{"role": "user", "content": sample["question"]}])
        return float(str(sample["answer"]) in (r.choices[0].message.content or ""))
''')


def test_an_openai_client_agents_own_max_tokens_is_served(tmp_path: Path) -> None:
    """max_tokens=96 over the run's per-turn default (64) at the defaults: it trains."""
    (tmp_path / "agent96.py").write_text(OPENAI_96)
    root = Path(__file__).resolve().parents[2]
    p = _earl("train", "--agent", f"{tmp_path / 'agent96.py'}:agent",
              "--tasks", str(root / "envs" / "data" / "calc_train.jsonl"),
              "--output-dir", str(tmp_path / "run"), "--json", "--steps=2", "--batch_size=8",
              "--group_size=4", "--dump_share=1", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["steps"] == 2 and res["failed_episodes"] == 0 and res["failures"] == []
    dump = [json.loads(x) for x in Path(res["trajectories"]).read_text().splitlines()]
    assert max(sum(d["loss_mask"]) for d in dump) > 64  # served past the run's default


def test_an_agent_that_always_raises_stops_with_its_error(tmp_path: Path) -> None:
    """Every episode raises: the run stops at its first batch with the agent's exception text
    and count, in the error line, the JSON and run.log, and nothing after it (no traceback)."""
    (tmp_path / "crash.py").write_text(
        "async def agent(rollout, sample):\n    raise KeyError('no tool named calc')\n")
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "run"
    p = _earl("train", "--agent", f"{tmp_path / 'crash.py'}:agent",
              "--tasks", str(root / "envs" / "data" / "calc_train.jsonl"),
              "--output-dir", str(out), "--json", "--steps=2", "--batch_size=8",
              "--group_size=4", cwd=tmp_path)
    assert p.returncode == 2
    err = json.loads(p.stdout.strip().splitlines()[-1])
    assert err["failures"] == [{"error": "KeyError: 'no tool named calc'", "episodes": 8}]
    assert "8 failed (8x KeyError: 'no tool named calc')" in err["error"]
    last = p.stderr.strip().splitlines()[-1]
    assert last == err["error"] and "Traceback" not in p.stderr
    assert "8x KeyError: 'no tool named calc'" in (out / "run.log").read_text()


SLOW_AGENT = textwrap.dedent('''
    import asyncio

    async def agent(rollout, sample) -> float:
        turn = await rollout.generate([{"role": "user", "content": "Say " + sample["word"]}])
        if sample["slow"]:  # a straggler: only over-sampling lets its batch finish
            await asyncio.sleep(3600)
        return float(sample["word"] in turn.content)
''')


@pytest.mark.slow  # ~29 s: over-sampling is a bench row now, not the default
def test_over_sampled_groups_cut_the_stragglers(tmp_path: Path) -> None:
    """With `over_sample_groups=1` each batch plays 3 groups, trains the first 2 to finish and
    cuts the third; here the third of every batch never finishes, so the run completes only
    if the cut works, and nothing of the cut groups reaches the dump."""
    from earl.recipe import ListTasks

    (tmp_path / "slow.py").write_text(SLOW_AGENT)
    words = list("abcdef")
    by_cursor = [ListTasks(words, seed=0).sample(k) for k in range(6)]  # the run's task order
    slow = {by_cursor[2], by_cursor[5]}  # the third group of each batch
    tasks = [{"word": w, "slow": w in slow} for w in words]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    out = tmp_path / "run"
    p = _earl("train", "--agent", f"{tmp_path / 'slow.py'}:agent",
              "--tasks", str(tmp_path / "tasks.jsonl"), "--output-dir", str(out), "--json",
              "--steps=2", "--batch_size=8", "--group_size=4", "--max_tokens=4",
              "--over_sample_groups=1", "--eval_every=0", "--placement.reference=0",
              "--model.max_model_len=512", "--dump_share=1", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["steps"] == 2 and res["episodes"] == 16
    rows = [json.loads(x) for x in Path(res["metrics"]).read_text().splitlines()]
    steps = [r for r in rows if "step" in r and "reward" in r]
    assert [(r["episodes"], r["groups_cut"]) for r in steps] == [(8, 1), (8, 1)]
    dump = [json.loads(x) for x in Path(res["trajectories"]).read_text().splitlines()]
    assert sorted({d["group_id"] for d in dump}) == ["g0", "g1", "g3", "g4"]  # g2, g5 cut


def test_bad_agent_and_tasks_fail_before_any_actor(user_dir: Path, tmp_path: Path) -> None:
    tasks = str(user_dir / "train.jsonl")
    cases = [
        (["--agent", str(user_dir / "missing.py") + ":agent", "--tasks", tasks],
         ["missing.py", "does not exist"]),
        (["--agent", str(user_dir / "wordgame.py") + ":nope", "--tasks", tasks],
         ["does not define 'nope'", "agent"]),
        (["--agent", str(user_dir / "wordgame.py") + ":agent"], ["tasks", "FILE.jsonl"]),
    ]
    bad = user_dir / "bad.jsonl"
    bad.write_text('{"word": "ok"}\n{"word": oops}\n')
    cases.append((["--agent", str(user_dir / "wordgame.py") + ":agent", "--tasks", str(bad)],
                  ["bad.jsonl:2", "not valid JSON"]))
    for args, words in cases:
        t0 = time.perf_counter()
        p = _earl("train", *args, "--output-dir", str(tmp_path / "x"), "--json")
        assert p.returncode == 2, (args, p.stderr[-2000:])
        for w in words:
            assert w in p.stderr, (w, p.stderr[-2000:])
        assert json.loads(p.stdout.strip().splitlines()[-1])["exit_code"] == 2
        assert time.perf_counter() - t0 < 60  # no actor was started (no vLLM load)
        assert not (tmp_path / "x" / "checkpoint").exists()


def test_earl_train_from_python(user_dir: Path, tmp_path: Path) -> None:
    code = textwrap.dedent(f'''
        import json, sys
        sys.path.insert(0, {str(user_dir)!r})
        import earl
        from wordgame import agent
        words = ({{"word": w}} for w in ["cat", "dog", "sun", "map"] * 10)  # a generator
        res = earl.train(agent=agent, tasks=words, steps=1, batch_size=8, group_size=4,
                         max_tokens=8, model={{"max_model_len": 1024}},
                         output_dir={str(tmp_path / 'py')!r},
                         placement={{"reference": 0}}, dump_share=1.0, log=lambda s: None)
        print(json.dumps(res.to_json()))
    ''')
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=500, env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["steps"] == 1 and res["episodes"] == 8 and res["eval"] == {}


@pytest.mark.slow
def test_train_an_openai_client_agent(tmp_path: Path) -> None:
    """An agent written only against the `openai` client trains through the same path: each
    producer serves its sessions at an OpenAI-compatible endpoint that records tokens."""
    root = Path(__file__).resolve().parents[2]
    p = _earl("train", "--agent", f"{root / 'agents' / 'openai_calc.py'}:agent",
              "--tasks", str(root / "envs" / "data" / "calc_train.jsonl"),
              "--output-dir", str(tmp_path / "run"), "--json", "--steps=2", "--batch_size=8",
              "--group_size=4", "--max_tokens=24", "--placement.reference=0",
              "--model.max_model_len=1024", "--dump_share=1", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["steps"] == 2 and res["episodes"] >= 16 and not res["failed_episodes"]
    dump = [json.loads(x) for x in Path(res["trajectories"]).read_text().splitlines()]
    assert dump and all(sum(d["loss_mask"]) > 0 for d in dump)  # recorded token-exactly


@pytest.mark.slow
def test_train_a_langgraph_agent(tmp_path: Path) -> None:
    """A LangGraph ReAct agent over LangChain's `ChatOpenAI` (`langgraph_calc.py`, as its author
    wrote it) trains for two steps through `earl.train(agent=..., tasks=...)`: each producer's
    endpoint records its requests token-exactly."""
    here = Path(__file__).resolve().parent
    data = here.parents[1] / "envs" / "data" / "calc_train.jsonl"
    code = textwrap.dedent(f'''
        import json, sys
        sys.path.insert(0, {str(here)!r})
        import earl
        from langgraph_calc import agent
        tasks = [json.loads(x) for x in open({str(data)!r})]
        res = earl.train(agent=agent, tasks=tasks, steps=2, batch_size=8, group_size=4,
                         max_tokens=24, model={{"max_model_len": 1024}},
                         output_dir={str(tmp_path / 'run')!r},
                         placement={{"reference": 0}}, dump_share=1.0, log=lambda s: None)
        print(json.dumps(res.to_json()))
    ''')
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=500, env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=False,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["steps"] == 2 and res["episodes"] >= 16 and not res["failed_episodes"]
    dump = [json.loads(x) for x in Path(res["trajectories"]).read_text().splitlines()]
    assert dump and all(sum(d["loss_mask"]) > 0 for d in dump)  # recorded token-exactly
